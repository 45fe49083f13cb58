"""The disk tier's files: entries of named arrays under keys, in one directory.

An entry is a file of its own, ``<fingerprint>-<key>.kv``, in the format of
``storage/disk_format.py``, or one of the entries of a *pack*,
``<fingerprint>-<first key>-<id>.kvp``: up to ``PACK_ENTRIES`` entries of one
size (and a quarter of ``max_bytes``) written back to back by
``put_many_later`` (a prefix's blocks, spilled together). Reading a file costs
more than reading its bytes (BENCHMARKS.md, run 160), so a pack reads many
entries in one call. ``read_run`` reads many entries of one layout into one
buffer, on several threads, checking each entry's length, checksums, key and
header against the first; the caller turns the buffer into arrays in one copy
(and may check the payloads' sums there instead, on the GPU: ``discard`` drops a
file that fails).
A start reads each pack's keys.

A file is written under a temporary name of its writer's own and renamed, so a
reader sees a whole file or none; a writer killed midway leaves a temporary
file that a later start deletes. A truncated, corrupted, foreign (another
fingerprint) or old-format file is deleted with a log line and reads as a miss;
a pack with one bad entry goes as a whole.
The directory is kept under ``max_bytes`` by deleting the least recently used
files (by modification time, which a read refreshes on the background thread),
whichever model wrote them. Several processes may share the directory: each
writes its own temporary files, and a file another one deleted is a miss (once
``close_files`` has closed the descriptors reads keep open, ``OpenFiles``). A
directory that cannot be written (read-only, full, not a directory) turns the
store off with one warning.

Writes may go through ``put_later``: a background thread encodes and writes
them, so the caller's thread does not wait for the disk; ``flush`` waits for
them. The index of files is guarded by a lock, so reads and writes can overlap.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from pathlib import Path

import numpy as np

from .disk_files import (
    PACK_ENTRIES,
    PACK_SUFFIX,
    Background,
    OpenFiles,
    group_packs,
    plan_reads,
    scan_files,
    start_threads,
    touch,
    valid_rows,
    write_file,
)
from .disk_format import FORMAT_VERSION, Run, encode
from .disk_index import DiskIndex
from .disk_runs import read_tasks

__all__ = ["FORMAT_VERSION", "DiskStore", "Run", "encode"]

logger = logging.getLogger("mlx_paged.disk")

#: Temporary files older than this are a dead writer's (seconds).
STALE_TEMP_SECONDS = 600.0
#: Threads that read (and check) files at once.
READ_THREADS = min(16, os.cpu_count() or 1)


class DiskStore:
    """Entries of named numpy arrays in files under ``path``, for one model ``fingerprint``.

    Args:
        path: The directory (created if missing).
        max_bytes: Most bytes of entry files the directory holds.
        fingerprint: Identifies the model and cache settings (no other's entries return).
    """

    def __init__(self, path: str | os.PathLike, max_bytes: int, fingerprint: str):
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes <= 0:
            raise ValueError(f"max_bytes must be a positive int, got {max_bytes!r}.")
        if not fingerprint or not fingerprint.isalnum():
            raise ValueError(f"the fingerprint must be letters and digits, got {fingerprint!r}.")
        self.path, self.max_bytes, self.fingerprint = Path(path), max_bytes, fingerprint
        self.enabled = True
        self._index = DiskIndex(fingerprint)  # guarded by the lock
        self._lock = threading.Lock()
        self._pending: set[str] = set()  # names queued by put_later, not yet written
        self._later = Background("mlx_paged-disk", lambda: self.enabled)  # writes, touches
        self._readers = ThreadPoolExecutor(READ_THREADS, "mlx_paged-disk-read")  # lazy threads
        self._files = OpenFiles(self.path)
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
        return self.leading([key]) == 1

    def leading(self, keys: Sequence[str]) -> int:
        """How many of ``keys``, from the first, the store has (or is writing)."""
        if not self.enabled:
            return 0
        with self._lock:
            return self._index.leading(keys, self._pending)

    @property
    def bytes(self) -> int:
        """Bytes of every entry file and pack in the directory (every model's)."""
        return self._index.bytes

    @property
    def keys(self) -> list[str]:
        """This fingerprint's keys, least recently used first."""
        with self._lock:
            return self._index.keys()

    def size(self, key: str) -> int | None:
        """The bytes of ``key``'s entry, or ``None`` if the store has none."""
        got = self._locate(key)
        return got[2] if got is not None else None

    def location(self, key: str) -> tuple[Path, int, int] | None:
        """Where ``key``'s entry lies: its file, its offset there and its bytes."""
        got = self._locate(key)
        return None if got is None else (self.path / got[0], (got[1] or 0) * got[2], got[2])

    # ---- writes -----------------------------------------------------------

    def put(self, key: str, arrays: dict[str, np.ndarray]) -> bool:
        """Write an entry (replacing one with the same key); False if the store is off or
        the write failed (which turns it off)."""
        if not self.enabled:
            return False
        return self._write_file(
            self._index.name(key), [encode(self.fingerprint, key, arrays)], [key]
        )

    def put_later(self, key: str, arrays: dict[str, np.ndarray]) -> None:
        """``put`` on the background writer; ``key in store`` holds from now on."""
        self.put_many_later([(key, arrays)])

    def put_many_later(self, items: Sequence[tuple[str, dict[str, np.ndarray]]]) -> None:
        """``put_later`` of each ``(key, arrays)``, in packs: the entries of one size that
        follow each other go into one file, up to ``PACK_ENTRIES`` at a time."""
        if not self.enabled or not items:
            return
        names = [self._index.name(key) for key, _ in items]
        self._pending.update(names)
        done = partial(self._pending.difference_update, names)
        self._later.put(partial(self._write_many, list(items)), done)

    def flush(self) -> None:
        """Wait until every ``put_later`` is written (or dropped, if the store turned off),
        and every other job queued on the background thread is done."""
        self._later.join()

    # ---- reads ------------------------------------------------------------

    def get(self, key: str) -> dict[str, np.ndarray] | None:
        """The entry's arrays, or ``None`` when there is no valid one (a bad file is deleted)."""
        if (run := self.read_run([key])) is not None:
            self.hit(1)
        return run and run.arrays(0)

    def read_run(
        self,
        keys: Sequence[str],
        out: Callable[[int, int], np.ndarray] | None = None,
        payloads: bool = True,
        after: Future | None = None,
    ) -> Run | None:
        """The longest leading run of ``keys`` whose files are valid and of one layout,
        read into one buffer; ``None`` when the first is missing or bad.

        Bad files in the run are deleted with a log line; the run stops before
        the first of them, and before the first file of another size. ``out(rows,
        size)``, if given, returns the ``(rows, size)`` uint8 buffer to read into
        (reusing memory spares the page faults). ``payloads=False`` leaves the
        payloads' sums unchecked (``Run.checked``): the caller checks them and
        ``discard``s the file of the first entry that fails. The caller counts
        the entries it uses (``hit``): a run read ahead may never be used. A bad file is
        dropped once ``after`` (a read of earlier entries, maybe of one pack) is done.
        """
        with self._lock:
            rows, size = self._index.run_rows(keys) if self.enabled else ([], 0)
        if not rows:
            self._count("misses", 1)
            return None
        start = time.perf_counter()
        data = out(len(rows), size) if out else np.empty((len(rows), size), dtype=np.uint8)
        # One task per reader thread, each reading its share of the entries in turn (a
        # small file's read costs less than handing a task to a thread, run 160), and
        # the entries of a pack that follow each other in one call.
        tasks = plan_reads(rows, READ_THREADS)
        errors = read_tasks(self._readers, tasks, self._files, self.fingerprint, payloads, data)
        n, specs, payload, bad = valid_rows(data, keys, errors, self.fingerprint)
        if bad is not None:
            futures.wait([after] if after is not None else [])
            name, gone = rows[n][0], isinstance(bad, FileNotFoundError)  # another process's
            if not gone:
                logger.warning("mlx_paged: deleting the disk-tier file %s: %s", name, bad)
            with self._lock:
                self._drop_locked(name, delete=not gone)
        if n == 0:
            self._count("misses", 1)
            return None
        with self._lock:
            names = self._index.use(keys[:n])
        # mtimes (a later process's order) on the writer thread: readers' syscalls wait for the GIL
        self._later.put(partial(touch, self.path, names))
        with self._lock:  # reads of several runs may overlap
            self.seconds["read"] += time.perf_counter() - start
        return Run(data[:n], specs, payload, checked=payloads)

    def used(self, keys: Sequence[str]) -> None:
        """Mark the files of ``keys`` most recently used, in that order (a load's, whose
        runs' reads may end in another), on the background thread: a later process then
        finds a prefix's files in its order (``Preload``)."""
        self._later.put(partial(self._use, list(keys)))

    def _use(self, keys: list[str]) -> None:
        with self._lock:
            names = self._index.use(keys)
        touch(self.path, names)

    def close_files(self) -> None:
        """Close the descriptors reads keep open (``OpenFiles``), e.g. after a load, on the
        background thread: closing them can take milliseconds the caller need not wait."""
        self._later.put(self._files.clear)

    def start_threads(self) -> None:
        """Start the reader and writer threads now (a warm-up), not in the first load."""
        start_threads(self._readers, READ_THREADS)
        self._later.put(lambda: None)

    def hit(self, n: int) -> None:
        """Count ``n`` entries of a ``read_run`` that the caller found good and used."""
        self._count("hits", n)

    def _count(self, what: str, n: int) -> None:
        with self._lock:
            self.counts[what] += n

    def discard(self, key: str, why: str) -> None:
        """Delete ``key``'s file (a whole pack) with a log line: its reader found it bad."""
        with self._lock:
            got = self._index.locate(key)
            if got is not None:
                logger.warning("mlx_paged: deleting the disk-tier file %s: %s", got[0], why)
                self._drop_locked(got[0])

    # ---- internals --------------------------------------------------------

    def _locate(self, key: str) -> tuple[str, int | None, int] | None:
        with self._lock:
            return self._index.locate(key) if self.enabled else None

    def _write_many(self, items: list[tuple[str, dict[str, np.ndarray]]]) -> None:
        """Write ``(key, arrays)`` entries: runs of one size in packs, others alone."""
        entries = [(key, encode(self.fingerprint, key, arrays)) for key, arrays in items]
        # A pack takes at most a quarter of the cap, which drops whole files.
        most = min(PACK_ENTRIES, self.max_bytes // (4 * max(len(d) for _, d in entries)))
        for group in group_packs(entries, max(most, 1)):
            if not self.enabled:
                return
            keys, datas = [k for k, _ in group], [d for _, d in group]
            if len(group) == 1:
                self._write_file(self._index.name(keys[0]), datas, keys)
            else:
                name = f"{self.fingerprint}-{keys[0]}-{uuid.uuid4().hex[:12]}{PACK_SUFFIX}"
                self._write_file(name, datas, keys, pack=True)

    def _write_file(self, name: str, datas: list[bytes], keys: list[str], pack: bool = False):
        """Write one file of ``datas`` (the entries of ``keys``) and index it."""
        start = time.perf_counter()
        try:
            write_file(self.path, name, datas)
        except OSError as e:
            self._disable(f"writing {name!r} failed: {e}")
            return False
        with self._lock:
            pack = (keys, len(datas[0])) if pack else (None, 0)
            self._index.add(name, sum(len(d) for d in datas), *pack)
            self.counts["writes"] += len(keys)
            self._shrink_locked()
            self.seconds["write"] += time.perf_counter() - start
        return True

    def _scan(self) -> None:
        """Index the directory's entry files by age; delete dead writers' temporary files."""
        found = scan_files(self.path, self.fingerprint, STALE_TEMP_SECONDS)
        with self._lock:
            for name, size, pack in found:
                self._index.add(name, size, *pack)
            self._shrink_locked()

    def _shrink_locked(self) -> None:
        while self._index.bytes > self.max_bytes and self._index.files:
            self._drop_locked(next(iter(self._index.files)))

    def _drop_locked(self, name: str, delete: bool = True) -> None:
        """Take a file (a pack with all its entries) out of the index (and delete it)."""
        self._index.drop(name)
        self._files.forget(name)
        if delete:
            (self.path / name).unlink(missing_ok=True)
            self.counts["dropped"] += 1

    def _disable(self, why: str) -> None:
        if self.enabled:
            logger.warning("mlx_paged: the disk tier is off: %s", why)
        self.enabled = False
