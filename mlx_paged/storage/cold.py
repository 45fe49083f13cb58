"""The cold tier's arrays: quantized blocks of a layer group, and reads that mix both tiers.

A ``ColdStore`` holds K and V of every cold slot of every layer of its group in
MLX's affine format: packed values, scales and biases, each one array
``[layers, cold_blocks, block_size, n_kv_heads, ...]``. A decode step hands the
kernels these six arrays, whatever the number of layers, and each layer's
launch reads its own rows at an offset: every array a step's graph holds costs
the host time to walk and replay (BENCHMARKS.md, run 443). ``TierPlan`` and
``read_tiered`` read rows of block ids whose blocks lie in either tier: hot
ones gathered as ``take_blocks`` does, cold ones dequantized.
"""

from __future__ import annotations

import mlx.core as mx

from ..blocks import COLD, is_cold
from .quant import KVQuant
from .read import take_blocks

#: K or V of cold blocks: packed values, scales and biases.
Quantized = tuple[mx.array, mx.array, mx.array]


class ColdStore:
    """The quantized blocks of one layer group.

    Layers whose cold parts share shapes and dtypes share a stack: ``keys`` holds
    K's (packed values, scales, biases) of stack ``s`` at ``keys[3 * s : 3 * s + 3]``,
    each ``(layers of the stack, slots, block_size, n_kv_heads, ...)``, and ``values``
    V's alike; ``where[layer]`` is a layer's ``(stack, index in it)``, ``None`` before
    its first cold block. Both lists are only ever updated in place (a compiled decode
    step takes them as its inputs).

    Args:
        num_layers: Layers in the group.
        quant: Bits, group size and hot tail.
    """

    def __init__(self, num_layers: int, quant: KVQuant):
        self.quant = quant
        self.num_layers = num_layers
        self.keys: list[mx.array] = []
        self.values: list[mx.array] = []
        self.where: list[tuple[int, int] | None] = [None] * num_layers

    def store(self, layer: int, keys: mx.array, values: mx.array, at: mx.array, slots: int) -> None:
        """Quantize ``(n, bs, H, D)`` K and V into cold slots ``at`` of a tier of ``slots``."""
        self.write(layer, self.quant.quantize(keys), self.quant.quantize(values), at, slots)

    def store_blocks(
        self,
        keys: list[mx.array | None],
        values: list[mx.array | None],
        at: mx.array,
        to: mx.array,
        slots: int,
    ) -> None:
        """Quantize blocks ``at`` of each layer's full-precision ``keys``/``values``
        (``None``: a layer never written) into cold slots ``to`` of a tier of ``slots``:
        every layer in one write where they share shapes and dtypes."""
        shapes = {
            None if k is None else (k.shape, v.shape, k.dtype)
            for k, v in zip(keys, values, strict=True)
        }
        if None not in shapes and len(shapes) == 1:
            k, v = mx.stack([x[at] for x in keys]), mx.stack([x[at] for x in values])
            self.store_layers(k, v, to, slots)
            return
        for layer, (k, v) in enumerate(zip(keys, values, strict=True)):
            if k is not None:
                self.store(layer, k[at], v[at], to, slots)

    def store_layers(self, keys: mx.array, values: mx.array, at: mx.array, slots: int) -> None:
        """Quantize every layer's ``(num_layers, n, bs, H, D)`` K and V into cold slots
        ``at`` of a tier of ``slots``: one quantization and one write per array when the
        layers make one stack in order (the usual case), else layer by layer."""
        k, v = self.quant.quantize(keys), self.quant.quantize(values)
        if not self.keys:
            self._stack_all([x[0] for x in k], [x[0] for x in v], slots)
        if self.where != [(0, layer) for layer in range(self.num_layers)]:
            for layer in range(self.num_layers):
                parts = [tuple(x[layer] for x in q) for q in (k, v)]
                self.write(layer, *parts, at, slots)
            return
        self._grow(slots)
        for held, parts in ((self.keys, k), (self.values, v)):
            for i, new in enumerate(parts):
                held[i][:, at] = new

    def write(
        self, layer: int, keys: Quantized, values: Quantized, at: mx.array, slots: int
    ) -> None:
        """Put one layer's quantized ``(n, bs, H, ...)`` K and V parts into cold slots
        ``at`` of a tier of ``slots`` (e.g. blocks read back from disk)."""
        s, i = self._place(layer, keys, values, slots)
        for held, parts in ((self.keys, keys), (self.values, values)):
            for j, new in enumerate(parts):
                held[3 * s + j][i, at] = new

    def write_layers(
        self, layers: list[tuple[Quantized, Quantized]], at: mx.array, slots: int
    ) -> None:
        """Put each layer's quantized ``(n, bs, H, ...)`` K and V parts into cold slots
        ``at`` of a tier of ``slots``; into a fresh store whose layers share their parts'
        shapes, as one stack made at once (not grown a layer at a time)."""
        first = _signature(*layers[0][0], *layers[0][1])
        if not self.keys and all(_signature(*k, *v) == first for k, v in layers):
            self._stack_all(*layers[0], slots)
        for layer, (k, v) in enumerate(layers):
            self.write(layer, k, v, at, slots)

    def read(self, layer: int, at: mx.array) -> tuple[mx.array, mx.array]:
        """Cold slots ``at`` (any shape) dequantized: ``(*at.shape, bs, H, D)`` K and V."""
        k, v, i = self.stack(layer)
        q = self.quant
        return q.dequantize(tuple(x[i, at] for x in k)), q.dequantize(tuple(x[i, at] for x in v))

    def stack(self, layer: int) -> tuple[Quantized, Quantized, int]:
        """The K and V parts of a layer's stack, and the layer's index in it (the layer
        must hold cold blocks)."""
        s, i = self.where[layer]
        return tuple(self.keys[3 * s : 3 * s + 3]), tuple(self.values[3 * s : 3 * s + 3]), i

    def layer_parts(self, layer: int) -> tuple[Quantized, Quantized] | None:
        """One layer's K and V parts, each ``(slots, bs, H, ...)``; ``None`` before its
        first cold block."""
        if self.where[layer] is None:
            return None
        k, v, i = self.stack(layer)
        return tuple(x[i] for x in k), tuple(x[i] for x in v)

    def adopt(self, layer: int, keys: Quantized, values: Quantized) -> None:
        """Install a layer's existing arrays (every cold slot), e.g. from a saved cache."""
        slots = keys[0].shape[0]
        s, i = self._place(layer, keys, values, slots)
        if self.keys[3 * s].shape[1] != slots:
            raise ValueError(f"expected {self.keys[3 * s].shape[1]} cold blocks, got {slots}.")
        for held, parts in ((self.keys, keys), (self.values, values)):
            for j, new in enumerate(parts):
                held[3 * s + j][i] = new

    def layer_bytes_per_block(self, layer: int) -> int:
        """Bytes one cold block takes in one layer (0 before its first cold block)."""
        if self.where[layer] is None:
            return 0
        k, v, _ = self.stack(layer)
        return sum(x.nbytes // max(x.shape[0] * x.shape[1], 1) for x in (*k, *v))

    def bytes_per_block(self) -> int:
        """Bytes one cold block takes over every layer."""
        return sum(self.layer_bytes_per_block(layer) for layer in range(self.num_layers))

    def _place(self, layer: int, keys: Quantized, values: Quantized, slots: int) -> tuple[int, int]:
        """A layer's ``(stack, index)``: on its first write a new row of the stack of its
        parts' shapes and dtypes (or a new stack); every stack grown to ``slots``."""
        if self.where[layer] is None:
            sig = _signature(*keys, *values)
            stacks = range(len(self.keys) // 3)
            same = [s for s in stacks if self._stack_signature(s) == sig]
            if same:
                s = same[0]
                self.where[layer] = (s, self.keys[3 * s].shape[0])
                for held in (self.keys, self.values):
                    held[3 * s : 3 * s + 3] = [
                        grow_rows(x, x.shape[0] + 1) for x in held[3 * s : 3 * s + 3]
                    ]
            else:
                self.where[layer] = (len(stacks), 0)
                self._new_stack([x[None] for x in keys], [x[None] for x in values], slots, 1)
        self._grow(slots)
        return self.where[layer]

    def _stack_signature(self, s: int) -> list[tuple]:
        """Stack ``s``'s parts' shapes past ``(layers, slots)``, and dtypes."""
        parts = (*self.keys[3 * s : 3 * s + 3], *self.values[3 * s : 3 * s + 3])
        return [(x.shape[2:], x.dtype) for x in parts]

    def _stack_all(self, keys: Quantized, values: Quantized, slots: int) -> None:
        """Make one stack for every layer, each layer's parts like ``(n, bs, H, ...)``
        ``keys`` and ``values``."""
        self._new_stack([x[None] for x in keys], [x[None] for x in values], slots, self.num_layers)
        self.where = [(0, layer) for layer in range(self.num_layers)]

    def _new_stack(self, keys: Quantized, values: Quantized, slots: int, layers: int) -> None:
        """Append a zero-filled stack of ``layers`` for parts like ``(layers, n, ...)``."""
        for held, parts in ((self.keys, keys), (self.values, values)):
            held += [mx.zeros((layers, slots, *x.shape[2:]), dtype=x.dtype) for x in parts]

    def _grow(self, slots: int) -> None:
        """Every stack with zero-filled slots up to ``slots``."""
        for held in (self.keys, self.values):
            if held and held[0].shape[1] < slots:
                held[:] = [grow_rows(x, slots, axis=1) for x in held]


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


def _signature(*parts: mx.array) -> list[tuple]:
    """Parts' shapes past their first axis, and dtypes: what a stack's rows share."""
    return [(x.shape[1:], x.dtype) for x in parts]


def grow_rows(x: mx.array | None, rows: int, axis: int = 0) -> mx.array | None:
    """``x`` with zero rows appended along ``axis`` up to ``rows`` (``None`` stays ``None``)."""
    if x is None or x.shape[axis] >= rows:
        return x
    shape = list(x.shape)
    shape[axis] = rows - x.shape[axis]
    return mx.concatenate([x, mx.zeros(shape, dtype=x.dtype)], axis=axis)
