"""The disk tier's files: entries of named arrays under keys, in one directory.

An entry is a file of its own, ``<fingerprint>-<key>.kv``, in the format of
``storage/disk_format.py``, or one of the entries of a *pack*,
``<fingerprint>-<first key>-<id>.kvp``: up to ``PACK_ENTRIES`` entries of one
size (and a quarter of ``max_bytes``) written back to back by
``put_many_later`` (a prefix's blocks, spilled together). Reading a file costs
more than reading its bytes (BENCHMARKS.md, run 160), so a pack reads many
entries in one call. ``read_run`` reads many entries of one layout into one
buffer, on several threads, checking each entry's length, checksum, key and
header against the first; the caller turns the buffer into arrays in one copy.
A start reads each pack's keys.

A file is written under a temporary name of its writer's own and renamed, so a
reader sees a whole file or none; a writer killed midway leaves a temporary
file that a later start deletes. A truncated, corrupted, foreign (another
fingerprint) or old-format file is deleted with a log line and reads as a miss;
a pack with one bad entry goes as a whole.
The directory is kept under ``max_bytes`` by deleting the least recently used
files (by modification time, which a read refreshes), whichever model wrote
them. Several processes may share the directory: each writes its own temporary
files, and a file another one deleted is a miss. A directory that cannot be
written (read-only, full, not a directory) turns the store off with one warning.

Writes may go through ``put_later``: a background thread encodes and writes
them, so the caller's thread does not wait for the disk; ``flush`` waits for
them. The index of files is guarded by a lock, so reads and writes can overlap.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from .disk_format import (
    FORMAT_VERSION,
    Run,
    crc_ok,
    encode,
    entry_key,
    parse,
    parse_head,
    same_header,
)

__all__ = ["FORMAT_VERSION", "DiskStore", "Run", "encode"]

logger = logging.getLogger("mlx_paged.disk")

SUFFIX = ".kv"
PACK_SUFFIX = ".kvp"
#: Most entries one pack holds.
PACK_ENTRIES = 64
#: Bytes a start reads of a pack's first entry to find its size (its header fits), and
#: of each entry to find its key (the prefix and a key of up to 236 bytes).
HEAD_BYTES = 1 << 20
HEAD_KEY = 256
_UTIME_FD = os.utime in os.supports_fd
#: Temporary files older than this are a dead writer's (seconds).
STALE_TEMP_SECONDS = 600.0
#: Threads that read (and check) files at once.
READ_THREADS = min(16, os.cpu_count() or 1)


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
        # Every entry file and pack in the directory, least recently used first: name ->
        # bytes. This fingerprint's packs: name -> (their keys, bytes per entry); and
        # where each of their keys lies: key -> (pack, index).
        self._files: OrderedDict[str, int] = OrderedDict()
        self._packs: dict[str, tuple[list[str], int]] = {}
        self._where: dict[str, tuple[str, int]] = {}
        self._lock = threading.Lock()
        self._pending: set[str] = set()  # names queued by put_later, not yet written
        self._queue: queue.Queue | None = None
        self._readers = ThreadPoolExecutor(READ_THREADS, "mlx_paged-disk-read")  # lazy threads
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
        if not self.enabled:
            return False
        if self._name(key) in self._pending:
            return True
        with self._lock:
            return self._locate_locked(key) is not None

    @property
    def keys(self) -> list[str]:
        """This fingerprint's keys, least recently used first."""
        head = f"{self.fingerprint}-"
        found = []
        with self._lock:
            for name in self._files:
                if name in self._packs:
                    keys = self._packs[name][0]
                    found += [k for i, k in enumerate(keys) if self._where.get(k) == (name, i)]
                elif name.startswith(head) and name.endswith(SUFFIX):
                    found.append(name[len(head) : -len(SUFFIX)])
        return list(reversed(dict.fromkeys(reversed(found))))  # each once, where last used

    def size(self, key: str) -> int | None:
        """The bytes of ``key``'s entry, or ``None`` if the store has none."""
        if not self.enabled:
            return None
        with self._lock:
            got = self._locate_locked(key)
        return got[2] if got is not None else None

    def location(self, key: str) -> tuple[Path, int, int] | None:
        """Where ``key``'s entry lies: its file, its offset there and its bytes."""
        with self._lock:
            got = self._locate_locked(key) if self.enabled else None
        if got is None:
            return None
        name, index, size = got
        return self.path / name, (index or 0) * size, size

    # ---- writes -----------------------------------------------------------

    def put(self, key: str, arrays: dict[str, np.ndarray]) -> bool:
        """Write an entry (replacing one with the same key); False if the store is off or
        the write failed (which turns it off)."""
        if not self.enabled:
            return False
        return self._write(self._name(key), key, arrays)

    def put_later(self, key: str, arrays: dict[str, np.ndarray]) -> None:
        """``put`` on the background writer; ``key in store`` holds from now on."""
        self.put_many_later([(key, arrays)])

    def put_many_later(self, items: Sequence[tuple[str, dict[str, np.ndarray]]]) -> None:
        """``put_later`` of each ``(key, arrays)``, in packs: the entries of one size that
        follow each other go into one file, up to ``PACK_ENTRIES`` at a time."""
        if not self.enabled or not items:
            return
        names = [self._name(key) for key, _ in items]
        if self._queue is None:
            self._queue = queue.Queue()
            threading.Thread(target=self._drain, name="mlx_paged-disk", daemon=True).start()
        self._pending.update(names)
        self._queue.put((names, list(items)))

    def flush(self) -> None:
        """Wait until every ``put_later`` is written (or dropped, if the store turned off)."""
        if self._queue is not None:
            self._queue.join()

    # ---- reads ------------------------------------------------------------

    def get(self, key: str) -> dict[str, np.ndarray] | None:
        """The entry's arrays, or ``None`` when there is no valid one (a bad file is deleted)."""
        run = self.read_run([key])
        return run.arrays(0) if run is not None else None

    def read_run(
        self, keys: Sequence[str], out: Callable[[int, int], np.ndarray] | None = None
    ) -> Run | None:
        """The longest leading run of ``keys`` whose files are valid and of one layout,
        read into one buffer; ``None`` when the first is missing or bad.

        Bad files in the run are deleted with a log line; the run stops before
        the first of them, and before the first file of another size. ``out(rows,
        size)``, if given, returns the ``(rows, size)`` uint8 buffer to read into
        (reusing memory spares the page faults).
        """
        rows: list[tuple[str, int | None, int]] = []  # (file, index in its pack, file bytes)
        size = None
        with self._lock:
            for key in keys:
                got = self._locate_locked(key) if self.enabled else None
                if got is None or (size is not None and got[2] != size):
                    break
                name, index, size = got
                rows.append((name, index, self._files[name]))
        if not rows:
            self.counts["misses"] += 1
            return None
        start = time.perf_counter()
        if out is not None:
            data = out(len(rows), size)
        else:
            data = np.empty((len(rows), size), dtype=np.uint8)
        # One task per reader thread, each reading its share of the entries in turn (a
        # small file's read costs less than handing a task to a thread, run 160), and
        # the entries of a pack that follow each other in one call.
        share = -(-len(rows) // READ_THREADS)
        tasks: list[list[tuple[str, int | None, int, int, int]]] = [[]]
        filled = 0
        for r, (name, index, total) in enumerate(rows):
            if filled == share:
                tasks.append([])
                filled = 0
            task = tasks[-1]
            if (
                task
                and index is not None
                and task[-1][0] == name
                and task[-1][1] == index - (r - task[-1][3])
            ):
                first = task[-1]
                task[-1] = (name, first[1], total, first[3], first[4] + 1)
            else:
                task.append((name, index, total, r, 1))
            filled += 1
        if len(tasks) == 1:
            errors = self._read_segments(tasks[0], data)
        else:
            parts = self._readers.map(self._read_segments, tasks, [data] * len(tasks))
            errors = [e for part in parts for e in part]
        n, specs, payload = 0, None, 0
        for (name, _, _), key, error in zip(rows, keys, errors, strict=False):
            if error is None and n == 0:
                try:
                    specs, payload = parse(data[0], self.fingerprint)
                except ValueError as e:
                    error = e
            if error is None and not same_header(data[0], data[n], key, payload):
                error = ValueError("written for another key, or in another layout than the first")
            if error is not None:
                gone = isinstance(error, FileNotFoundError)  # another process deleted it
                if not gone:
                    logger.warning("mlx_paged: deleting the disk-tier file %s: %s", name, error)
                with self._lock:
                    self._drop_locked(name, delete=not gone)
                break
            n += 1
        if n == 0:
            self.counts["misses"] += 1
            return None
        with self._lock:
            for name in dict.fromkeys(name for name, _, _ in rows[:n]):
                if name in self._files:
                    self._files.move_to_end(name)
        self.counts["hits"] += n
        self.seconds["read"] += time.perf_counter() - start
        return Run(data[:n], specs, payload)

    # ---- internals --------------------------------------------------------

    def _name(self, key: str) -> str:
        if not key or not key.isalnum():
            raise ValueError(f"a disk-tier key must be letters and digits, got {key!r}.")
        return f"{self.fingerprint}-{key}{SUFFIX}"

    def _locate_locked(self, key: str) -> tuple[str, int | None, int] | None:
        """``(file, index in its pack or None, entry bytes)`` of ``key``'s entry, if any."""
        name = self._name(key)
        size = self._files.get(name)
        if size is not None:
            return name, None, size
        at = self._where.get(key)
        if at is None:
            return None
        return at[0], at[1], self._packs[at[0]][1]

    def _read_segments(
        self, segments: list[tuple[str, int | None, int, int, int]], data: np.ndarray
    ) -> list[Exception | None]:
        """Read each ``(file, index, file bytes, first row, entries)`` segment into its rows
        of ``data``, in turn; one error (or ``None``) per entry."""
        errors: list[Exception | None] = []
        for name, index, total, row, count in segments:
            out = data[row : row + count]
            if index is None:
                errors.append(self._read_one(name, out[0]))
            else:
                errors += self._read_pack(name, index, total, out)
        return errors

    def _read_pack(
        self, name: str, index: int, total: int, out: np.ndarray
    ) -> list[Exception | None]:
        """Read entries ``index, index + 1, ...`` of pack ``name`` (``total`` bytes when
        indexed) into the rows of ``out`` and check each one's checksum."""
        try:
            fd = os.open(self.path / name, os.O_RDONLY)
        except OSError as e:
            return [e] * len(out)
        try:
            got = os.fstat(fd).st_size
            if got != total:
                error = ValueError(f"truncated or rewritten ({got} bytes, {total} indexed)")
                return [error] * len(out)
            os.lseek(fd, index * out.shape[1], os.SEEK_SET)
            got = os.readv(fd, list(out))
            if got != out.size:
                return [ValueError(f"truncated ({got} of {out.size} bytes read)")] * len(out)
            bad = ValueError("the checksum of an entry does not match (corrupted)")
            errors = [None if crc_ok(row) else bad for row in out]
            if not any(errors):
                try:
                    os.utime(fd if _UTIME_FD else self.path / name)
                except OSError:
                    pass
            return errors
        except OSError as e:
            return [e] * len(out)
        finally:
            os.close(fd)

    def _read_one(self, name: str, out: np.ndarray) -> Exception | None:
        """Read file ``name`` into ``out`` (its whole size) and check its length and CRC;
        the error, or ``None``. Runs on reader threads: no shared state. A bare file
        descriptor, not a file object: a small file's read is mostly per-call cost."""
        path = self.path / name
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as e:
            return e
        try:
            got = os.readv(fd, [out])
            grown = os.fstat(fd).st_size > out.size
            if got == out.size and not grown:
                if not crc_ok(out):
                    error = ValueError("the checksum does not match (corrupted)")
                else:
                    try:
                        os.utime(fd if _UTIME_FD else path)  # most recently used, for later
                    except OSError:
                        pass
                    return None
            else:
                error = ValueError(f"truncated or rewritten ({got} bytes read, {out.size} indexed)")
        except OSError as e:
            return e
        finally:
            os.close(fd)
        try:  # the header may say more: another format, version or fingerprint
            parse(out[:got], self.fingerprint)
        except (ValueError, KeyError, UnicodeDecodeError) as e:
            error = ValueError(str(e)) if str(e) else error
        return error

    def _write(self, name: str, key: str, arrays: dict[str, np.ndarray]) -> bool:
        return self._write_file(name, [encode(self.fingerprint, key, arrays)], [key])

    def _write_many(self, items: list[tuple[str, dict[str, np.ndarray]]]) -> None:
        """Write ``(key, arrays)`` entries: runs of one size in packs, others alone."""
        entries = [(key, encode(self.fingerprint, key, arrays)) for key, arrays in items]
        i = 0
        while i < len(entries) and self.enabled:
            # A pack takes at most a quarter of the cap, which drops whole files.
            most = min(PACK_ENTRIES, self.max_bytes // (4 * len(entries[i][1])))
            j = i + 1
            while j < len(entries) and j - i < most:
                if len(entries[j][1]) != len(entries[i][1]):
                    break
                j += 1
            keys, datas = [k for k, _ in entries[i:j]], [d for _, d in entries[i:j]]
            if j - i == 1:
                self._write_file(self._name(keys[0]), datas, keys)
            else:
                name = f"{self.fingerprint}-{keys[0]}-{uuid.uuid4().hex[:12]}{PACK_SUFFIX}"
                self._write_file(name, datas, keys, pack=True)
            i = j

    def _write_file(self, name: str, datas: list[bytes], keys: list[str], pack: bool = False):
        """Write one file of ``datas`` (the entries of ``keys``) and index it."""
        start = time.perf_counter()
        temp = self.path / f".{name}.{os.getpid()}.{uuid.uuid4().hex}.tmp"
        try:
            with open(temp, "wb") as f:
                for data in datas:
                    f.write(data)
            os.replace(temp, self.path / name)
        except OSError as e:
            temp.unlink(missing_ok=True)
            self._disable(f"writing {name!r} failed: {e}")
            return False
        size = sum(len(d) for d in datas)
        with self._lock:
            self._drop_locked(name, delete=False)
            self._files[name] = size
            if pack:
                self._index_pack_locked(name, keys, len(datas[0]))
            self.bytes += size
            self.counts["writes"] += len(keys)
            self._shrink_locked()
            self.seconds["write"] += time.perf_counter() - start
        return True

    def _index_pack_locked(self, name: str, keys: list[str], entry: int) -> None:
        self._packs[name] = (keys, entry)
        for i, key in enumerate(keys):
            self._where[key] = (name, i)

    def _drain(self) -> None:
        while True:
            names, items = self._queue.get()
            try:
                if self.enabled:
                    self._write_many(items)
            except Exception:  # a write that fails for another reason must not end the thread
                logger.exception("mlx_paged: writing the disk-tier files %s failed", names)
            finally:
                self._pending.difference_update(names)
                self._queue.task_done()

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
            elif entry.name.endswith((SUFFIX, PACK_SUFFIX)):
                found.append((stat.st_mtime, entry.name, stat.st_size))
        head = f"{self.fingerprint}-"
        with self._lock:
            for _, name, size in sorted(found):
                if name.endswith(PACK_SUFFIX) and name.startswith(head):
                    try:
                        self._index_pack_locked(name, *self._pack_keys(name, size))
                    except (OSError, ValueError, KeyError, UnicodeDecodeError) as e:
                        if not isinstance(e, FileNotFoundError):
                            logger.warning("mlx_paged: deleting the disk-tier file %s: %s", name, e)
                            Path(self.path / name).unlink(missing_ok=True)
                        continue
                self._files[name] = size
                self.bytes += size
            self._shrink_locked()

    def _pack_keys(self, name: str, size: int) -> tuple[list[str], int]:
        """The keys of pack ``name`` (``size`` bytes) in order, and its bytes per entry."""
        with open(self.path / name, "rb", buffering=0) as f:
            head = np.frombuffer(f.read(min(size, HEAD_BYTES)), dtype=np.uint8)
            _, _, entry = parse_head(head, self.fingerprint)
            if size % entry or size < 2 * entry:
                raise ValueError(f"truncated or grown: {size} bytes, entries of {entry}")
            keys = []
            for i in range(size // entry):
                f.seek(i * entry)
                keys.append(entry_key(np.frombuffer(f.read(HEAD_KEY), dtype=np.uint8)))
        return keys, entry

    def _shrink_locked(self) -> None:
        while self.bytes > self.max_bytes and self._files:
            self._drop_locked(next(iter(self._files)))

    def _drop_locked(self, name: str, delete: bool = True) -> None:
        """Take a file (a pack with all its entries) out of the index (and delete it)."""
        self.bytes -= self._files.pop(name, 0)
        keys, _ = self._packs.pop(name, ((), 0))
        for i, key in enumerate(keys):
            if self._where.get(key) == (name, i):
                del self._where[key]
        if delete:
            (self.path / name).unlink(missing_ok=True)
            self.counts["dropped"] += 1

    def _disable(self, why: str) -> None:
        if self.enabled:
            logger.warning("mlx_paged: the disk tier is off: %s", why)
        self.enabled = False
