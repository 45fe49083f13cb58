"""Reading entries in runs: one run's reader tasks (``read_tasks``), and a load's runs
ahead of their use (``read_ahead``: the engine's disk tier and ``load_prefix`` read the
same way)."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial

import mlx.core as mx
import numpy as np

from .disk_files import OpenFiles, Segment, read_segments
from .disk_format import Run, check_rows


def leading(ok: mx.array, n: int) -> int:
    """How many of a run's ``n`` entries, from the first, passed their check (``ok``,
    evaluated; all ``n`` when ``None``: the host checked them)."""
    if ok is None:
        return n
    bad = np.flatnonzero(~np.array(ok))
    return int(bad[0]) if bad.size else n


def read_ahead(
    keys: list[str],
    first: tuple[int, Future] | None,
    batch: Callable[[str], int],
    read: Callable[[list[str], int], Future],
    depth: int,
    seconds: dict[str, float],
) -> Iterator[Run]:
    """The entries of ``keys`` in runs of up to ``batch(key)`` entries, each ``read``
    (``read(keys, i)`` into staging buffer ``i``) up to ``depth`` runs ahead of the one
    the caller writes; stops at the first missing or bad file. ``first``: (entries, read)
    of a first run already asked for, in buffer 0. Adds the waits to ``seconds["load_wait"]``."""
    ahead: deque[tuple[int, int, Future]] = deque()  # (first entry, entries, read)
    if first is not None:
        ahead.append((0, *first))
    pos, i = 0, len(ahead)  # entries yielded; reads asked for (a read's buffer)
    try:
        while pos < len(keys):
            while len(ahead) < depth:
                lo = ahead[-1][0] + ahead[-1][1] if ahead else pos
                if lo >= len(keys):
                    break
                n = min(batch(keys[lo]), len(keys) - lo)
                ahead.append((lo, n, read(keys[lo : lo + n], i)))
                i += 1
            lo, n, future = ahead.popleft()
            start = time.perf_counter()
            run = future.result()
            seconds["load_wait"] += time.perf_counter() - start
            if run is None:
                return
            pos += len(run)
            if len(run) < n:  # a short run (bad file, another layout): reads after it are off
                for _, _, later in ahead:
                    later.result()
                ahead.clear()
            yield run
    finally:  # a load that stops early: its reads are done with their buffers before reuse
        for _, _, later in ahead:
            later.result()


def read_tasks(
    readers: ThreadPoolExecutor,
    tasks: list[list[Segment]],
    files: OpenFiles,
    fingerprint: str,
    payloads: bool,
    data: np.ndarray,
) -> list[Exception | None]:
    """Read ``tasks`` (``plan_reads``) into ``data`` on ``readers``: one error (or ``None``)
    per entry. Without the payloads' sums (the caller checks them), the heads are checked
    after the reads, all at once (``check_heads``): on the reader threads each check waits
    for the GIL while the others run theirs (BENCHMARKS.md, run 369)."""
    read = partial(read_segments, files, fingerprint, payloads, heads=payloads)
    if len(tasks) == 1:
        errors = read(tasks[0], data)
    else:
        parts = readers.map(read, tasks, [data] * len(tasks))
        errors = [e for part in parts for e in part]
    return errors if payloads else check_heads(data, errors)


def check_heads(data: np.ndarray, errors: list[Exception | None]) -> list[Exception | None]:
    """``errors`` of a run's rows read without their heads checked, with each head's
    check (``check_rows``) added up to the first error: the whole run's heads at once."""
    m = next((i for i, e in enumerate(errors) if e is not None), len(errors))
    why = check_rows(data[:m], False) if m else []
    return [None if w is None else ValueError(f"an entry: {w}") for w in why] + errors[m:]
