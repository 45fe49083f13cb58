"""The disk tier: full blocks the prefix index evicts go to files, and come back on a miss.

``DiskTier`` joins a ``DiskStore`` (``storage/disk.py``) to an engine's pools
and prefix index:

- **Spill.** When a pool evicts a parked full-attention block, the index
  tells the tier of it and of the full blocks below it (``PrefixIndex.on_spill``);
  each one's K/V, every layer of every group, is written under the key of its
  token prefix. ``spill_cached`` writes every parked full block (a server's
  shutdown), so that a restart finds them.
- **Load.** Before admission matches a prompt, ``load`` reads the full blocks
  that follow what memory holds, for as long as the disk has them and the pool
  has room, writes them into fresh blocks and parks them in the index; the
  match then adopts them like any cached block.

Keys chain the prefix's blocks: a block's key hashes its parent's key and its own
tokens, so one key names the whole prefix. The store's fingerprint names the
model (its type, arguments, parameter shapes and dtypes, and samples of its
weights) and the cache's layout (block size, groups, layers, storage dtype), so
another model or setting never hits. Models with sliding-window layers,
recurrent layers or a quantized cold tier are refused for now.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from ..blocks import LayerKind
from ..blocks.prefix_index import spill_parked
from ..storage import KVPool
from ..storage.disk import DiskStore
from .scheduler import Scheduler, adopted_tables


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
        self.block_size = scheduler.block_size
        self.seconds = {"load": 0.0, "write": 0.0}  # loading into the pool, spilling
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
            ValueError: for a cache the disk tier does not serve yet (sliding-window or
                recurrent layers, a quantized cold tier), or a bad ``max_bytes``.
        """
        if scheduler.recurrent is not None:
            raise ValueError("the disk tier does not yet serve models with recurrent layers.")
        for kind, pool in pools.items():
            if kind.window is not None:
                raise ValueError("the disk tier does not yet serve sliding-window layers.")
            if pool.quant is not None:
                raise ValueError("the disk tier does not yet serve a quantized cold tier.")
        layout = [(k.window, p.num_layers, str(p.kv_dtype)) for k, p in pools.items()]
        name = fingerprint(model, (scheduler.block_size, layout))
        return cls(DiskStore(path, max_bytes, name), pools, scheduler)

    # ---- spill ------------------------------------------------------------

    def spill(self, tokens: Sequence[int], blocks: Sequence[int]) -> None:
        """Write one full block (the last of ``tokens``), unless the disk has it."""
        key = chain_keys(tokens, self.block_size)[-1]
        if key in self.store or not self.store.enabled:
            return
        arrays: dict[str, mx.array] = {}
        for g, (pool, b) in enumerate(zip(self.pools, blocks, strict=True)):
            for layer in range(pool.num_layers):
                if pool.keys[layer] is None:
                    return  # a layer never written: nothing to keep
                model = _name(pool.input_dtypes[layer])
                for which, stored in (("k", pool.keys[layer]), ("v", pool.values[layer])):
                    arrays[f"{g}.{layer}.{which}.{_name(stored.dtype)}.{model}"] = stored[b]
        start = time.perf_counter()
        mx.eval(list(arrays.values()))
        self.store.put(key, {name: _to_numpy(a) for name, a in arrays.items()})
        self.seconds["write"] += time.perf_counter() - start

    def spill_cached(self) -> int:
        """Write every parked full block the disk lacks; return how many were written."""
        before = self.store.counts["writes"]
        spill_parked(self.scheduler.index)
        return self.store.counts["writes"] - before

    # ---- load -------------------------------------------------------------

    def load(self, tokens: Sequence[int]) -> int:
        """Bring the full blocks of ``tokens`` past what memory holds back from disk, as
        parked blocks; return the tokens loaded."""
        if not self.store.enabled:
            return 0
        start = time.perf_counter()
        loaded = self._load(tokens)
        self.seconds["load"] += time.perf_counter() - start
        return loaded

    def _load(self, tokens: Sequence[int]) -> int:
        bs, index = self.block_size, self.scheduler.index
        have = index.full_blocks_matched(tokens) // bs
        keys = chain_keys(tokens[: len(tokens) // bs * bs], bs)
        entries = []
        for key in keys[have:]:
            if key not in self.store:
                break
            groups = self.scheduler.groups
            if not all(groups[k].blocks.can_allocate(len(entries) + 1) for k in groups):
                break
            arrays = self.store.get(key)
            if (
                arrays is None
                or not self._fits(arrays)
                or entries
                and arrays.keys() != entries[0].keys()
            ):
                break
            entries.append(arrays)
        if not entries:
            return 0
        start, end = have * bs, (have + len(entries)) * bs
        match = index.match(tokens[:start]) if start else None
        tables = adopted_tables(self.scheduler.groups, match)
        for g, kind in enumerate(self.scheduler.kinds):
            group, table = self.scheduler.groups[kind], tables[kind]
            group.reserve(table, start, end)
            self._write(g, table.blocks[have - table.first :], entries)
            table.lengths[:] = [end] * len(table.lengths)
        spans = [(tables[k].first, tables[k].blocks) for k in self.scheduler.kinds]
        index.insert(tokens, spans, length=end, partial=False)
        for kind, table in tables.items():
            self.scheduler.groups[kind].release(table)
        return end - start

    def _fits(self, arrays: dict[str, np.ndarray]) -> bool:
        """Whether an entry holds K and V for every layer of every group."""
        names = {n.rsplit(".", 2)[0] for n in arrays}
        want = {
            f"{g}.{layer}.{w}"
            for g, pool in enumerate(self.pools)
            for layer in range(pool.num_layers)
            for w in "kv"
        }
        return names == want

    def _write(self, g: int, ids: list[int], entries: list[dict[str, np.ndarray]]) -> None:
        """Write group ``g``'s K/V of ``entries`` into blocks ``ids``, one write per layer
        and array, making the layers a fresh pool lacks."""
        pool = self.pools[g]
        names = {}
        for name in entries[0]:
            group, layer, which, dtype, model = name.split(".")
            if int(group) == g:
                names[(int(layer), which)] = (name, getattr(mx, dtype), getattr(mx, model))
        at = mx.array(ids, dtype=mx.int32)
        for layer in range(pool.num_layers):
            k, v = (
                mx.array(np.stack([e[name] for e in entries])).view(dtype)  # (n, bs, H, D)
                for name, dtype, _ in (names[(layer, "k")], names[(layer, "v")])
            )
            if pool.keys[layer] is None:  # a fresh pool: the layer's arrays come first
                model = names[(layer, "k")][2]
                pool._create_layer(
                    layer,
                    mx.zeros((1, k.shape[2], 1, k.shape[3]), model),
                    mx.zeros((1, v.shape[2], 1, v.shape[3]), model),
                )
                pool.input_dtypes[layer] = model
            pool.keys[layer][at] = k.astype(pool.keys[layer].dtype)
            pool.values[layer][at] = v.astype(pool.values[layer].dtype)


def chain_keys(tokens: Sequence[int], block_size: int) -> list[str]:
    """The key of each full block of ``tokens``: a hash of its parent's key and its tokens."""
    keys, parent = [], b""
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


def _name(dtype: mx.Dtype) -> str:
    """``mx.float16`` -> ``"float16"``."""
    return str(dtype).rsplit(".", 1)[-1]


def _to_numpy(a: mx.array) -> np.ndarray:
    """``a``'s bytes as numpy (any dtype, bfloat16 included); the last axis counts bytes."""
    return np.array(a.view(mx.uint8))
