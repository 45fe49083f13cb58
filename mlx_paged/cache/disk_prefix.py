"""Prompt prefixes on disk for the caches ``make_paged_cache`` builds.

``make_paged_cache(model, kv_disk_dir=..., kv_disk_bytes=...)`` opens a
``DiskStore`` (``storage/disk.py``) named by the model and the cache's layout,
one per directory and name in a process, which every cache made so shares.
mlx-lm's caches never see token ids, so the caller names the prefix:

- ``save_prefix(cache, tokens)`` writes each full block of ``tokens`` that the
  cache holds and the directory lacks: one entry per block, every layer of
  every group, under the hash chain of its prefix's tokens (``chain_keys``).
  These are the entries and keys ``PagedEngine``'s disk tier writes, so a
  server's directory serves these caches and the other way round, for the same
  model, block size, storage dtype and cold tier.
- ``load_prefix(cache, tokens)`` fills an empty cache with the longest prefix of
  ``tokens`` on disk, in whole blocks, leaving at least one token for the model
  to run, and returns how many tokens it loaded: the caller runs the rest.

A model with recurrent layers (mlx-lm's ``ArraysCache``) needs their state where
the load ends. ``save_prefix`` writes it as a snapshot entry of the block it ends
(as the engine's tier does) when the cache's tokens end at a block boundary, and
a load ends at the deepest block that has one: run such a model's prompt up to
a block boundary, save, then run the rest (README, "A disk tier").

A sliding-window group's blocks are in an entry while the cache held them at
the save; a load ends where a window's blocks are missing. Files are checked as
the engine's are: a bad one is deleted with a log line and ends the load there.
A load reads its files in runs into pinned staging buffers (``storage/pinned.py``),
two runs ahead of the one it writes into the pool, and on a GPU checks the
arrays' sums there; unlike the engine's, it does not overlap a run's copy with
the last run's pool writes. Loads in one process take turns (they share the
buffers).
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import cache, partial
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import CacheList

from ..blocks import HOLE, BlockTable, LayerKind
from ..storage import KVPool
from ..storage.disk import DiskStore
from ..storage.disk_entries import (
    STATE,
    block_parts,
    by_tier,
    cache_layout,
    chain_keys,
    fingerprint,
    host_state,
    make_room,
    new_blocks,
    pool_arrays,
    run_blocks,
    state_parts,
    to_host,
    write_blocks,
)
from ..storage.disk_runs import leading, read_ahead
from ..storage.pinned import Staging
from .paged import PagedKVCache
from .reads import read_start

__all__ = ["load_prefix", "open_disk", "save_prefix"]

#: Most entries, and bytes of them, a load reads at once (a staging buffer's size) ...
LOAD_BATCH, LOAD_BYTES = 256, 128 << 20
#: ... and how many such runs it reads ahead of the one it writes into the pool.
READS_AHEAD = 2
#: Where a load checks its entries' word sums: in MLX, where the arrays go (``True``), or
#: on the store's reader threads (``False``); ``None``: in MLX on a GPU (as the engine).
CHECK_IN_MLX: bool | None = None

# One store per directory and fingerprint in this process, so that what one cache
# saves, the next one finds; and each pool's disk.
_STORES: weakref.WeakValueDictionary[tuple[Path, str], DiskStore] = weakref.WeakValueDictionary()
_DISKS: weakref.WeakKeyDictionary[KVPool, _Disk] = weakref.WeakKeyDictionary()


@dataclass
class _Disk:
    """A cache layout's store: its groups' kinds and pools, in the entries' order, and
    each recurrent layer's number of state entries."""

    store: DiskStore
    kinds: list[LayerKind]
    pools: list[KVPool]
    entries: list[int]


def open_disk(
    model: nn.Module,
    pools: dict[LayerKind, KVPool],
    path: str | os.PathLike,
    max_bytes: int,
    entries: Sequence[int] = (),
) -> None:
    """Give ``pools`` (``make_paged_cache``'s) the store over ``path`` for this model and
    layout, at most ``max_bytes`` of files; ``entries``: per recurrent layer, its state
    entries (``PagedLayout.entries``)."""
    kinds = list(pools)
    block_size = pools[kinds[0]].block_size
    name = fingerprint(model, (block_size, cache_layout(pools)))
    where = (Path(path).expanduser().resolve(), name)
    store = _STORES.get(where)
    if store is None:
        store = _STORES[where] = DiskStore(where[0], max_bytes, name)
    store.max_bytes = max_bytes
    disk = _Disk(store, kinds, [pools[k] for k in kinds], list(entries))
    for pool in disk.pools:
        _DISKS[pool] = disk


