"""The newest entries of a disk tier read into host memory while a process starts.

A load from disk reads its files from the page cache into staging buffers while
the GPU copies the runs read before: on a GPU host both move through host memory
at once and slow each other (BENCHMARKS.md, runs 373-374). ``Preload`` reads the
store's most recently used entries, up to ``max_bytes``, into buffers of their
own (pinned on CUDA, MLX's memory elsewhere: ``Staging``) on a thread of its own
as soon as the store is open. A load asks it first (``take``): a run that lies
in one of its chunks needs no read, only the copy into MLX.

The entries are read as any run is (``DiskStore.read_run``: sizes, headers and,
with ``payloads``, the payloads' sums; a bad file is deleted and skipped). The
engine's disk tier has the payloads checked here, wherever its loads check them:
the reads come before any request, so a run taken from here needs no check at
load time, on a GPU neither the sums in MLX nor their flags read back to the host
(in BENCHMARKS.md's run 406 a restart's time changed no more than its noise).

A restore (``DiskTier.restore``) loads the prefixes the entries read hold whole
(``prefixes``) into the pool at start; the first blocks of a prompt larger than the
preload are placed from their files (``file_link``).

A run is taken only for keys the store still has (the caller asks the store first),
and only for keys that follow each other in one chunk; ``cut`` ends a load's runs
where chunks begin and end. ``release`` (after each load, and from an idle server's
engine thread) gives every chunk back once loads have asked for every entry read
that the store still has, whether they took it from here or read it (a load that
came before the preload was done), or ``HOLD_SECONDS`` after the preload ended: the
memory, at most ``max_bytes``, is held until then.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from functools import partial

import mlx.core as mx
import numpy as np

from .disk import DiskStore, Run
from .disk_entries import STATE, chain_link, chain_specs, prefixes, run_links
from .disk_files import HEAD_BYTES
from .disk_format import parse_head
from .pinned import Staging

logger = logging.getLogger("mlx_paged.disk")

#: Seconds between ``release``'s lookups of entries no load asked for.
RECHECK_SECONDS = 30.0
#: Seconds after the preload ends that ``release`` gives its memory back whatever is left:
#: entries no load asked for by then are read from disk when asked for.
HOLD_SECONDS = 600.0


def check_preload(nbytes: object, directory: object) -> None:
    """Check a preload's bytes (an int, 0 for none) and that it has a directory to read.

    Raises:
        ValueError: for a bad count, or bytes without a directory.
    """
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
        raise ValueError(f"kv_disk_preload_bytes must be an int of 0 or more, got {nbytes!r}.")
    if nbytes and directory is None:
        raise ValueError("kv_disk_preload_bytes needs kv_disk_dir, the directory to read.")


class Preload:
    """The newest entries of ``store`` (up to ``max_bytes``) read into host memory in the
    background, in chunks of at most ``chunk_bytes``.

    Args:
        store: The disk tier's files.
        max_bytes: Most bytes of entries read (a positive int).
        chunk_bytes: Most bytes of a chunk, a run a load may take at once.
        payloads: Whether the host checks the payloads' sums as it reads (else the load
            checks them, as it does a read run's).

    Make it on the thread that makes MLX calls: it readies the staging copy there.
    """

    def __init__(self, store: DiskStore, max_bytes: int, chunk_bytes: int, payloads: bool):
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes <= 0:
            raise ValueError(f"max_bytes must be a positive int, got {max_bytes!r}.")
        self.store, self.max_bytes, self.payloads = store, max_bytes, payloads
        self.chunk_bytes = max(1, min(chunk_bytes, max_bytes))
        self._plan = self._chunks_of(self._newest())  # each chunk's keys, of one entry size
        self.staging = Staging(max(1, len(self._plan)))
        if not self.staging.start() and self.staging.shared:
            self.staging.reserve(self.chunk_bytes)  # MLX's memory, made on this thread
        self.entries = self.bytes = 0  # read
        self.taken = 0  # entries loads took from here
        self.seconds = 0.0
        self._runs: list[tuple[list[str], Run]] = []  # (keys, their rows in a chunk)
        self._where: dict[str, tuple[int, int]] = {}  # key -> (run, row)
        self._asked: set[str] = set()  # keys a load asked for (taken here or not)
        self._left = 0  # keys read here that no load asked for yet
        self._recheck = 0.0  # when release may next look the others up in the store
        self._ended = 0.0  # when the preload ended (time.monotonic())
        self._lock = threading.Lock()
        self._done, self._stop = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._run, name="mlx_paged-disk-preload")
        self._thread.daemon = True
        self._thread.start()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until every chunk is read; whether it is."""
        return self._done.wait(timeout)

    @property
    def held_bytes(self) -> int:
        """Bytes of entries held now (0 once given back)."""
        with self._lock:
            return sum(run.data.nbytes for _, run in self._runs)

    def cut(self, keys: Sequence[str], most: Callable[[str], int]) -> Callable[[str], int]:
        """``most`` (the entries of a run from a key of ``keys`` on) cut where a chunk
        begins or ends, so that a load's run lies in one chunk or in none."""
        at = {key: i for i, key in enumerate(keys)}

        def entries(key: str) -> int:
            n, lo = most(key), at[key]
            ahead = keys[lo + 1 : lo + n]
            with self._lock:
                where = self._where.get(key)
                if where is None:  # up to the next key held here
                    return 1 + next((j for j, k in enumerate(ahead) if k in self._where), n - 1)
                # As far as the chunk holds the same keys in the same order: files read in
                # another order than the load's keys (by their use) part there.
                held, row = self._runs[where[0]][0], where[1] + 1
                same = (
                    j for j, k in enumerate(ahead) if row + j >= len(held) or held[row + j] != k
                )
                return 1 + next(same, len(ahead))

        return entries

    def take(self, keys: Sequence[str]) -> Run | None:
        """The rows of ``keys`` as a run (views of a chunk), if they follow each other in
        one chunk; else ``None``. Either way the keys count as loaded (``release``)."""
        with self._lock:
            reading = not self._done.is_set()  # keys not read yet may be read next
            for key in keys:
                if key not in self._asked and (reading or key in self._where):
                    self._asked.add(key)
                    self._left -= key in self._where
            at = self._where.get(keys[0]) if keys else None
            if at is None:
                return None
            (chunk, run), lo = self._runs[at[0]], at[1]
            if list(keys) != chunk[lo : lo + len(keys)]:
                return None
            self.taken += len(keys)
        return Run(run.data[lo : lo + len(keys)], run.specs, run.payload, run.checked)

    def prefixes(self) -> list[list[int]]:
        """The token prefixes that the entries read so far hold whole, every block from a
        prompt's first (``disk_entries.prefixes``), oldest first. A load marks a prompt's
        files used from its first block on, so a prompt larger than ``max_bytes`` has its
        first blocks left unread: their places in the chain (not their arrays) are read
        from their files (``file_link``), up to ``max_bytes`` of entries more."""
        with self._lock:
            runs = list(self._runs)
        links: dict[str, tuple[str, list[int]]] = {}
        for keys, run in runs:
            links.update(run_links(keys, run))
        todo, tried, spent = [parent for parent, _ in links.values() if parent], set(links), 0
        while todo:
            key = todo.pop()
            size = self.store.size(key) if key not in tried else None
            tried.add(key)
            if size is None or spent + size > self.max_bytes:
                continue
            spent += size
            link = file_link(self.store, key)
            if link is not None:
                links[key] = link
                if link[0]:
                    todo.append(link[0])
        return prefixes(links)

    def future(self, keys: Sequence[str]) -> Future | None:
        """``take(keys)`` as a done future (a read's), or ``None``."""
        run = self.take(keys)
        if run is None:
            return None
        done: Future = Future()
        done.set_result(run)
        return done

    def to_mlx(self, data: np.ndarray, staging: Staging) -> mx.array:
        """Rows of a chunk here, or else of ``staging``, in MLX (``Staging.to_mlx``)."""
        return (self.staging if self.staging.holds(data) else staging).to_mlx(data)

    def release(self, force: bool = False) -> bool:
        """Give the chunks back once loads asked for every entry read that the store still
        has, or ``HOLD_SECONDS`` after the preload ended (or at once with ``force``);
        whether they are gone. Call it when no run taken from here is in use. Whether the
        store still has the entries not asked for is looked up at most once every
        ``RECHECK_SECONDS``."""
        if force:
            self._stop.set()
        elif not self._done.is_set():
            return False
        held = time.monotonic() - self._ended < HOLD_SECONDS
        if not force and held and self._left:
            if time.monotonic() < self._recheck:
                return False
            self._recheck = time.monotonic() + RECHECK_SECONDS
            with self._lock:
                left = [key for key in self._where if key not in self._asked]
            if any(key in self.store for key in left):
                return False
        self._thread.join()
        with self._lock:
            if not self._runs:
                return True
            self._runs, self._where, self._asked, self._left = [], {}, set(), 0
        if self.staging.pinned:  # unpinning a GiB takes milliseconds a load need not wait
            threading.Thread(target=self.staging.drop, name="mlx_paged-disk-unpin").start()
        else:
            self.staging.drop()
        return True

    # ---- internals --------------------------------------------------------

    def _run(self) -> None:
        start = time.perf_counter()
        try:
            self._read()
        except Exception:  # a preload is an optimisation: loads read from disk without it
            logger.exception("mlx_paged: preloading the disk tier failed")
        finally:
            self.seconds, self._ended = time.perf_counter() - start, time.monotonic()
            if self.entries:  # before ``wait`` returns: a server's log says it when ready
                logger.info(
                    "mlx_paged: preloaded %d disk-tier entries (%.2f GB) in %.2f s",
                    self.entries, self.bytes / 1e9, self.seconds,
                )  # fmt: skip
            self._done.set()

    def _newest(self) -> list[str]:
        """The most recently used keys whose entries fit in ``max_bytes``, oldest first."""
        picked, total = [], 0
        for key in reversed(self.store.keys):
            # A snapshot's entry: loads read it alone, never in runs.
            size = self.store.size(key) if not key.endswith(STATE) else None
            if size is None:
                continue
            if total + size > self.max_bytes:
                break
            picked.append(key)
            total += size
        return picked[::-1]

    def _chunks_of(self, keys: list[str]) -> list[list[str]]:
        """``keys`` in chunks of one entry size and at most ``chunk_bytes``."""
        chunks: list[list[str]] = []
        last = None
        for key in keys:
            size = self.store.size(key)
            if size is None:
                continue
            if size != last or len(chunks[-1]) * size + size > self.chunk_bytes:
                chunks.append([])
            chunks[-1].append(key)
            last = size
        return chunks

    def _read(self) -> None:
        for i, keys in enumerate(self._plan):
            if self._stop.is_set():
                return
            size = self.store.size(keys[0])
            if size is None:
                continue
            rows, pos = self.staging.buffer(i, len(keys), size), 0
            while pos < len(keys):
                out = partial(_rows_at, rows, pos)
                run = self.store.read_run(keys[pos:], out, self.payloads)
                if run is None:  # missing or bad (deleted): the next key may still be good
                    pos += 1
                    continue
                got = keys[pos : pos + len(run)]
                with self._lock:
                    self._where.update((k, (len(self._runs), r)) for r, k in enumerate(got))
                    self._left += sum(k not in self._asked for k in got)
                    self._runs.append((got, run))
                    self.entries += len(run)
                    self.bytes += run.data.nbytes
                pos += len(run)


