"""The disk tier: full blocks the prefix index evicts go to files, and come back on a miss.

``DiskTier`` joins a ``DiskStore`` (``storage/disk.py``) to an engine's pools
and prefix index:

- **Spill.** When a pool evicts a parked full-attention block, the index
  tells the tier of it and of the full blocks below it (``PrefixIndex.on_spill``);
  each one's K/V, every layer of every group, is written under the key of its
  token prefix, and a hybrid model's recurrent-state snapshot ending there under
  that key plus ``STATE``. A snapshot the state pool evicts is written the same
  way. ``spill_cached`` writes every parked full block and snapshot (a server's
  shutdown), so that a restart finds them. The engine thread only reads the
  arrays out of the pools; the store's writer thread writes the files.
- **Load.** Before admission matches a prompt, ``load`` reads the full blocks
  that follow what memory holds, for as long as the disk has them and the pool
  has room, writes them into fresh blocks and parks them in the index; the
  match then adopts them like any cached block. Files are read in runs of up
  to ``LOAD_BATCH`` blocks and ``LOAD_BYTES`` bytes, each into its own staging
  buffer (``storage/pinned.py``), the next ``READS_AHEAD`` runs on the store's
  threads while this one is written into the pool. A run's copy into MLX goes on
  a stream of its own, beside the last run's pool writes; its entries are views
  of that copy, which the writes read in place. The threads check each file's
  size and header; on a GPU the arrays' checksums (``storage/disk_format.py``)
  are checked in MLX, on the copy's stream, and the blocks of an entry that
  fails (and those after it) go back unindexed, its file deleted (elsewhere the
  threads check them too: ``CHECK_IN_MLX``). While other requests run, the
  scheduler asks for at most ``step_blocks`` blocks (and ``step_bytes`` bytes) a
  step and the request waits for the rest, whose first run is read meanwhile:
  their decoding never stalls for a whole prompt's load. For a hybrid model, the
  deepest snapshot on disk that ends within the loaded blocks comes back with the
  last part, since a prefix is adopted only up to a snapshot. With ``preload``, the
  newest entries are read into host memory as the tier opens, and a run they hold is
  taken from there instead of read (``storage/preload.py``); its threads check the
  sums as they read, wherever loads check them. A load's upkeep (its files
  marked used and closed, the preload's memory given back) waits for the end of the
  engine's step (``after_step``), after the first tokens it was for.

Keys chain the prefix's blocks: a block's key hashes its parent's key and its own
tokens, so one key names the whole prefix. The store's fingerprint names the
model (its type, arguments, parameter shapes and dtypes, and samples of its
weights) and the cache's layout (block size, groups, layers, storage dtype), so
another model or setting never hits. A sliding-window group's blocks go with a
block's file while the group holds them; a load fills that group's table from
the first file that has them.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from functools import cached_property, partial
from itertools import count

import mlx.core as mx
import mlx.nn as nn

from ..blocks import LayerKind
from ..blocks.prefix_index import path_blocks
from ..storage import KVPool
from ..storage.disk import DiskStore
from ..storage.disk_entries import (
    STATE,
    cache_layout,
    chain_keys,
    fingerprint,
    make_room,
    new_blocks,
    state_parts,
    to_host,
    write_blocks,
)
from ..storage.disk_files import start_threads
from ..storage.disk_format import Run
from ..storage.disk_runs import read_ahead
from ..storage.pinned import Staging
from ..storage.preload import Preload
from .disk_blocks import (
    KeyChain,
    Writes,
    agreed_run,
    load_room,
    load_snapshot,
    parked,
    pinned_tables,
    rehearse_load,
    restore_plan,
    spill_blocks,
    stage,
)
from .distributed import Ranks
from .scheduler import Scheduler

__all__ = ["DiskTier", "chain_keys"]

logger = logging.getLogger("mlx_paged.disk")

#: Blocks ``spill_cached`` reads out of the pools per evaluation.
SPILL_BATCH = 256
#: Blocks ``load`` reads per run.
LOAD_BATCH = 256
#: ... and at most this many bytes of them: a staging buffer's size, of which a load
#: holds ``READS_AHEAD + 1``. Fewer runs make fewer MLX calls (BENCHMARKS.md, runs 200-202).
LOAD_BYTES = 128 << 20
#: Runs a load reads ahead of the one it writes into the pool.
READS_AHEAD = 2
#: Blocks a step loads for a request while others run (``DiskTier.step_blocks``) ...
STEP_BLOCKS = 512
#: ... and at most this many bytes of them (``DiskTier.step_bytes``): about 140 64-token
#: blocks of a 1B llama. A load's time goes as much per block as per byte (BENCHMARKS.md,
#: runs 218-219), so small blocks take the block cap, large ones this.
STEP_BYTES = 288 << 20
#: Where a load checks its entries' word sums: in MLX, on the bytes copied to the device,
#: in the evaluation that writes them into the pool (``True``), or on the store's reader
#: threads with numpy (``False``). ``None``: in MLX on a GPU; on the threads elsewhere,
#: where MLX's CPU ops sum several times slower than numpy over threads.
CHECK_IN_MLX: bool | None = None


class DiskTier:
    """Spills an engine's evicted full blocks to ``store`` and loads them back.

    Args:
        store: The files.
        pools: The engine's pools, per layer group.
        scheduler: The engine's scheduler (its index and block tables).
        group: The ranks of a sharded engine, each with its own ``store``: they load
            only what all have and read well (``Ranks``), so their schedulers agree.
    """

    def __init__(
        self,
        store: DiskStore,
        pools: dict[LayerKind, KVPool],
        scheduler: Scheduler,
        group: mx.distributed.Group | None = None,
    ):
        self.store, self.scheduler, self.ranks = store, scheduler, Ranks(group)
        self.pools = [pools[k] for k in scheduler.kinds]
        self.windows = [k.window for k in scheduler.kinds]
        self.states = getattr(scheduler.recurrent, "slots", None)  # a StatePool, or None
        self.block_size = scheduler.block_size
        # Loading (of it: reads waited for, copies and checks started, pool writes), spilling.
        self.seconds = dict.fromkeys(("load", "load_wait", "load_copy", "load_eval", "write"), 0.0)
        self._reader = ThreadPoolExecutor(READS_AHEAD, "mlx_paged-disk-ahead")  # runs' reads
        self._spills, self._loads = KeyChain(self.block_size), KeyChain(self.block_size)
        self._ahead: tuple[str, int, Future] | None = None  # (first key, entries, their read)
        self._last_read: Future | None = None  # the read asked for last (``_read``)
        self._after: list[Callable[[], object]] = []  # a load's upkeep, for ``after_step``
        self._size: int | None = None  # under a group: the entry size runs are planned by
        # Most blocks a step loads while others run, and most bytes of them.
        self.step_blocks, self.step_bytes = STEP_BLOCKS, STEP_BYTES
        self.staging = Staging(READS_AHEAD + 1)  # the host buffers runs are read into
        self.preloaded: Preload | None = None  # the newest entries, read at start (``preload``)
        self.restored_tokens = 0  # of them loaded into the pools at start (``restore``)
        self._to_mlx = self.staging.to_mlx  # a run's rows into MLX
        scheduler.index.on_spill = self.spill
        scheduler.disk = self

    @classmethod
    def open(
        cls,
        path: str | os.PathLike,
        max_bytes: int,
        model: nn.Module,
        pools: dict[LayerKind, KVPool],
        scheduler: Scheduler,
        group: mx.distributed.Group | None = None,
    ) -> DiskTier:
        """A tier over the directory ``path`` for this model and cache layout (a rank's
        shard in its own part of it, ``Ranks.own``).

        Raises:
            ValueError: for a bad ``max_bytes``.
        """
        path, max_bytes = Ranks(group).own(path, max_bytes)
        name = fingerprint(model, (scheduler.block_size, cache_layout(pools)))
        return cls(DiskStore(path, max_bytes, name), pools, scheduler, group)

    # ---- spill ------------------------------------------------------------

    def spill(self, tokens: Sequence[int], blocks: Sequence[int], snapshot: int | None = None):
        """Write one full block (the last of ``tokens``) and the recurrent-state snapshot
        ending there, if any, unless the disk has them."""
        key, chain = self._spills.link(tokens)
        spill_blocks(self.store, self.pools, [(key, list(blocks), chain)], self.seconds)
        if snapshot is not None:
            self._spill_state(key, snapshot)

    def spill_cached(self) -> int:
        """Write every parked full block (and snapshot) the disk lacks and wait for the
        writes; return how many files were written."""
        before = self.store.counts["writes"]
        found = [(*self._spills.link(t), b, snap) for t, b, snap in parked(self.scheduler.index)]
        for lo in range(0, len(found), SPILL_BATCH):
            items = [(key, b, chain) for key, chain, b, _ in found[lo : lo + SPILL_BATCH]]
            spill_blocks(self.store, self.pools, items, self.seconds)
        for key, snapshot in [(key, snap) for key, _, _, snap in found if snap is not None]:
            self._spill_state(key, snapshot)
        self.store.flush()
        return self.store.counts["writes"] - before

    def preload(self, max_bytes: int) -> Preload:
        """Read and check the newest entries, up to ``max_bytes``, into host memory in the
        background for loads to take (``storage/preload.py``); on the thread of MLX calls."""
        self.preloaded = Preload(self.store, max_bytes, LOAD_BYTES, payloads=True)
        self._to_mlx = partial(self.preloaded.to_mlx, staging=self.staging)
        return self.preloaded

    def restore(self) -> int:
        """Wait for the preload, and load each prefix it holds whole into the pools as parked
        blocks (as a load does), oldest first, so that a restart's first request for it hits
        memory (a sharded engine's ranks: what all found, together). The tokens loaded."""
        if self.preloaded is None or not self.preloaded.wait():
            return 0
        start, prefixes = time.perf_counter(), self.preloaded.prefixes()
        prefixes = restore_plan(self.ranks, self.scheduler, prefixes, self._loads)
        self.restored_tokens += (loaded := sum(restore_prefix(self, t) for t in prefixes))
        self.after_step()
        logger.info("mlx_paged: restored %d cached tokens (%d prefixes) from disk in %.2f s",
                    loaded, len(prefixes), time.perf_counter() - start)  # fmt: skip
        return loaded

    def rehearse(self) -> bool:
        """Pin the staging buffers, start the threads, and run a spill's and a load's MLX work
        on a cached block (no file written) before a first load; whether there was one."""
        self.staging.reserve(LOAD_BYTES)
        self.store.start_threads()
        start_threads(self._reader, READS_AHEAD)
        load = (self.pools, self.windows, self.staging, self._copies)
        return rehearse_load(self.store.fingerprint, self.scheduler.index, *load)

    def _spill_state(self, key: str, snapshot: int) -> None:
        """Queue the file of a snapshot taken at the end of block ``key``."""
        if key + STATE not in self.store and self.store.enabled:
            state = self.states.snapshot_state(snapshot)
            self.store.put_later(key + STATE, to_host(*state_parts(state))[0])

    # ---- load -------------------------------------------------------------

    def load(self, tokens: Sequence[int], busy: bool = False) -> tuple[int, bool]:
        """Bring the full blocks of ``tokens`` past what memory holds back from disk, as
        parked blocks (at most ``step_blocks`` and ``step_bytes`` when ``busy``: other
        requests are running), with the deepest snapshot past memory's for a hybrid model
        once no more are to come.
        Returns the tokens loaded, and whether more are on disk (the next part is being read
        ahead) after a load that took all it could."""
        if not self.store.enabled and self.ranks.group is None:  # ranks load together
            return 0, False
        start = time.perf_counter()
        keys = self._loads.keys(tokens)
        loaded, more = self._load(tokens, keys, busy)
        if self.states is not None and not more:
            load_snapshot(self.store, self.states, self.scheduler.index, self.ranks, tokens, keys)
        if not more:
            self._after.append(self.store.close_files)
            if self.preloaded is not None:  # once loads asked for all it read (maybe later)
                self._after.append(self.preloaded.release)
        self.seconds["load"] += time.perf_counter() - start
        return loaded, more

    def after_step(self) -> None:
        """Run the upkeep this step's loads left, once the step's first tokens are out."""
        jobs, self._after = self._after, []
        for job in jobs:
            job()

    def _load(self, tokens: Sequence[int], keys: list[str], busy: bool) -> tuple[int, bool]:
        bs, index, groups = self.block_size, self.scheduler.index, self.scheduler.groups
        kinds, have = self.scheduler.kinds, index.full_blocks_matched(tokens) // bs
        keys = keys[have:]
        self._size = self.store.size(keys[0]) if keys else None
        limit = self._most(keys[0], self.step_blocks, self.step_bytes) if busy and keys else None
        # What this call loads, and the next call's first run (read ahead) past it.
        n = self.store.leading(keys if limit is None else keys[: limit + LOAD_BATCH])
        if self.ranks.group is not None:  # what every rank has, in runs of one plan
            rows = self.ranks.gather([self._size or 0, n])
            self._size, n = max(r[0] for r in rows) or None, min(r[1] for r in rows)
            limit = limit and self._most(keys[0], self.step_blocks, self.step_bytes)
        if not n:
            return 0, False
        keys, rest = keys[: min(n, limit or n)], keys[min(n, limit or n) : n]
        start = end = have * bs
        tables = pinned_tables(groups, path_blocks(index, tokens, have), have)
        writes, copy = Writes(self.pools, self.seconds), (self._to_mlx, self._copies)
        runs = self._runs(keys)
        for i in count():
            run, ragged = agreed_run(self.ranks, next(runs, None))
            if ragged:  # the ranks' runs part here: the load ends after this one
                runs = iter(())
            # A run's copy and checks start on the copy stream beside the last run's pool
            # writes; its own writes are made once those are done (Writes). Blocks written
            # from a bad entry on are given back below, never indexed.
            staged = run and stage(run, self.pools, self.windows, *copy, self.seconds)
            n, own = writes.wait()
            # A bad entry on any rank ends every rank's load (alone: as their own).
            good, staged_all = self.ranks.least(own, staged is not None)
            self.store.hit(good)
            end += good * bs
            if good < n:
                if own < n:
                    bad = keys[(end - start) // bs + own - good]
                    self.store.discard(bad, "the checksum of an entry's arrays does not match")
                break
            if not staged_all:
                break
            arrays, cold, ok = staged
            if i == 0:  # the whole load's room at once: each growth copies the pool
                for k, c in zip(kinds, cold, strict=True):
                    if k.window is None:
                        room = load_room(len(tokens), have, self.scheduler)
                        make_room(groups[k], c, len(keys), room)
            ids = [
                new_blocks(groups[k], tables[k], end, len(run), c)
                for k, c in zip(kinds, cold, strict=True)
            ]
            if None in ids:
                break  # no room in memory for more
            for g in range(len(kinds)):
                if cold[g] is not None:
                    write_blocks(self.pools[g], g, ids[g], arrays, cold[g])
            writes.start(len(run), ok)
        if end > start:
            self._after.append(partial(self.store.used, keys[: (end - start) // bs]))
            for table in tables.values():
                table.lengths[:] = [end] * len(table.lengths)
            spans = [(tables[k].first, tables[k].blocks) for k in kinds]
            index.insert(tokens, spans, length=end, partial=False)
        for kind, table in tables.items():  # blocks taken past a bad file go back too
            groups[kind].release(table)
        more = bool(rest) and end - start == len(keys) * bs
        if more:  # the next call's first run (no more than it takes), read while we step
            n = min(self._most(rest[0]), limit or len(rest), len(rest))
            self._ahead = (rest[0], n, self._read(rest[:n], 0))
        return end - start, more

    def _runs(self, keys: list[str]) -> Iterator[Run]:
        """The entries of ``keys`` in runs of one layout (``read_ahead``); a run the last
        call read ahead comes first if it starts there."""
        first, ahead, self._ahead = None, self._ahead, None
        if ahead is not None and ahead[0] == keys[0] and ahead[1] <= len(keys):
            first = ahead[1:]
        elif ahead is not None:
            ahead[2].result()  # a stale read: done with its buffer before it is reused
        cut = self.preloaded is not None and self.ranks.group is None  # ranks plan runs alike
        most = self.preloaded.cut(keys, self._most) if cut else self._most
        return read_ahead(keys, first, most, self._read, READS_AHEAD, self.seconds)

    @cached_property
    def _copies(self) -> mx.Stream:
        """The stream runs are copied in on (made on the first load's thread, the engine's)."""
        return mx.new_stream(mx.default_device())

    def _most(self, key: str, blocks: int | None = None, most: int | None = None) -> int:
        """Entries from ``key`` on that make a run, or a step's load: ``blocks`` (``LOAD_BATCH``),
        fewer where they pass ``most`` bytes (``LOAD_BYTES``); one at least. Ranks plan a
        load's runs by the size they agreed on for its first entry."""
        size = self._size if self.ranks.group is not None else self.store.size(key)
        most = (LOAD_BYTES if most is None else most) // (size or 1)
        return max(1, min(LOAD_BATCH if blocks is None else blocks, most))

    def _read(self, keys: list[str], i: int) -> Future:
        """``read_run(keys)`` into buffer ``i``, or the run ``preloaded`` holds; a bad file
        waits for the last read to drop."""
        if self.preloaded is not None and (done := self.preloaded.future(keys)) is not None:
            return done
        last, out = self._last_read, partial(self.staging.buffer, i)
        self._last_read = self._reader.submit(self.store.read_run, keys, out, not in_mlx(), last)
        return self._last_read


def restore_prefix(tier: DiskTier, tokens: list[int]) -> int:
    """``tier.load(tokens)``, and for a hybrid model also the deepest snapshot before the
    prefix's end: its load brings the one at the end, which a request of exactly these
    tokens cannot adopt (its last token is computed). The tokens loaded."""
    loaded = tier.load(tokens)[0]
    if tier.states is not None and len(tokens) > 1:
        head = tokens[:-1]
        index, keys = tier.scheduler.index, chain_keys(head, tier.block_size)
        load_snapshot(tier.store, tier.states, index, tier.ranks, head, keys)
    return loaded


def in_mlx() -> bool:
    """Whether loads check the payloads' sums in MLX (``CHECK_IN_MLX``)."""
    return mx.default_device() == mx.gpu if CHECK_IN_MLX is None else CHECK_IN_MLX