def save_prefix(cache: list[Any], tokens: Sequence[int]) -> int:
    """Write the full blocks of ``tokens`` that ``cache`` holds to its disk directory,
    skipping those already there, and wait for the writes.

    Args:
        cache: A cache list from ``make_paged_cache(..., kv_disk_dir=...)``.
        tokens: The tokens the cache holds, from its first (the prompt, or the prompt
            and what was generated); only those it holds are saved.

    With recurrent layers, their state is saved too where the cache's tokens end at a
    block boundary within ``tokens``: a load can only end where a state was saved.

    Returns:
        How many leading tokens of ``tokens`` a load can now take from the directory
        (whole blocks, up to the deepest saved state for a model with recurrent layers;
        0 when the directory cannot be written).

    Raises:
        ValueError: for a cache without a disk directory, tokens that are not ints, or
            recurrent state of more than one sequence.
    """
    disk, tables, states = _disk_of(cache, "save_prefix")
    tokens = _token_ids(tokens, "save_prefix")
    state = _one_state(states)
    store, bs = disk.store, disk.pools[0].block_size
    held = min(min(t.lengths) for t in tables)
    keys = chain_keys(tokens[: min(len(tokens), held)], bs)
    rows = [(key, [_block(t, i) for t in tables]) for i, key in enumerate(keys)]
    for cold, same in by_tier([(key, row) for key, row in rows if key not in store]).items():
        got = block_parts(disk.pools, cold, [row for _, row in same])
        if got is not None:
            store.put_many_later(list(zip([k for k, _ in same], to_host(*got), strict=True)))
    if state and held % bs == 0 and 0 < held <= len(tokens) and keys[-1] + STATE not in store:
        store.put_later(keys[-1] + STATE, to_host(*state_parts(state))[0])
    store.flush()
    return _loadable(store, keys, bool(states)) * bs