def file_link(store: DiskStore, key: str) -> tuple[str, list[int]] | None:
    """The ``(parent key, tokens)`` that ``key``'s entry holds, read from its file (its
    header and its ``CHAIN`` arrays, not its layers), if they hash to ``key``; ``None``
    for a missing, unreadable or foreign entry, or one without them."""
    where = store.location(key)
    if where is None:
        return None
    path, offset, size = where
    try:
        with open(path, "rb", buffering=0) as f:
            head = np.frombuffer(os.pread(f.fileno(), min(size, HEAD_BYTES), offset), np.uint8)
            specs, payload, _ = parse_head(head, store.fingerprint)
            found = chain_specs(specs)
            if found is None:
                return None
            p, t = (os.pread(f.fileno(), s.size, offset + payload + s.start) for s in found)
        return chain_link(key, p, t)
    except (OSError, ValueError, KeyError, TypeError):  # cut short, or not an entry
        return None


def _rows_at(rows: np.ndarray, at: int, n: int, size: int) -> np.ndarray:
    """``n`` rows of ``rows`` from row ``at`` on (a read's buffer, ``DiskStore.read_run``)."""
    if size != rows.shape[1]:
        raise ValueError(f"entries of {size} bytes, not {rows.shape[1]}: the files changed")
    return rows[at : at + n]
