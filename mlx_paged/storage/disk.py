"""The disk tier's files: named arrays under a key, checked when read.

One file per entry, ``<fingerprint>-<key>.kv`` in one directory:

    b"MLXPGKV\\0", format version (u32), header length (u32), header (JSON: the
    fingerprint, the key, each array's name, dtype, shape and byte range),
    the arrays' bytes, then a BLAKE2b digest (32 bytes) of everything before it.

A file is written under a temporary name of its writer's own and renamed, so a
reader sees a whole file or none; a writer killed midway leaves a temporary
file that a later start deletes. A truncated, corrupted, foreign (another
fingerprint) or old-format file is deleted with a log line and reads as a miss.
The directory is kept under ``max_bytes`` by deleting the least recently used
files (by modification time, which a read refreshes), whichever model wrote
them. Several processes may share the directory: each writes its own temporary
files, and a file another one deleted is a miss. A directory that cannot be
written (read-only, full, not a directory) turns the store off with one warning.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
import time
import uuid
from collections import OrderedDict
from pathlib import Path

import numpy as np

logger = logging.getLogger("mlx_paged.disk")

MAGIC = b"MLXPGKV\0"
FORMAT_VERSION = 1
SUFFIX = ".kv"
_DIGEST = 32
_PREFIX = struct.Struct("<8sII")
#: Temporary files older than this are a dead writer's (seconds).
STALE_TEMP_SECONDS = 600.0


class DiskStore:
    """Entries of named numpy arrays in files under ``path``, for one model ``fingerprint``.

    Args:
        path: The directory (created if missing).
        max_bytes: Most bytes of entry files the directory holds.
        fingerprint: Identifies the model and cache settings; entries of another
            fingerprint are never returned.
    """

    def __init__(self, path: str | os.PathLike, max_bytes: int, fingerprint: str):
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes <= 0:
            raise ValueError(f"max_bytes must be a positive int, got {max_bytes!r}.")
        if not fingerprint or not fingerprint.isalnum():
            raise ValueError(f"the fingerprint must be letters and digits, got {fingerprint!r}.")
        self.path, self.max_bytes, self.fingerprint = Path(path), max_bytes, fingerprint
        self.enabled = True
        # Every entry file in the directory, least recently used first: name -> bytes.
        self._files: OrderedDict[str, int] = OrderedDict()
        self.bytes = 0
        self.counts = dict.fromkeys(("hits", "misses", "writes", "dropped"), 0)
        self.seconds = {"read": 0.0, "write": 0.0}
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            self._scan()
            probe = self.path / f".probe-{os.getpid()}-{uuid.uuid4().hex}.tmp"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as e:
            self._disable(f"the directory {str(self.path)!r} cannot be used: {e}")

    def __contains__(self, key: str) -> bool:
        return self.enabled and self._name(key) in self._files

    @property
    def keys(self) -> list[str]:
        """This fingerprint's keys, least recently used first."""
        head = f"{self.fingerprint}-"
        return [n[len(head) : -len(SUFFIX)] for n in self._files if n.startswith(head)]

    def put(self, key: str, arrays: dict[str, np.ndarray]) -> bool:
        """Write an entry (replacing one with the same key); False if the store is off or
        the write failed (which turns it off)."""
        if not self.enabled:
            return False
        start = time.perf_counter()
        data = encode(self.fingerprint, key, arrays)
        name = self._name(key)
        temp = self.path / f".{name}.{os.getpid()}.{uuid.uuid4().hex}.tmp"
        try:
            temp.write_bytes(data)
            os.replace(temp, self.path / name)
        except OSError as e:
            temp.unlink(missing_ok=True)
            self._disable(f"writing {name!r} failed: {e}")
            return False
        self._forget(name)
        self._files[name] = len(data)
        self.bytes += len(data)
        self.counts["writes"] += 1
        self._shrink()
        self.seconds["write"] += time.perf_counter() - start
        return True

    def get(self, key: str) -> dict[str, np.ndarray] | None:
        """The entry's arrays, or ``None`` when there is no valid one (a bad file is deleted)."""
        name = self._name(key)
        if not self.enabled or name not in self._files:
            self.counts["misses"] += 1
            return None
        start = time.perf_counter()
        path = self.path / name
        try:
            data = path.read_bytes()
            arrays = decode(data, self.fingerprint, key)
        except FileNotFoundError:  # another process deleted it
            self._forget(name)
            arrays = None
        except (OSError, ValueError) as e:
            logger.warning("mlx_paged: deleting the disk-tier file %s: %s", path, e)
            self._drop(name)
            arrays = None
        if arrays is None:
            self.counts["misses"] += 1
            return None
        self._files.move_to_end(name)
        try:
            os.utime(path)  # most recently used, for the next process too
        except OSError:
            pass
        self.counts["hits"] += 1
        self.seconds["read"] += time.perf_counter() - start
        return arrays

    # ---- internals --------------------------------------------------------

    def _name(self, key: str) -> str:
        if not key or not key.isalnum():
            raise ValueError(f"a disk-tier key must be letters and digits, got {key!r}.")
        return f"{self.fingerprint}-{key}{SUFFIX}"

    def _scan(self) -> None:
        """Index the directory's entry files by age; delete dead writers' temporary files."""
        found = []
        now = time.time()
        for entry in os.scandir(self.path):
            if not entry.is_file():
                continue
            try:
                stat = entry.stat()
            except FileNotFoundError:
                continue
            if entry.name.endswith(".tmp"):
                if now - stat.st_mtime > STALE_TEMP_SECONDS:
                    Path(entry.path).unlink(missing_ok=True)
            elif entry.name.endswith(SUFFIX):
                found.append((stat.st_mtime, entry.name, stat.st_size))
        for _, name, size in sorted(found):
            self._files[name] = size
            self.bytes += size
        self._shrink()

    def _shrink(self) -> None:
        while self.bytes > self.max_bytes and self._files:
            self._drop(next(iter(self._files)))

    def _drop(self, name: str) -> None:
        self._forget(name)
        (self.path / name).unlink(missing_ok=True)
        self.counts["dropped"] += 1

    def _forget(self, name: str) -> None:
        self.bytes -= self._files.pop(name, 0)

    def _disable(self, why: str) -> None:
        if self.enabled:
            logger.warning("mlx_paged: the disk tier is off: %s", why)
        self.enabled = False


