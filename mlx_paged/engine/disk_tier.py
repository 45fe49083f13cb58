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
  match then adopts them like any cached block. Files are read in runs of
  ``LOAD_BATCH`` blocks, the next run on the store's threads while this one is
  written into the pool. While other requests run, the scheduler asks for at
  most ``step_blocks`` blocks a step and the request waits for the rest, whose
  first run is read meanwhile: their decoding never stalls for a whole prompt's
  load. For a hybrid model, the deepest snapshot on disk that ends within the
  loaded blocks comes back with the last part, since a prefix is adopted only up
  to a snapshot.

Keys chain the prefix's blocks: a block's key hashes its parent's key and its own
tokens, so one key names the whole prefix. The store's fingerprint names the
model (its type, arguments, parameter shapes and dtypes, and samples of its
weights) and the cache's layout (block size, groups, layers, storage dtype), so
another model or setting never hits. Models with sliding-window layers or a
quantized cold tier are refused for now.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from ..blocks import COLD, BlockTable, LayerKind, is_cold
from ..blocks.prefix_index import spill_parked
from ..storage import KVPool
from ..storage.disk import DiskStore, Run
from .scheduler import Scheduler, adopted_tables

#: Blocks ``spill_cached`` reads out of the pools per evaluation.
SPILL_BATCH = 256
#: Blocks ``load`` reads per run: two runs' files are in host memory at once.
LOAD_BATCH = 64
#: Blocks a step loads for a request while others run (``DiskTier.step_blocks``).
STEP_BLOCKS = 128
#: What a snapshot's key adds to the key of the block it ends.
STATE = "s"


