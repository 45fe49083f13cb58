"""The disk tier's files: entries of named arrays under keys, in one directory.

One file per entry, ``<fingerprint>-<key>.kv``, in the format of
``storage/disk_format.py``. ``read_run`` reads many entries of one layout into
one buffer, on several threads, checking each file's length, checksum, key and
header against the first; the caller turns the buffer into arrays in one copy.

A file is written under a temporary name of its writer's own and renamed, so a
reader sees a whole file or none; a writer killed midway leaves a temporary
file that a later start deletes. A truncated, corrupted, foreign (another
fingerprint) or old-format file is deleted with a log line and reads as a miss.
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

from .disk_format import FORMAT_VERSION, Run, crc_ok, encode, parse, same_header

__all__ = ["FORMAT_VERSION", "DiskStore", "Run", "encode"]

logger = logging.getLogger("mlx_paged.disk")

SUFFIX = ".kv"
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
        # Every entry file in the directory, least recently used first: name -> bytes.
        self._files: OrderedDict[str, int] = OrderedDict()
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
        name = self._name(key)
        return self.enabled and (name in self._files or name in self._pending)

    @property
    def keys(self) -> list[str]:
        """This fingerprint's keys, least recently used first."""
        head = f"{self.fingerprint}-"
        with self._lock:
            names = list(self._files)
        return [n[len(head) : -len(SUFFIX)] for n in names if n.startswith(head)]

    def size(self, key: str) -> int | None:
        """The bytes of ``key``'s file, or ``None`` if the store has none."""
        return self._files.get(self._name(key)) if self.enabled else None

    # ---- writes -----------------------------------------------------------

    def put(self, key: str, arrays: dict[str, np.ndarray]) -> bool:
        """Write an entry (replacing one with the same key); False if the store is off or
        the write failed (which turns it off)."""
        if not self.enabled:
            return False
        return self._write(self._name(key), key, arrays)

    def put_later(self, key: str, arrays: dict[str, np.ndarray]) -> None:
        """``put`` on the background writer; ``key in store`` holds from now on."""
        if not self.enabled:
            return
        name = self._name(key)
        if self._queue is None:
            self._queue = queue.Queue()
            threading.Thread(target=self._drain, name="mlx_paged-disk", daemon=True).start()
        self._pending.add(name)
        self._queue.put((name, key, arrays))

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
        names, size = [], None
        with self._lock:
            for key in keys:
                name = self._name(key)
                got = self._files.get(name) if self.enabled else None
                if got is None or (size is not None and got != size):
                    break
                names.append(name)
                size = got
        if not names:
            self.counts["misses"] += 1
            return None
        start = time.perf_counter()
        if out is not None:
            data = out(len(names), size)
        else:
            data = np.empty((len(names), size), dtype=np.uint8)
        # One task per reader thread, each reading its share of the files in turn: a
        # small file's read costs less than handing a task to a thread (run 160).
        chunk = -(-len(names) // READ_THREADS)
        if chunk == len(names):
            errors = self._read_many(names, data)
        else:
            starts = range(0, len(names), chunk)
            parts = self._readers.map(
                self._read_many,
                [names[i : i + chunk] for i in starts],
                [data[i : i + chunk] for i in starts],
            )
            errors = [e for part in parts for e in part]
        n, specs, payload = 0, None, 0
        for name, error in zip(names, errors, strict=True):
            if error is None and n == 0:
                try:
                    specs, payload = parse(data[0], self.fingerprint)
                except ValueError as e:
                    error = e
            key = name[len(self.fingerprint) + 1 : -len(SUFFIX)]
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
            for name in names[:n]:
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

    def _read_many(self, names: Sequence[str], rows: np.ndarray) -> list[Exception | None]:
        """``_read_one`` of each name into its row, in turn."""
        return [self._read_one(name, row) for name, row in zip(names, rows, strict=True)]

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
        start = time.perf_counter()
        data = encode(self.fingerprint, key, arrays)
        temp = self.path / f".{name}.{os.getpid()}.{uuid.uuid4().hex}.tmp"
        try:
            temp.write_bytes(data)
            os.replace(temp, self.path / name)
        except OSError as e:
            temp.unlink(missing_ok=True)
            self._disable(f"writing {name!r} failed: {e}")
            return False
        size = len(data)
        with self._lock:
            self._drop_locked(name, delete=False)
            self._files[name] = size
            self.bytes += size
            self.counts["writes"] += 1
            self._shrink_locked()
            self.seconds["write"] += time.perf_counter() - start
        return True

    def _drain(self) -> None:
        while True:
            name, key, arrays = self._queue.get()
            try:
                if self.enabled:
                    self._write(name, key, arrays)
            except Exception:  # a write that fails for another reason must not end the thread
                logger.exception("mlx_paged: writing the disk-tier file %s failed", name)
            finally:
                self._pending.discard(name)
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
            elif entry.name.endswith(SUFFIX):
                found.append((stat.st_mtime, entry.name, stat.st_size))
        with self._lock:
            for _, name, size in sorted(found):
                self._files[name] = size
                self.bytes += size
            self._shrink_locked()

    def _shrink_locked(self) -> None:
        while self.bytes > self.max_bytes and self._files:
            self._drop_locked(next(iter(self._files)))

    def _drop_locked(self, name: str, delete: bool = True) -> None:
        """Take a file out of the index (and delete it)."""
        self.bytes -= self._files.pop(name, 0)
        if delete:
            (self.path / name).unlink(missing_ok=True)
            self.counts["dropped"] += 1

    def _disable(self, why: str) -> None:
        if self.enabled:
            logger.warning("mlx_paged: the disk tier is off: %s", why)
        self.enabled = False
