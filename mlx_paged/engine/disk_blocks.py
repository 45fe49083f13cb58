"""The disk tier's tables and copies: functions of the index and the pools.

A block's key hashes its parent's key and its own tokens (``chain_keys``, in
``storage/disk_entries.py`` with the other entry helpers), so one key names a
whole prefix; ``KeyChain`` reuses the keys of the last tokens asked about. A
load takes fresh blocks (``new_blocks``) into tables that hold memory's blocks
before them (``pinned_tables``); ``parked`` lists what ``spill_cached`` writes.
A load's files are read in runs ahead of the pool writes (``read_ahead``, in
``storage/disk_runs.py``); ``stage`` starts a run's copy into MLX on a stream of
its own, and ``Writes`` keeps one run's pool writes in flight beside the next copy.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Sequence

import mlx.core as mx
import numpy as np

from ..blocks import BlockTable, LayerKind
from ..blocks.prefix_index import PrefixIndex, spill_parked
from ..storage import KVPool, StatePool
from ..storage.disk import DiskStore
from ..storage.disk_entries import (
    STATE,
    Entries,
    block_parts,
    by_tier,
    chain_arrays,
    chain_keys,
    host_state,
    pool_arrays,
    run_blocks,
    tiers,
    to_host,
    write_blocks,
)
from ..storage.disk_format import Run
from ..storage.disk_runs import leading
from ..storage.pinned import Staging
from .distributed import Ranks
from .scheduler import Scheduler


def parked(index: PrefixIndex) -> list[tuple[list[int], list[int], int | None]]:
    """``(tokens, block per group, snapshot)`` of every parked full block of ``index``,
    parents first."""
    found: list[tuple[list[int], list[int], int | None]] = []
    hook, index.on_spill = index.on_spill, lambda *item: found.append(item)
    try:
        spill_parked(index)
    finally:
        index.on_spill = hook
    return found


class KeyChain:
    """``chain_keys`` of the last tokens asked about, reused for the next tokens that share
    blocks with them: an eviction walks a prefix parents first, and a load that goes step
    by step asks about one prompt each step."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self._seen: list[int] = []  # the full blocks' tokens last asked about
        self._keys: list[str] = []  # ... and their keys

    def keys(self, tokens: Sequence[int]) -> list[str]:
        """The key of each full block of ``tokens`` (a new list)."""
        bs, seen, keys = self.block_size, self._seen, self._keys
        tokens = list(tokens[: len(tokens) // bs * bs])
        same = min(len(tokens), len(seen)) // bs
        if tokens[: same * bs] != seen[: same * bs]:  # not an extension: find where they part
            same = 0
            while tokens[same * bs : (same + 1) * bs] == seen[same * bs : (same + 1) * bs]:
                same += 1
        parent = keys[same - 1] if same else ""
        self._seen, self._keys = tokens, keys[:same] + chain_keys(tokens[same * bs :], bs, parent)
        return list(self._keys)

    def link(self, tokens: Sequence[int]) -> tuple[str, dict[str, np.ndarray]]:
        """The key of the last full block of ``tokens``, and its entry's ``CHAIN`` arrays."""
        keys, bs = self.keys(tokens), self.block_size
        parent, n = keys[-2] if len(keys) > 1 else "", len(keys)
        return keys[-1], chain_arrays(parent, tokens[(n - 1) * bs : n * bs])


def pinned_tables(
    groups: dict[LayerKind, KVPool], path: list[list[int | None]], have: int
) -> dict[LayerKind, BlockTable]:
    """Per group, a new table for blocks from ``have`` on: a full-attention one holds (and
    so keeps from eviction) memory's blocks before it; a sliding-window one starts empty."""
    tables = {}
    for g, (kind, group) in enumerate(groups.items()):
        table = tables[kind] = group.new_table()
        if kind.window is None:
            table.blocks.extend(node[g] for node in path)
            group.blocks.retain_all(table.blocks)
        else:
            table.first = have
    return tables


def agreed_run(ranks: Ranks, run: Run | None) -> tuple[Run | None, bool]:
    """The leading entries of ``run`` that every rank read (none past the end of any
    rank's runs), and whether the ranks read runs of different lengths."""
    lengths = [row[0] for row in ranks.gather([len(run) if run else 0])]
    least = min(lengths)
    if run is not None and least < len(run):
        run = Run(run.data[:least], run.specs, run.payload, run.checked) if least else None
    return run, least != max(lengths)


def load_room(tokens: int, have: int, scheduler: Scheduler) -> int:
    """Blocks a load grows a pool by, for a prompt of ``tokens`` of which memory holds
    ``have`` blocks: the rest of its blocks and one more; for a hybrid model also a snapshot
    interval's, which its request recomputes past the deepest snapshot while the blocks
    loaded there stay parked (else taking them evicts and spills others)."""
    bs, recurrent = scheduler.block_size, scheduler.recurrent
    return -(-tokens // bs) - have + 1 + (recurrent.interval // bs if recurrent else 0)


def restore_plan(
    ranks: Ranks, scheduler: Scheduler, prefixes: list[list[int]], keys: KeyChain
) -> list[list[int]]:
    """The prefixes a restore loads (of ``prefixes``, oldest first), and room for them.

    - Under a sharded engine, none unless every rank found the same ones: their loads,
      collectives, must come in one order.
    - A fixed pool takes the newest that fit its free blocks (each shared block once):
      loaded one after another, more would only evict each other.
    - A growable pool grows once, where it must, so that all of them fit beside the
      cached blocks."""
    if ranks.group is not None:
        digest = hashlib.blake2b(digest_size=8)
        for tokens in prefixes:
            digest.update(np.asarray([len(tokens), *tokens], dtype=np.int64).tobytes())
        words = np.frombuffer(digest.digest(), dtype=np.int32)
        rows = ranks.gather([len(prefixes), *(int(w) for w in words)])
        prefixes = prefixes if all(row == rows[0] for row in rows) else []
    groups = [scheduler.groups[k] for k in scheduler.kinds if k.window is None]
    room = min((g.blocks.num_free for g in groups if not g.blocks.growable), default=None)
    kept: list[list[int]] = []
    held: set[str] = set()  # the blocks of those kept
    for tokens in reversed(prefixes):
        new = set(keys.keys(tokens)) - held
        if room is None or len(held) + len(new) < room:  # and a block for the request
            kept.append(tokens)
            held |= new
    for group in groups:
        group.make_room(len(held) + 1 + group.blocks.num_cached)  # past the free: grows
    return kept[::-1]


def load_snapshot(
    store: DiskStore,
    states: StatePool,
    index: PrefixIndex,
    ranks: Ranks,
    tokens: Sequence[int],
    keys: list[str],
) -> None:
    """Give ``index`` the deepest snapshot in ``store`` (that every rank has and reads
    well) ending in the full blocks memory holds now and past the longest prefix it
    can already adopt."""
    bs = index.block_size
    match = index.match(tokens)
    ends = range(index.full_blocks_matched(tokens) // bs, match.length // bs if match else 0, -1)
    if not ends:
        return
    there = ranks.least(*(keys[j - 1] + STATE in store for j in ends))
    for j in (j for j, on_disk in zip(ends, there, strict=True) if on_disk):
        arrays = store.get(keys[j - 1] + STATE)
        state = host_state([len(a) for a in states.arrays], arrays) if arrays is not None else None
        if ranks.least(state is not None)[0]:
            index.add_snapshot(tokens, j * bs, lambda state=state: states.restore(state))
            return


def stage(
    run: Run,
    pools: list[KVPool],
    windows: list[int | None],
    to_mlx: Callable[[np.ndarray], mx.array],
    stream: mx.Stream,
    seconds: dict[str, float],
) -> tuple[Entries, list[bool | None], mx.array | None] | None:
    """``run_blocks`` of ``run``, its copy into MLX and checks on ``stream`` and started
    (``mx.async_eval``), so that they run beside the pool writes on the default stream.
    Adds the time taken to ``seconds["load_copy"]``."""
    start = time.perf_counter()
    staged = run_blocks(pools, windows, run, to_mlx, stream)
    if staged is not None:
        entries, _, ok = staged
        mx.async_eval(ok if ok is not None else [a for a, _ in entries.values()])
    seconds["load_copy"] += time.perf_counter() - start
    return staged


class Writes:
    """A load's pool writes in flight, one run's at a time: the next run's are made only
    once these are done, since a pool write that waits on one still in flight copies the
    whole pool (DESIGN.md).

    Args:
        pools: The pools written.
        seconds: ``seconds["load_eval"]`` adds the time taken to start and wait for them.
    """

    def __init__(self, pools: list[KVPool], seconds: dict[str, float]):
        self.pools, self.seconds = pools, seconds
        self._run: tuple[int, mx.array | None] | None = None  # (entries, their checks)

    def start(self, entries: int, ok: mx.array | None) -> None:
        """Start the writes made of a run of ``entries``, with their checks ``ok`` (``None``:
        the host checked them)."""
        start = time.perf_counter()
        mx.async_eval([a for p in self.pools for a in pool_arrays(p)])
        self.seconds["load_eval"] += time.perf_counter() - start
        self._run = (entries, ok)

    def wait(self) -> tuple[int, int]:
        """Wait for the writes in flight: ``(entries, how many from the first passed their
        check)``; ``(0, 0)`` when none were."""
        if self._run is None:
            return 0, 0
        (entries, ok), self._run = self._run, None
        start = time.perf_counter()
        mx.eval(ok, [a for p in self.pools for a in pool_arrays(p)])
        self.seconds["load_eval"] += time.perf_counter() - start
        return entries, leading(ok, entries)


def spill_blocks(
    store: DiskStore,
    pools: list[KVPool],
    items: list[tuple[str, list[int], dict[str, np.ndarray]]],
    seconds: dict[str, float],
) -> None:
    """Read the blocks of ``(key, block per group, CHAIN arrays)`` items ``store`` lacks
    out of ``pools``, one evaluation per tier, and queue them on the store's writer (which
    packs the blocks of one tier that follow each other into one file). Adds the time
    taken to ``seconds["write"]``."""
    items = [item for item in items if item[0] not in store]
    if not items or not store.enabled:
        return
    start = time.perf_counter()
    for cold, same in by_tier(items).items():
        got = block_parts(pools, cold, [blocks for _, blocks, _ in same])
        if got is None:
            return  # a layer never written: nothing to keep
        rows = zip(same, to_host(*got), strict=True)
        store.put_many_later([(key, row | chain) for (key, _, chain), row in rows])
    seconds["write"] += time.perf_counter() - start


def rehearse_load(
    fingerprint: str,
    index: PrefixIndex,
    pools: list[KVPool],
    windows: list[int | None],
    staging: Staging,
    stream: mx.Stream,
) -> bool:
    """Run a spill's and a load's MLX work on a cached block of ``index`` (no file written,
    no byte changed), so that a first load builds no kernel; whether there was a block."""
    found = parked(index)
    blocks = found[0][1] if found else None
    cold = tiers(blocks or ())
    got = block_parts(pools, cold, [blocks]) if blocks else None
    if got is None:
        return False
    run = Run.of(fingerprint, "rehearsal", to_host(*got)[0])
    # The staging copy's kernel too, and the payload check's.
    run = Run(staging.stage(run.data), run.specs, run.payload, checked=False)
    entries, _, ok = stage(run, pools, windows, staging.to_mlx, stream, {"load_copy": 0.0})
    for g, pool in enumerate(pools):
        if cold[g] is not None:
            write_blocks(pool, g, [blocks[g]], entries, cold[g])
    mx.eval(ok, [a for p in pools for a in pool_arrays(p)])
    return True