def load_prefix(cache: list[Any], tokens: Sequence[int]) -> int:
    """Load the longest prefix of ``tokens`` that ``cache``'s disk directory holds into
    the empty ``cache``, in whole blocks and short of the last token.

    Run the model on ``tokens[n:]`` next (``n`` the return value), e.g.
    ``mlx_lm.generate(model, tokenizer, tokens[n:], prompt_cache=cache)``.

    Returns:
        The tokens loaded (0 when the disk has none of the prefix, or the pool, of a
        fixed ``num_blocks``, has no room).

    Raises:
        ValueError: for a cache without a disk directory or one that holds tokens, or
            tokens that are not ints.
    """
    disk, tables, states = _disk_of(cache, "load_prefix")
    tokens = _token_ids(tokens, "load_prefix")
    if any(t.end or t.blocks for t in tables):
        raise ValueError(
            "load_prefix fills an empty cache; this one holds tokens. "
            "Make a new one with make_paged_cache."
        )
    bs = disk.pools[0].block_size
    keys = chain_keys(tokens[: (len(tokens) - 1) // bs * bs], bs)
    keys = keys[: _loadable(disk.store, keys, bool(states))]
    loads = _loads()
    with loads.lock:  # one load at a time: they share the staging buffers
        held = _read(disk, tables, keys, -(-len(tokens) // bs) + 1, loads)
    disk.store.close_files()
    n = _settle(disk.pools, tables, [k.window for k in disk.kinds], held)
    if states:
        n = _restore(disk, tables, states, keys, n)
    return n


def _read(
    disk: _Disk, tables: list[BlockTable], keys: list[str], need: int, loads: _Loads
) -> list[list[bool]]:
    """Write the entries of ``keys`` into new blocks of ``tables`` (the pools grown once for
    ``need`` blocks, the prompt's), up to the first missing or bad one; per group and
    block, whether the table holds it after."""
    store, pools, bs = disk.store, disk.pools, disk.pools[0].block_size
    windows = [k.window for k in disk.kinds]
    held: list[list[bool]] = [[] for _ in tables]
    in_mlx = mx.default_device() == mx.gpu if CHECK_IN_MLX is None else CHECK_IN_MLX

    def read(run_keys: list[str], i: int) -> Future:
        out = partial(loads.staging.buffer, i)
        return loads.reader.submit(store.read_run, run_keys, out, payloads=not in_mlx)

    def most(key: str) -> int:
        return max(1, min(LOAD_BATCH, LOAD_BYTES // (store.size(key) or 1)))

    for run in read_ahead(keys, None, most, read, READS_AHEAD, {"load_wait": 0.0}):
        at = len(held[0])
        staged = run_blocks(pools, windows, run, loads.staging.to_mlx)
        if staged is None:
            break
        entries, cold, ok = staged
        if at == 0:  # the whole prompt's room at once: each growth copies the pool
            for pool, c, window in zip(pools, cold, windows, strict=True):
                if window is None:  # a window's pool holds a window's blocks
                    make_room(pool, c, len(keys), need)
        room = zip(pools, tables, cold, strict=True)
        ids = [new_blocks(pool, table, at * bs, len(run), c) for pool, table, c in room]
        if None in ids:
            break  # a fixed pool without room for more
        for g, (pool, c) in enumerate(zip(pools, cold, strict=True)):
            if c is not None:
                write_blocks(pool, g, ids[g], entries, c)
        mx.eval(ok, [a for p in pools for a in pool_arrays(p)])
        good = leading(ok, len(run))
        store.hit(good)
        for g, c in enumerate(cold):  # a window's blocks missing: its table gave back
            held[g] = held[g] + [True] * good if c is not None else [False] * (at + good)
        if good < len(run):  # blocks written from a bad entry on go back in _settle
            store.discard(keys[at + good], "the checksum of an entry's arrays does not match")
            break
    return held


class _Loads:
    """What loads share in a process: staging buffers, and a thread that reads ahead."""

    def __init__(self) -> None:
        self.staging = Staging(READS_AHEAD + 1)
        self.reader = ThreadPoolExecutor(READS_AHEAD, "mlx_paged-prefix-read")
        self.lock = threading.Lock()


@cache
def _loads() -> _Loads:
    return _Loads()


def _settle(
    pools: list[KVPool], tables: list[BlockTable], windows: list[int | None], held: list[list]
) -> int:
    """End a load at the last block after which every window group's table holds the
    blocks its next query reads (``held``: per group and block, whether it does); give
    back the blocks past it. Returns the tokens kept."""
    bs, n = pools[0].block_size, len(held[0])
    while n and any(
        w is not None and not all(h[read_start(n * bs, w, bs) // bs : n])
        for w, h in zip(windows, held, strict=True)
    ):
        n -= 1
    return _keep(pools, tables, n * bs)


def _keep(pools: list[KVPool], tables: list[BlockTable], n: int) -> int:
    """Cut ``tables`` to their first ``n`` tokens (a block boundary), giving the rest back."""
    for pool, table in zip(pools, tables, strict=True):
        if n == 0:
            pool.release(table)
            continue
        table.lengths[:] = [n] * len(table.lengths)
        pool.truncate(table, 0, n)
        table.version += 1
    return n


def _loadable(store: DiskStore, keys: list[str], recurrent: bool) -> int:
    """How many leading blocks of ``keys`` a load can take: those on disk, up to the
    deepest with a state snapshot for a model with recurrent layers."""
    n = store.leading(keys)
    if recurrent:
        n = next((j for j in range(n, 0, -1) if keys[j - 1] + STATE in store), 0)
    return n


def _one_state(states: list[Any]) -> list[list[mx.array | None]] | None:
    """The recurrent ``states``' arrays (mlx-lm ``ArraysCache``s), per layer; ``None`` when
    there are none or nothing has written them."""
    state = [list(c.cache) for c in states]
    arrays = [a for layer in state for a in layer if a is not None]
    if any(a.shape[0] != 1 for a in arrays):
        raise ValueError("save_prefix keeps one sequence's recurrent state; this cache holds more.")
    return state if arrays else None


def _restore(
    disk: _Disk, tables: list[BlockTable], states: list[Any], keys: list[str], n: int
) -> int:
    """Set ``states`` from the deepest good snapshot within the ``n`` tokens loaded, cutting
    the tables back to it (to nothing without one); returns the tokens kept."""
    bs = disk.pools[0].block_size
    for j in range(n // bs, 0, -1):
        if keys[j - 1] + STATE not in disk.store:
            continue
        arrays = disk.store.get(keys[j - 1] + STATE)
        state = host_state(disk.entries, arrays) if arrays is not None else None
        if state is not None:
            for c, layer in zip(states, state, strict=True):
                c.cache = layer
            return _keep(disk.pools, tables, j * bs)
    return _keep(disk.pools, tables, 0)


def _block(table: BlockTable, i: int) -> int | None:
    """Block ``i`` of ``table`` (by position), or ``None`` where the table gave it back."""
    j = i - table.first
    if 0 <= j < len(table.blocks) and table.blocks[j] != HOLE:
        return table.blocks[j]
    return None


def _disk_of(cache: list[Any], what: str) -> tuple[_Disk, list[BlockTable], list[Any]]:
    """The disk of ``cache``'s pools, its table per group in the entries' order, and its
    recurrent caches in order."""
    tables: dict[int, BlockTable] = {}
    disk, states = None, []
    for c in _flat(cache if isinstance(cache, list | tuple) else []):
        if isinstance(c, PagedKVCache):
            disk = _DISKS.get(c.pool)
            tables[id(c.pool)] = c.table
        else:
            states.append(c)
    if disk is None:
        raise ValueError(
            f"{what} needs a cache from make_paged_cache(model, kv_disk_dir=..., "
            "kv_disk_bytes=...)."
        )
    if len(states) != len(disk.entries):
        raise ValueError(f"{what}: this cache list is not the one make_paged_cache built.")
    return disk, [tables[id(p)] for p in disk.pools], states


def _flat(caches: Sequence[Any]) -> list[Any]:
    out = []
    for c in caches:
        out += _flat(c.caches) if isinstance(c, CacheList) else [c]
    return out


def _token_ids(tokens: Sequence[int], what: str) -> list[int]:
    """``tokens`` as a list of ints (a list, an ``mx.array`` or numpy array of ids)."""
    if hasattr(tokens, "tolist"):
        tokens = tokens.tolist()
    try:
        out = list(tokens)
    except TypeError:
        out = None
    if out is None or not all(isinstance(t, int) and not isinstance(t, bool) for t in out):
        raise ValueError(f"{what}: tokens must be a sequence of token ids (ints).")
    return out
