"""The cold tier's arrays: quantized blocks per layer, and reads that mix both tiers.

A ``ColdStore`` holds, per layer, K and V of every cold slot in MLX's affine
format (packed values, scales and biases, each ``[cold_blocks, block_size,
n_kv_heads, ...]``). ``TierPlan`` and ``read_tiered`` read rows of block ids
whose blocks lie in either tier: hot ones gathered as ``take_blocks`` does,
cold ones dequantized.
"""

from __future__ import annotations

import mlx.core as mx

from ..blocks import COLD, is_cold
from .quant import KVQuant
from .read import take_blocks

#: One layer's cold K or V: packed values, scales and biases.
Quantized = tuple[mx.array, mx.array, mx.array]


class ColdStore:
    """The quantized blocks of one layer group.

    Args:
        num_layers: Layers in the group.
        quant: Bits, group size and hot tail.
    """

    def __init__(self, num_layers: int, quant: KVQuant):
        self.quant = quant
        self.keys: list[Quantized | None] = [None] * num_layers
        self.values: list[Quantized | None] = [None] * num_layers

    def store(self, layer: int, keys: mx.array, values: mx.array, at: mx.array, slots: int) -> None:
        """Quantize ``(n, bs, H, D)`` K and V into cold slots ``at`` of a tier of ``slots``."""
        self.write(layer, self.quant.quantize(keys), self.quant.quantize(values), at, slots)

    def write(
        self, layer: int, keys: Quantized, values: Quantized, at: mx.array, slots: int
    ) -> None:
        """Put quantized ``(n, bs, H, ...)`` K and V parts into cold slots ``at`` of a
        tier of ``slots`` (e.g. blocks read back from disk)."""
        for parts, held_by in ((keys, self.keys), (values, self.values)):
            held = held_by[layer]
            if held is None:
                held = tuple(mx.zeros((slots, *p.shape[1:]), dtype=p.dtype) for p in parts)
            held = tuple(grow_rows(h, slots) for h in held)
            for h, new in zip(held, parts, strict=True):
                h[at] = new
            held_by[layer] = held

    def read(self, layer: int, at: mx.array) -> tuple[mx.array, mx.array]:
        """Cold slots ``at`` (any shape) dequantized: ``(*at.shape, bs, H, D)`` K and V."""
        q = self.quant
        return (
            q.dequantize(tuple(x[at] for x in self.keys[layer])),
            q.dequantize(tuple(x[at] for x in self.values[layer])),
        )

    def adopt(self, layer: int, keys: Quantized, values: Quantized) -> None:
        """Install existing arrays (every cold slot) for a layer, e.g. from a saved cache."""
        self.keys[layer], self.values[layer] = keys, values

    def layer_bytes_per_block(self, layer: int) -> int:
        """Bytes one cold block takes in one layer (0 before its first block)."""
        if self.keys[layer] is None:
            return 0
        parts = (*self.keys[layer], *self.values[layer])
        return sum(x.nbytes // max(x.shape[0], 1) for x in parts)

    def bytes_per_block(self) -> int:
        """Bytes one cold block takes over every layer."""
        return sum(self.layer_bytes_per_block(layer) for layer in range(len(self.keys)))


class TierPlan:
    """Where ``read_tiered`` finds each block of ``B`` equal-length rows of ids.

    ``cold_ids`` ``(B, C)`` are cold slots of the first ``C`` columns (up to the
    last column holding a cold block); ``hot_slots`` the pool slots of the hot
    gather: every column or, when exactly the first ``C`` of every row are
    cold, the rest. ``mask`` ``(B, 1, C * block_size, 1)`` picks the cold
    tokens, or is ``None`` in that second case.
    """

    def __init__(self, rows: list[list[int]], block_size: int):
        cols = max((j + 1 for r in rows for j, b in enumerate(r) if is_cold(b)), default=0)
        cold = [[is_cold(b) for b in r[:cols]] for r in rows]
        self.cold_ids = mx.array([[b - COLD if is_cold(b) else 0 for b in r[:cols]] for r in rows])
        prefix = all(all(c) for c in cold)
        hot = [[b if 0 <= b < COLD else 0 for b in (r[cols:] if prefix else r)] for r in rows]
        ids = mx.array(hot, dtype=mx.int32)
        slots = ids[:, :, None] * block_size + mx.arange(block_size, dtype=mx.int32)
        self.hot_slots = slots.reshape(len(rows), -1)
        self.mask = None
        if not prefix:
            picks = mx.array(cold, dtype=mx.bool_)[:, None, :, None]  # (B, 1, C, 1)
            self.mask = mx.repeat(picks, block_size, axis=2)

    @classmethod
    def of_ids(cls, ids: mx.array, block_size: int) -> TierPlan:
        """The plan of ``(B, width)`` block ids on the device, every column picked by the
        mask (no host rows: a compiled step's tables are arrays)."""
        self = cls.__new__(cls)
        cold = ids >= COLD
        self.cold_ids = mx.where(cold, ids - COLD, 0)
        hot = mx.where(cold, 0, ids)
        slots = hot[:, :, None] * block_size + mx.arange(block_size, dtype=hot.dtype)
        self.hot_slots = slots.reshape(ids.shape[0], -1)
        self.mask = mx.repeat(cold[:, None, :, None], block_size, axis=2)
        return self


def read_tiered(
    keys: mx.array,
    values: mx.array,
    cold: ColdStore,
    layer: int,
    plan: TierPlan,
    dtype: mx.Dtype,
) -> tuple[mx.array, mx.array]:
    """``(B, H, width * block_size, D)`` K and V of a plan's blocks, in ``dtype``.

    ``keys``/``values`` are the layer's hot pool arrays; ``cold`` its group's
    quantized blocks.
    """
    hot_kv = take_blocks(keys, values, plan.hot_slots)
    cold_kv = cold.read(layer, plan.cold_ids)  # (B, C, bs, H, D) each
    out = []
    for hot, frozen in zip(hot_kv, cold_kv, strict=True):
        b, c, bs, h, d = frozen.shape
        frozen = frozen.transpose(0, 3, 1, 2, 4).reshape(b, h, c * bs, d).astype(dtype)
        hot = hot.astype(dtype)
        if plan.mask is None:  # exactly the first C blocks of every row are cold
            out.append(mx.concatenate([frozen, hot], axis=2))
        else:
            head = mx.where(plan.mask, frozen, hot[:, :, : c * bs])
            out.append(mx.concatenate([head, hot[:, :, c * bs :]], axis=2))
    return out[0], out[1]


def grow_rows(x: mx.array | None, rows: int) -> mx.array | None:
    """``x`` with zero rows appended up to ``rows`` (``None`` stays ``None``)."""
    if x is None or x.shape[0] >= rows:
        return x
    return mx.concatenate([x, mx.zeros((rows - x.shape[0], *x.shape[1:]), dtype=x.dtype)])
