"""The disk tier's file reads and pack layout: what ``DiskStore`` does to its files.

Functions of paths and buffers, no index: read an entry file or a run of a
pack's entries into rows of a buffer (through descriptors kept open,
``OpenFiles``) and check each one's checksums (or only read them: ``read_tasks``
checks a whole run's heads at once); plan which reader thread reads which rows;
read a pack's keys; group entries into packs.
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
    ArraySpec,
    check,
    check_rows,
    entry_key,
    parse,
    parse_head,
    same_headers,
)

SUFFIX = ".kv"
PACK_SUFFIX = ".kvp"
#: Most entries one pack holds.
PACK_ENTRIES = 64
#: Bytes a start reads of a pack's first entry to find its size (its header fits), and
#: of each entry to find its key (the prefix and a key of up to 236 bytes).
HEAD_BYTES = 1 << 20
HEAD_KEY = 256

#: One reader task's piece: (file, index in its pack or None, the file's bytes, first
#: row of the buffer, entries).
Segment = tuple[str, "int | None", int, int, int]


def plan_reads(rows: list[tuple[str, int | None, int]], threads: int) -> list[list[Segment]]:
    """Split ``(file, index in its pack or None, file bytes)`` rows into one task per
    reader thread, each a list of segments; a pack's entries that follow each other in a
    task form one segment, read with one call."""
    share = -(-len(rows) // threads)
    tasks: list[list[Segment]] = [[]]
    filled = 0
    for r, (name, index, total) in enumerate(rows):
        if filled == share:
            tasks.append([])
            filled = 0
        task = tasks[-1]
        last = task[-1] if task else None
        if last and index is not None and last[0] == name and last[1] == index - last[4]:
            task[-1] = (name, last[1], total, last[3], last[4] + 1)
        else:
            task.append((name, index, total, r, 1))
        filled += 1
    return tasks


def read_segments(
    files: OpenFiles,
    fingerprint: str,
    payloads: bool,
    segments: list[Segment],
    data: np.ndarray,
    heads: bool = True,
) -> list[Exception | None]:
    """Read each segment into its rows of ``data``, in turn; one error (or ``None``) per
    entry. ``payloads``: check the payloads' sums too, not only the heads'; ``heads=False``
    leaves a pack's heads to the caller (``check_heads``). Runs on reader threads: no
    shared state but ``files``."""
    errors: list[Exception | None] = []
    for name, index, total, row, count in segments:
        out = data[row : row + count]
        if index is None:
            errors.append(read_entry(files, name, out[0], fingerprint, payloads))
        else:
            errors += read_pack(files, name, index, total, out, payloads, heads)
    return errors


def valid_rows(
    data: np.ndarray, keys: Sequence[str], errors: list[Exception | None], fingerprint: str
) -> tuple[int, list[ArraySpec] | None, int, Exception | None]:
    """How many rows of ``data`` (read for ``keys``, with their read ``errors``) are valid
    from the first on: no error, and the first one's header, ``keys``' key in each; the
    first row's array specs and payload start; and the error of the row after them, if
    any."""
    m = min(len(keys), len(errors))
    if not m or errors[0] is not None:
        return 0, None, 0, errors[0] if m else None
    try:
        specs, payload = parse(data[0], fingerprint)
    except ValueError as e:
        return 0, None, 0, e
    same = same_headers(data[:m], keys[:m], payload)
    for n in range(m):
        error = errors[n]
        if error is None and not same[n]:
            error = ValueError("written for another key, or in another layout than the first")
        if error is not None:
            return n, specs, payload, error
    return m, specs, payload, None


def read_pack(
    files: OpenFiles,
    name: str,
    index: int,
    total: int,
    out: np.ndarray,
    payloads: bool = True,
    heads: bool = True,
) -> list[Exception | None]:
    """Read entries ``index, index + 1, ...`` of the pack ``name`` (``total`` bytes when
    indexed) into the rows of ``out`` and check each one's checksums (``payloads``: the
    payload's too; none without ``heads``)."""
    try:
        file = files.get(name)
        if file.size != total:
            error = ValueError(f"truncated or rewritten ({file.size} bytes, {total} indexed)")
            return [error] * len(out)
        got = os.preadv(file.fd, list(out), index * out.shape[1])
    except OSError as e:
        return [e] * len(out)
    if got != out.size:
        return [ValueError(f"truncated ({got} of {out.size} bytes read)")] * len(out)
    if not heads:
        return [None] * len(out)
    why = check_rows(out, payloads)
    return [None if w is None else ValueError(f"an entry: {w}") for w in why]