def encode(fingerprint: str, key: str, arrays: dict[str, np.ndarray]) -> bytes:
    """An entry file's bytes."""
    specs, chunks, offset = [], [], 0
    for name, a in arrays.items():
        raw = np.ascontiguousarray(a).tobytes()
        specs.append([name, a.dtype.str, list(a.shape), offset, len(raw)])
        chunks.append(raw)
        offset += len(raw)
    header = json.dumps({"fingerprint": fingerprint, "key": key, "arrays": specs}).encode()
    body = _PREFIX.pack(MAGIC, FORMAT_VERSION, len(header)) + header + b"".join(chunks)
    return body + hashlib.blake2b(body, digest_size=_DIGEST).digest()


def decode(data: bytes, fingerprint: str, key: str) -> dict[str, np.ndarray]:
    """An entry file's arrays.

    Raises:
        ValueError: naming what is wrong: a short file, another format or version, a
            digest that does not match, another fingerprint or key.
    """
    if len(data) < _PREFIX.size + _DIGEST:
        raise ValueError(f"truncated ({len(data)} bytes)")
    magic, version, length = _PREFIX.unpack_from(data)
    if magic != MAGIC:
        raise ValueError("not a disk-tier file")
    if version != FORMAT_VERSION:
        raise ValueError(f"format version {version}, this build reads {FORMAT_VERSION}")
    body, digest = data[:-_DIGEST], data[-_DIGEST:]
    if hashlib.blake2b(body, digest_size=_DIGEST).digest() != digest:
        raise ValueError("the checksum does not match (truncated or corrupted)")
    header = json.loads(body[_PREFIX.size : _PREFIX.size + length])
    if header["fingerprint"] != fingerprint or header["key"] != key:
        raise ValueError(f"written for {header['fingerprint']}/{header['key']}")
    payload = memoryview(body)[_PREFIX.size + length :]
    out = {}
    for name, dtype, shape, start, size in header["arrays"]:
        raw = payload[start : start + size]
        out[name] = np.frombuffer(raw, dtype=np.dtype(dtype)).reshape(shape).copy()
    return out