class DiskTier:
    """Spills an engine's evicted full blocks to ``store`` and loads them back.

    Args:
        store: The files.
        pools: The engine's pools, per layer group (full attention only).
        scheduler: The engine's scheduler (its index and block tables).
    """

    def __init__(self, store: DiskStore, pools: dict[LayerKind, KVPool], scheduler: Scheduler):
        self.store, self.scheduler = store, scheduler
        self.pools = [pools[k] for k in scheduler.kinds]
        recurrent = scheduler.recurrent
        self.states = recurrent.slots if recurrent is not None else None  # a StatePool
        self.block_size = scheduler.block_size
        # Loading into the pool (of which: waiting on file reads, copying into MLX), and
        # spilling (the engine thread's part: reading the pools out).
        self.seconds = dict.fromkeys(("load", "load_wait", "load_copy", "write"), 0.0)
        self._reader = ThreadPoolExecutor(1, "mlx_paged-disk-ahead")  # reads the next run
        self._chain: tuple[list[int], list[str]] = ([], [])  # the last tokens _key saw, keys
        self._ahead: tuple[str, Future] | None = None  # (first key, its run being read)
        self.step_blocks = STEP_BLOCKS  # most blocks a step loads while others run
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
    ) -> DiskTier:
        """A tier over the directory ``path`` for this model and cache layout.

        Raises:
            ValueError: for a cache the disk tier does not serve yet (sliding-window
                layers), or a bad ``max_bytes``.
        """
        for kind in pools:
            if kind.window is not None:
                raise ValueError("the disk tier does not yet serve sliding-window layers.")
        layout = [
            (
                k.window,
                p.num_layers,
                str(p.kv_dtype),
                p.quant and (p.quant.bits, p.quant.group_size),
            )
            for k, p in pools.items()
        ]
        name = fingerprint(model, (scheduler.block_size, layout))
        return cls(DiskStore(path, max_bytes, name), pools, scheduler)

    # ---- spill ------------------------------------------------------------

    def spill(self, tokens: Sequence[int], blocks: Sequence[int], snapshot: int | None = None):
        """Write one full block (the last of ``tokens``) and the recurrent-state snapshot
        ending there, if any, unless the disk has them."""
        key = self._key(tokens)
        self._spill([(key, list(blocks))])
        if snapshot is not None:
            self._spill_state(key, snapshot)

    def spill_cached(self) -> int:
        """Write every parked full block (and snapshot) the disk lacks and wait for the
        writes; return how many files were written."""
        before = self.store.counts["writes"]
        found: list[tuple[str, list[int], int | None]] = []
        on_spill = self.scheduler.index.on_spill
        self.scheduler.index.on_spill = lambda tokens, blocks, snapshot: found.append(
            (self._key(tokens), list(blocks), snapshot)
        )
        try:
            spill_parked(self.scheduler.index)
        finally:
            self.scheduler.index.on_spill = on_spill
        for lo in range(0, len(found), SPILL_BATCH):
            self._spill([(key, blocks) for key, blocks, _ in found[lo : lo + SPILL_BATCH]])
        for key, _, snapshot in found:
            if snapshot is not None:
                self._spill_state(key, snapshot)
        self.store.flush()
        return self.store.counts["writes"] - before

    def rehearse(self) -> bool:
        """Run a spill's and a load's MLX work once on a cached block, writing no file, so
        that a fresh process builds their kernels before its first request (the block is
        rewritten with its own bytes); whether there was a block to do it on."""
        found: list[list[int]] = []
        on_spill = self.scheduler.index.on_spill
        self.scheduler.index.on_spill = lambda tokens, blocks, snapshot: found.append(blocks)
        try:
            spill_parked(self.scheduler.index)
        finally:
            self.scheduler.index.on_spill = on_spill
        if not found:
            return False
        blocks = found[0]
        cold = tuple(map(is_cold, blocks))
        got = self._parts(cold, [blocks])
        if got is None:
            return False
        arrays = _to_host(*got)[0]
        parsed = self._arrays(Run.of(self.store.fingerprint, "rehearsal", arrays))
        for g in range(len(self.pools)):
            self._write(g, [blocks[g]], parsed[0], cold[g])
        mx.eval([a for p in self.pools for a in _arrays_of(p)])
        return True

    def _key(self, tokens: list[int]) -> str:
        """The key of the last full block of ``tokens``, reusing the keys of the blocks it
        shares with the last call's tokens (an eviction walks a prefix parents first)."""
        bs, (last, keys) = self.block_size, self._chain
        n = len(tokens) // bs
        same = min(n, len(keys))
        if tokens[: same * bs] != last[: same * bs]:  # not an extension: find where they part
            same = 0
        while same < min(n, len(keys)) and (
            tokens[same * bs : (same + 1) * bs] == last[same * bs : (same + 1) * bs]
        ):
            same += 1
        keys = keys[:same] + chain_keys(
            tokens[same * bs : n * bs], bs, keys[same - 1] if same else ""
        )
        self._chain = (tokens, keys)
        return keys[-1]

    def _spill(self, items: list[tuple[str, list[int]]]) -> None:
        """Read the blocks of ``(key, block per group)`` items the disk lacks out of the
        pools, one evaluation per tier, and queue their files on the store's writer."""
        items = [(key, blocks) for key, blocks in items if key not in self.store]
        if not items or not self.store.enabled:
            return
        start = time.perf_counter()
        tiers: dict[tuple[bool, ...], list[tuple[str, list[int]]]] = {}
        for key, blocks in items:
            tiers.setdefault(tuple(map(is_cold, blocks)), []).append((key, blocks))
        for cold, same in tiers.items():
            got = self._parts(cold, [blocks for _, blocks in same])
            if got is None:
                return  # a layer never written: nothing to keep
            for (key, _), arrays in zip(same, _to_host(*got), strict=True):
                self.store.put_later(key, arrays)
        self.seconds["write"] += time.perf_counter() - start

    def _parts(
        self, cold: tuple[bool, ...], rows: list[list[int]]
    ) -> tuple[list[str], list[mx.array]] | None:
        """Entry names and ``(n, bs, H, ...)`` arrays of blocks ``rows`` (a block per group,
        in the tiers ``cold`` says); ``None`` if a layer was never written."""
        names, parts = [], []
        for g, pool in enumerate(self.pools):
            at = mx.array([r[g] - COLD if cold[g] else r[g] for r in rows], dtype=mx.int32)
            for layer in range(pool.num_layers):
                if pool.keys[layer] is None:
                    return None
                model = _name(pool.input_dtypes[layer])
                for which in "kv":
                    if cold[g]:  # quantized: packed values, scales, biases
                        held = (pool.cold.keys if which == "k" else pool.cold.values)[layer]
                        for part, x in zip("qsb", held, strict=True):
                            names.append(f"{g}.{layer}.{which}{part}.{_name(x.dtype)}.{model}")
                            parts.append(x[at])
                    else:
                        x = (pool.keys if which == "k" else pool.values)[layer]
                        names.append(f"{g}.{layer}.{which}.{_name(x.dtype)}.{model}")
                        parts.append(x[at])
        return names, parts

    def _spill_state(self, key: str, snapshot: int) -> None:
        """Queue the file of a snapshot taken at the end of block ``key``."""
        if key + STATE not in self.store and self.store.enabled:
            names, parts = [], []
            for layer, entries in enumerate(self.states.snapshot_state(snapshot)):
                for e, a in enumerate(entries):
                    if a is not None:
                        names.append(f"s.{layer}.{e}.{_name(a.dtype)}")
                        parts.append(a)  # (1, *entry_shape)
            self.store.put_later(key + STATE, _to_host(names, parts)[0])

    # ---- load -------------------------------------------------------------

    def load(self, tokens: Sequence[int], limit: int | None = None) -> tuple[int, bool]:
        """Bring the full blocks of ``tokens`` past what memory holds back from disk, as
        parked blocks, at most ``limit`` of them (``None``: all), with the deepest snapshot
        past memory's for a hybrid model once no more are to come.

        Returns the tokens loaded, and whether the disk holds more of the prompt's blocks
        (the next ``limit``, read ahead on a thread meanwhile) after a load that took all
        it could.
        """
        if not self.store.enabled:
            return 0, False
        start = time.perf_counter()
        keys = chain_keys(tokens, self.block_size)
        loaded, more = self._load(tokens, keys, limit)
        if self.states is not None and not more:
            self._load_state(tokens, keys)
        self.seconds["load"] += time.perf_counter() - start
        return loaded, more

    def _load(self, tokens: Sequence[int], keys: list[str], limit: int | None) -> tuple[int, bool]:
        bs, index, groups = self.block_size, self.scheduler.index, self.scheduler.groups
        kinds = self.scheduler.kinds
        have = index.full_blocks_matched(tokens) // bs
        keys = keys[have:]
        n = 0
        while n < len(keys) and keys[n] in self.store:
            n += 1
        if not n:
            return 0, False
        keys, rest = keys[: min(n, limit or n)], keys[min(n, limit or n) : n]
        start = have * bs
        match = index.match(tokens[:start], states=False) if start else None
        tables = adopted_tables(groups, match)
        end = start
        for run in self._runs(keys):
            parsed = self._arrays(run)
            if parsed is None:
                break
            arrays, cold = parsed
            ids = [
                self._blocks(groups[k], tables[k], end, len(run), c)
                for k, c in zip(kinds, cold, strict=True)
            ]
            if None in ids:
                break  # no room in memory for more
            for g in range(len(kinds)):
                self._write(g, ids[g], arrays, cold[g])
            # Each run's writes finish before the next run's start: a pool write that
            # waits on one still in flight would copy the whole pool (DESIGN.md).
            mx.eval([a for p in self.pools for a in _arrays_of(p)])
            end += len(run) * bs
        if end > start:
            for table in tables.values():
                table.lengths[:] = [end] * len(table.lengths)
            spans = [(tables[k].first, tables[k].blocks) for k in kinds]
            index.insert(tokens, spans, length=end, partial=False)
        for kind, table in tables.items():  # blocks taken past a bad file go back too
            groups[kind].release(table)
        more = bool(rest) and end - start == len(keys) * bs
        if more:  # the next call's first run, read while the engine steps
            self._ahead = (rest[0], self._reader.submit(self.store.read_run, rest[:LOAD_BATCH]))
        return end - start, more

    @staticmethod
    def _blocks(pool: KVPool, table: BlockTable, at: int, n: int, cold: bool) -> list[int] | None:
        """``n`` new blocks (cold ones for quantized entries) at token ``at`` of ``table``;
        ``None`` when the pool cannot free them."""
        if cold:
            slots = pool.blocks.cold.allocate(n)
            if slots is None:
                return None
            table.blocks.extend(c + COLD for c in slots)
        else:
            if not pool.blocks.can_allocate(n):
                return None
            pool.reserve(table, at, at + n * pool.block_size)
        lo = at // pool.block_size - table.first
        return table.blocks[lo : lo + n]

    def _load_state(self, tokens: Sequence[int], keys: list[str]) -> None:
        """Give the index the deepest snapshot on disk that ends in the full blocks memory
        holds now and past the longest prefix it can already adopt."""
        bs, index = self.block_size, self.scheduler.index
        match = index.match(tokens)
        adoptable = match.length // bs if match else 0
        for j in range(index.full_blocks_matched(tokens) // bs, adoptable, -1):
            if keys[j - 1] + STATE not in self.store:
                continue
            arrays = self.store.get(keys[j - 1] + STATE)
            state = self._state(arrays) if arrays is not None else None
            if state is not None:
                index.add_snapshot(tokens, j * bs, lambda state=state: self.states.restore(state))
                return

    def _state(self, arrays: dict[str, np.ndarray]) -> list[list[mx.array | None]] | None:
        """A snapshot file's state, per layer and entry; ``None`` if it is not this model's."""
        state: list[list[mx.array | None]] = [[None] * len(a) for a in self.states.arrays]
        for name, raw in arrays.items():
            kind, layer, e, dtype = name.split(".")
            layer, e = int(layer), int(e)
            if kind != "s" or layer >= len(state) or e >= len(state[layer]):
                return None
            state[layer][e] = mx.array(raw).view(getattr(mx, dtype))[None]
        return state

    def _runs(self, keys: list[str]) -> Iterator[Run]:
        """The entries of ``keys`` in runs of up to ``LOAD_BATCH`` of one layout, each read
        on the store's threads while the caller writes the one before; stops at the first
        missing or bad file."""
        buffers: list[np.ndarray | None] = [None, None]
        ahead = None
        if self._ahead is not None and self._ahead[0] == keys[0]:  # read ahead by the last call
            ahead = self._ahead[1]
        self._ahead = None
        ahead, pos, i = ahead or self._reader.submit(self.store.read_run, keys[:LOAD_BATCH]), 0, 0
        while ahead is not None:
            start = time.perf_counter()
            run = ahead.result()
            self.seconds["load_wait"] += time.perf_counter() - start
            if run is None:
                return
            buffers[i % 2] = run.data if run.data.base is None else run.data.base
            pos, i, ahead = pos + len(run), i + 1, None
            if pos < len(keys):
                chunk = keys[pos : pos + LOAD_BATCH]
                ahead = self._reader.submit(self.store.read_run, chunk, buffers[i % 2])
            yield run

    def _arrays(self, run: Run) -> tuple[dict, list[bool]] | None:
        """The run's arrays per ``(group, layer, name)`` (name ``k``/``v``, or ``kq``,
        ``ks``... for the parts of quantized ones): ``(n, bs, H, ...)`` in the stored
        dtype, with the model's dtype; and per group whether its blocks are cold.
        ``None`` when the entries are not of this cache's layout."""
        parsed = {}
        for spec in run.specs:
            group, layer, which, dtype, model = spec.name.split(".")
            parsed[(int(group), int(layer), which)] = (spec, getattr(mx, dtype), getattr(mx, model))
        cold = [(g, 0, "kq") in parsed for g in range(len(self.pools))]
        want = {
            (g, layer, w + part)
            for g, pool in enumerate(self.pools)
            for layer in range(pool.num_layers)
            for w in "kv"
            for part in ("qsb" if cold[g] else [""])
        }
        if parsed.keys() != want or (any(cold) and self.pools[0].quant is None):
            return None
        start = time.perf_counter()
        data = mx.array(run.data)  # (n, file bytes) uint8: the one copy into MLX
        self.seconds["load_copy"] += time.perf_counter() - start
        out = {}
        for name, (spec, dtype, model) in parsed.items():
            lo = run.payload + spec.start
            raw = data[:, lo : lo + spec.size].reshape(len(run), *spec.shape)
            out[name] = (raw.view(dtype), model)
        return out, cold

    def _write(self, g: int, ids: list[int], arrays: dict, cold: bool) -> None:
        """Write group ``g``'s K/V into blocks ``ids``, one write per layer and array,
        making the layers a fresh pool lacks."""
        pool = self.pools[g]
        at = mx.array([b - COLD if cold else b for b in ids], dtype=mx.int32)
        for layer in range(pool.num_layers):
            if cold:
                k = tuple(arrays[(g, layer, "k" + p)][0] for p in "qsb")
                v = tuple(arrays[(g, layer, "v" + p)][0] for p in "qsb")
                model = arrays[(g, layer, "kq")][1]
                # Heads and head dim from the scales: (n, bs, H, D / group_size).
                (hk, dk), (hv, dv) = (x[1].shape[2:] for x in (k, v))
                dk, dv = dk * pool.quant.group_size, dv * pool.quant.group_size
            else:
                (k, model), (v, _) = arrays[(g, layer, "k")], arrays[(g, layer, "v")]
                (hk, dk), (hv, dv) = k.shape[2:], v.shape[2:]
            if pool.keys[layer] is None:  # a fresh pool: the layer's arrays come first
                pool._create_layer(
                    layer, mx.zeros((1, hk, 1, dk), model), mx.zeros((1, hv, 1, dv), model)
                )
                pool.input_dtypes[layer] = model
            if cold:
                pool.cold.write(layer, k, v, at, pool.blocks.cold.capacity)
            else:
                pool.keys[layer][at] = k.astype(pool.keys[layer].dtype)
                pool.values[layer][at] = v.astype(pool.values[layer].dtype)
        if cold:
            pool._update_bytes_per_block()


def chain_keys(tokens: Sequence[int], block_size: int, parent: str = "") -> list[str]:
    """The key of each full block of ``tokens``: a hash of its parent's key and its tokens
    (``parent``: the key of the block before ``tokens``, if they do not start a prompt)."""
    keys, parent = [], bytes.fromhex(parent)
    for lo in range(0, len(tokens) // block_size * block_size, block_size):
        block = np.asarray(tokens[lo : lo + block_size], dtype=np.int64).tobytes()
        parent = hashlib.blake2b(parent + block, digest_size=20).digest()
        keys.append(parent.hex())
    return keys


def fingerprint(model: nn.Module, layout: object) -> str:
    """A hex digest naming the model (type, arguments, parameter shapes, dtypes and
    samples of their values) and ``layout`` (how the cache stores it)."""
    h = hashlib.blake2b(digest_size=16)
    args = getattr(model, "args", None)
    h.update(repr((type(model).__module__, sorted(vars(args).items()) if args else None)).encode())
    h.update(repr(layout).encode())
    for name, p in tree_flatten(model.parameters()):
        h.update(f"{name}:{p.shape}:{p.dtype}".encode())
        flat = p.reshape(-1)
        n = flat.size
        sample = flat[:: max(1, n // 64)][:64]  # 64 values spread over the array
        h.update(_to_numpy(sample).tobytes())
    return h.hexdigest()


def _arrays_of(pool: KVPool) -> list[mx.array]:
    """Every array a pool holds, both tiers."""
    out = [a for a in (*pool.keys, *pool.values) if a is not None]
    if pool.cold is not None:
        out += [x for q in (*pool.cold.keys, *pool.cold.values) if q is not None for x in q]
    return out


def _to_host(names: list[str], parts: list[mx.array]) -> list[dict[str, np.ndarray]]:
    """Per row of the ``(n, ...)`` arrays ``parts``, its arrays as numpy bytes under
    ``names`` (the last axis counts bytes: numpy has no bfloat16), in one evaluation."""
    n = parts[0].shape[0]
    parts = [p.view(mx.uint8) for p in parts]
    rows = np.array(mx.concatenate([p.reshape(n, -1) for p in parts], axis=1))
    out = []
    for row in rows:
        arrays, lo = {}, 0
        for name, part in zip(names, parts, strict=True):
            hi = lo + part.size // n
            arrays[name] = row[lo:hi].reshape(part.shape[1:])
            lo = hi
        out.append(arrays)
    return out


def _name(dtype: mx.Dtype) -> str:
    """``mx.float16`` -> ``"float16"``."""
    return str(dtype).rsplit(".", 1)[-1]


def _to_numpy(a: mx.array) -> np.ndarray:
    """``a``'s bytes as numpy (any dtype, bfloat16 included); the last axis counts bytes."""
    return np.array(a.view(mx.uint8))