def read_entry(
    files: OpenFiles, name: str, out: np.ndarray, fingerprint: str, payloads: bool = True
) -> Exception | None:
    """Read the entry file ``name`` into ``out`` (its whole size) and check its length
    and checksums (``payloads``: the payload's too); the error, or ``None``."""
    try:
        file = files.get(name)
        got = os.preadv(file.fd, [out], 0)
    except OSError as e:
        return e
    if got == out.size == file.size:
        why = check(out, payloads)
        if why is None:
            return None
        error = ValueError(why)
    else:
        error = ValueError(f"truncated or rewritten ({file.size} bytes, {out.size} indexed)")
    try:  # the header may say more: another format, version or fingerprint
        parse(out[:got], fingerprint)
    except (ValueError, KeyError, UnicodeDecodeError) as e:
        error = ValueError(str(e)) if str(e) else error
    return error


class OpenFiles:
    """Read-only descriptors of a directory's files, kept open between reads.

    A read through a fresh descriptor costs an open, a stat and a close besides the
    read, each a trip of the reader thread through the GIL, where it waits while any
    other thread runs Python (BENCHMARKS.md, runs 190–191). A descriptor closes once its
    file is forgotten (``forget``, or the oldest past ``most``) and no read holds it.
    """

    def __init__(self, directory: Path, most: int = 64):
        self.directory, self.most = directory, most
        self._open: OrderedDict[str, _Open] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, name: str) -> _Open:
        """The open file ``name``: its descriptor and its size when opened.

        Raises:
            OSError: if it cannot be opened (e.g. another process deleted it).
        """
        with self._lock:
            file = self._open.get(name)
            if file is not None:
                self._open.move_to_end(name)
                return file
        file = _Open(self.directory / name)
        with self._lock:
            self._open[name] = file
            while len(self._open) > self.most:
                self._open.popitem(last=False)
        return file

    def forget(self, name: str) -> None:
        """Close ``name``'s descriptor once no read holds it (its file is going)."""
        with self._lock:
            self._open.pop(name, None)

    def clear(self) -> None:
        """Close every descriptor once no read holds it: a file another process deleted
        keeps its disk space while a descriptor of it is open."""
        with self._lock:
            self._open.clear()


