"""What a disk tier's directory holds, as one process sees it: files by age, and keys.

``DiskIndex`` lists every entry file and pack of the directory, least recently
used first, with their bytes (every model's: the cap counts them all), and where
each key of its own fingerprint lies: a file of its own, or an entry of a pack.
Pure bookkeeping; its owner (``DiskStore``) holds a lock around every call.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from .disk_files import SUFFIX


class DiskIndex:
    """Files by age and where each key's entry lies, for one ``fingerprint``."""

    def __init__(self, fingerprint: str):
        self.fingerprint = fingerprint
        self.files: OrderedDict[str, int] = OrderedDict()  # name -> bytes, oldest first
        self.bytes = 0
        self._packs: dict[str, tuple[list[str], int]] = {}  # name -> (keys, entry bytes)
        self._where: dict[str, tuple[str, int]] = {}  # key -> (pack, index)

    def name(self, key: str) -> str:
        """The file name of ``key``'s own entry file.

        Raises:
            ValueError: a key that is not letters and digits.
        """
        if not key or not key.isalnum():
            raise ValueError(f"a disk-tier key must be letters and digits, got {key!r}.")
        return f"{self.fingerprint}-{key}{SUFFIX}"

    def locate(self, key: str) -> tuple[str, int | None, int] | None:
        """``(file, index in its pack or None, entry bytes)`` of ``key``'s entry, if any;
        a file of its own comes before a pack."""
        name = self.name(key)
        size = self.files.get(name)
        if size is not None:
            return name, None, size
        at = self._where.get(key)
        if at is None:
            return None
        return at[0], at[1], self._packs[at[0]][1]

    def leading(self, keys: Sequence[str], pending: set[str]) -> int:
        """How many of ``keys``, from the first, have an entry here or a file name in
        ``pending`` (written soon)."""
        n = 0
        for key in keys:
            if key not in self._where:  # in a pack (most are), or in a file of its own
                name = self.name(key)
                if name not in self.files and name not in pending:
                    break
            n += 1
        return n

    def run_rows(self, keys: Sequence[str]) -> tuple[list[tuple[str, int | None, int]], int]:
        """``(file, index in its pack or None, file bytes)`` of the leading ``keys`` whose
        entries are indexed and of one size, and that size."""
        rows, size = [], 0
        for key in keys:
            got = self.locate(key)
            if got is None or (rows and got[2] != size):
                break
            name, index, size = got
            rows.append((name, index, self.files[name]))
        return rows, size

    def keys(self) -> list[str]:
        """This fingerprint's keys, least recently used first (each once)."""
        head, found = f"{self.fingerprint}-", []
        for name in self.files:
            if name in self._packs:
                keys = self._packs[name][0]
                found += [k for i, k in enumerate(keys) if self._where.get(k) == (name, i)]
            elif name.startswith(head) and name.endswith(SUFFIX):
                found.append(name[len(head) : -len(SUFFIX)])
        return list(reversed(dict.fromkeys(reversed(found))))

    def add(self, name: str, size: int, keys: list[str] | None = None, entry: int = 0) -> None:
        """Index a file of ``size`` bytes as the most recently used (replacing one of that
        name); with ``keys``, a pack of entries of ``entry`` bytes."""
        self.drop(name)
        self.files[name] = size
        self.bytes += size
        if keys is not None:
            self._packs[name] = (keys, entry)
            for i, key in enumerate(keys):
                self._where[key] = (name, i)

    def drop(self, name: str) -> None:
        """Take a file (a pack with every entry of it) out of the index."""
        self.bytes -= self.files.pop(name, 0)
        keys, _ = self._packs.pop(name, ((), 0))
        for i, key in enumerate(keys):
            if self._where.get(key) == (name, i):
                del self._where[key]

    def use(self, keys: Sequence[str]) -> list[str]:
        """Mark the files of ``keys`` most recently used, in that order; return them."""
        found = (self.locate(key) for key in keys)
        names = list(dict.fromkeys(got[0] for got in found if got is not None))
        for name in names:
            self.used(name)
        return names

    def used(self, name: str) -> None:
        """Mark a file most recently used."""
        if name in self.files:
            self.files.move_to_end(name)