class _Open:
    """One open file; its descriptor closes when the last holder lets go of it."""

    __slots__ = ("fd", "size")

    def __init__(self, path: Path):
        fd = os.open(path, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
        except OSError:
            os.close(fd)
            raise
        self.fd, self.size = fd, size

    def __del__(self) -> None:
        fd = getattr(self, "fd", None)  # none if opening failed
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass


class Background:
    """A daemon thread, started by the first job, that runs jobs in order while
    ``enabled()`` holds; a job that raises is logged and the thread goes on."""

    def __init__(self, name: str, enabled: Callable[[], bool]):
        self.name, self.enabled = name, enabled
        self._queue: queue.Queue | None = None
        self._lock = threading.Lock()  # any thread may queue the first job

    def put(self, job: Callable[[], object], after: Callable[[], object] | None = None) -> None:
        """Queue ``job``; ``after`` runs once it is done (or skipped, or failed)."""
        with self._lock:
            if self._queue is None:
                self._queue = queue.Queue()
                args = (self._queue,)
                threading.Thread(target=self._run, args=args, name=self.name, daemon=True).start()
        self._queue.put((job, after))

    def join(self) -> None:
        """Wait for every job queued so far."""
        if self._queue is not None:
            self._queue.join()

    def _run(self, jobs: queue.Queue) -> None:
        while True:
            job, after = jobs.get()
            try:
                if self.enabled():
                    job()
            except Exception:  # a job that fails for another reason must not end the thread
                what = getattr(getattr(job, "func", job), "__name__", "a job")
                logging.getLogger("mlx_paged.disk").exception("mlx_paged: disk %s failed", what)
            finally:
                if after is not None:
                    after()
                jobs.task_done()


def touch(directory: Path, names: Sequence[str]) -> None:
    """Mark files most recently used, in their order, for a later process too (by
    modification time: each set a microsecond after the last, which the clock's own
    granularity would not tell apart)."""
    now = time.time_ns()
    for i, name in enumerate(names):
        try:
            os.utime(directory / name, ns=(now + 1000 * i,) * 2)
        except OSError:
            pass


def pack_keys(path: Path, size: int, fingerprint: str) -> tuple[list[str], int]:
    """The keys of the pack at ``path`` (``size`` bytes) in order, and its bytes per entry.

    Raises:
        ValueError: a first entry that does not parse, or a size that is not a whole
            number (two at least) of entries.
    """
    with open(path, "rb", buffering=0) as f:
        head = np.frombuffer(f.read(min(size, HEAD_BYTES)), dtype=np.uint8)
        _, _, entry = parse_head(head, fingerprint)
        if size % entry or size < 2 * entry:
            raise ValueError(f"truncated or grown: {size} bytes, entries of {entry}")
        keys = []
        for i in range(size // entry):
            f.seek(i * entry)
            keys.append(entry_key(np.frombuffer(f.read(HEAD_KEY), dtype=np.uint8)))
    return keys, entry


def group_packs(entries: list[tuple[str, bytes]], most: int) -> list[list[tuple[str, bytes]]]:
    """Runs of ``(key, entry bytes)`` of one size that follow each other, ``most`` at most
    each: a run of one is a file of its own, a longer one a pack."""
    groups: list[list[tuple[str, bytes]]] = []
    for key, data in entries:
        last = groups[-1] if groups else None
        if last and len(last) < most and len(last[0][1]) == len(data):
            last.append((key, data))
        else:
            groups.append([(key, data)])
    return groups


def write_file(directory: Path, name: str, datas: list[bytes]) -> None:
    """Write ``datas`` as file ``name``: under a temporary name of this writer's own, then
    renamed, so a reader sees a whole file or none (OSError if it could not be)."""
    temp = directory / f".{name}.{os.getpid()}.{uuid.uuid4().hex}.tmp"
    try:
        with open(temp, "wb") as f:
            for data in datas:
                f.write(data)
        os.replace(temp, directory / name)
        touch(directory, [name])  # files written one after another keep their order
    except OSError:
        temp.unlink(missing_ok=True)
        raise


def list_files(directory: Path, stale: float) -> list[tuple[int, str, int]]:
    """``(modified ns, name, bytes)`` of every entry file and pack in ``directory``; deletes
    temporary files older than ``stale`` seconds (a dead writer's)."""
    found, now = [], time.time()
    for entry in os.scandir(directory):
        if not entry.is_file():
            continue
        try:
            stat = entry.stat()
        except FileNotFoundError:
            continue
        if entry.name.endswith(".tmp"):
            if now - stat.st_mtime > stale:
                Path(entry.path).unlink(missing_ok=True)
        elif entry.name.endswith((SUFFIX, PACK_SUFFIX)):
            found.append((stat.st_mtime_ns, entry.name, stat.st_size))
    return found


def scan_files(
    directory: Path, fingerprint: str, stale: float
) -> list[tuple[str, int, tuple[list[str] | None, int]]]:
    """``(name, bytes, (keys, entry size))`` of every entry file and pack in ``directory``,
    least recently used first (``(None, 0)`` for a file of one entry or of another
    fingerprint); deletes, with a log line, a pack of ours whose keys cannot be read."""
    head, found = f"{fingerprint}-", []
    for _, name, size in sorted(list_files(directory, stale)):
        pack = (None, 0)
        if name.endswith(PACK_SUFFIX) and name.startswith(head):
            try:
                pack = pack_keys(directory / name, size, fingerprint)
            except (OSError, ValueError, KeyError, UnicodeDecodeError) as e:
                if not isinstance(e, FileNotFoundError):
                    logging.getLogger("mlx_paged.disk").warning(
                        "mlx_paged: deleting the disk-tier file %s: %s", name, e
                    )
                    (directory / name).unlink(missing_ok=True)
                continue
        found.append((name, size, pack))
    return found


def start_threads(pool: ThreadPoolExecutor, n: int) -> None:
    """Start ``n`` threads of ``pool`` now (a warm-up), not at its first tasks."""
    barrier = threading.Barrier(n)
    list(pool.map(lambda _: barrier.wait(), range(n)))
