"""The cold tier's arrays: quantized blocks of a layer group, and reads that mix both tiers.

A ``ColdStore`` holds K and V of every cold slot of every layer of its group in
MLX's affine format: packed values, scales and biases. Each cold block of a
layer is one record of ``uint32`` words (``ColdLayout``), and the records of
every layer of a stack make one array ``(layers, cold_blocks, words)``. A decode
step hands the kernels that one array, whatever the number of layers, and each
layer's launch reads its own records at an offset: every input a launch takes
costs the host time to bind and replay (BENCHMARKS.md, runs 443 and 536).
``TierPlan`` and ``read_tiered`` read rows of block ids whose blocks lie in
either tier: hot ones gathered as ``take_blocks`` does, cold ones dequantized.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import mlx.core as mx

from ..blocks import COLD, is_cold
from .quant import KVQuant
from .read import take_blocks

#: K or V of cold blocks: packed values, scales and biases.
Quantized = tuple[mx.array, mx.array, mx.array]

#: Device kernels that quantize pool blocks of every layer straight into a stack's
#: records, tried in order by ``ColdStore.store_blocks``. Each is called as
#: ``storer(keys, values, at, to, records, layout, quant)``, with every layer's pool
#: arrays, ``(n,)`` int32 pool blocks and cold slots, and the ``(layers, slots, words)``
#: stack, and returns an array that must be evaluated before the records are read, or
#: ``None`` to decline. Each must write what ``ColdLayout.join`` of ``KVQuant.quantize``
#: writes; it may write into the stack in place, past MLX's graph, so a lazy read of the
#: stack must be evaluated before its slots are freed (the disk tier's spills are).
STORERS: list[Callable[..., mx.array | None]] = []


class ColdLayout(NamedTuple):
    """Where a cold block's parts lie in its record of ``uint32`` words.

    A record holds K's packed words ``(block_size, k_heads, k_words)``, then V's
    ``(block_size, v_heads, v_words)``, then in ``dtype`` K's scales and biases
    ``(block_size, k_heads, k_groups)`` each and V's ``(block_size, v_heads,
    v_groups)`` each, padded to a multiple of four words (16-byte records). The
    decode kernels compute the same offsets (``paged_decode.kernel``).
    """

    block_size: int
    k_heads: int
    k_words: int
    k_groups: int
    v_heads: int
    v_words: int
    v_groups: int
    dtype: mx.Dtype

    @classmethod
    def of(cls, keys: Quantized, values: Quantized) -> ColdLayout:
        """The layout of blocks whose parts are like ``(..., block_size, heads, x)``."""
        (kq, ks, _), (vq, vs, _) = keys, values
        return cls(*kq.shape[-3:], ks.shape[-1], *vq.shape[-2:], vs.shape[-1], ks.dtype)

    def _spans(self) -> tuple[list[tuple[int, tuple[int, ...]]], int, int]:
        """The parts' ``(size, shape)`` in record order, the words before the scales,
        and the record's words."""
        bs, hk, hv = self.block_size, self.k_heads, self.v_heads
        shapes = [
            (bs, hk, self.k_words),
            (bs, hv, self.v_words),
            (bs, hk, self.k_groups),
            (bs, hk, self.k_groups),
            (bs, hv, self.v_groups),
            (bs, hv, self.v_groups),
        ]
        spans = [(s[0] * s[1] * s[2], s) for s in shapes]
        packed = spans[0][0] + spans[1][0]
        scales = sum(n for n, _ in spans[2:]) * self.dtype.size // 4
        return spans, packed, (packed + scales + 3) // 4 * 4

    @classmethod
    def of_pool(cls, keys: mx.array, values: mx.array, quant: KVQuant) -> ColdLayout:
        """The layout ``quant`` gives blocks of pool arrays ``(..., block_size, heads, D)``."""
        bs, hk, dk = keys.shape[-3:]
        hv, dv = values.shape[-2:]
        bits, gs = quant.bits, quant.group_size
        return cls(bs, hk, dk * bits // 32, dk // gs, hv, dv * bits // 32, dv // gs, keys.dtype)

    @property
    def words(self) -> int:
        """``uint32`` words of one block's record."""
        return self._spans()[2]

    def split(self, records: mx.array) -> tuple[Quantized, Quantized]:
        """``(..., words)`` records as K's and V's ``(..., block_size, heads, x)`` parts."""
        spans, packed, words = self._spans()
        if records.dtype != mx.uint32 or records.shape[-1] != words:
            raise ValueError(
                f"cold records {records.shape} {records.dtype} for a layout of {words} "
                "uint32 words."
            )
        lead = records.shape[:-1]
        (nk, sk), (nv, sv) = spans[:2]
        kq = records[..., :nk].reshape(*lead, *sk)
        vq = records[..., nk:packed].reshape(*lead, *sv)
        n_scales = sum(n for n, _ in spans[2:])
        flat = records[..., packed:].view(self.dtype)[..., :n_scales]
        parts, at = [], 0
        for n, shape in spans[2:]:
            parts.append(flat[..., at : at + n].reshape(*lead, *shape))
            at += n
        return (kq, parts[0], parts[1]), (vq, parts[2], parts[3])

    def join(self, keys: Quantized, values: Quantized) -> mx.array:
        """K's and V's ``(..., block_size, heads, x)`` parts as ``(..., words)`` records."""
        _, packed, words = self._spans()
        lead = keys[0].shape[:-3]
        scales = [x.astype(self.dtype).reshape(*lead, -1) for x in (*keys[1:], *values[1:])]
        rows = [keys[0].reshape(*lead, -1), values[0].reshape(*lead, -1)]
        rows.append(mx.concatenate(scales, axis=-1).view(mx.uint32))
        pad = words - packed - rows[-1].shape[-1]
        if pad:
            rows.append(mx.zeros((*lead, pad), dtype=mx.uint32))
        return mx.concatenate(rows, axis=-1)


class ColdStore:
    """The quantized blocks of one layer group.

    Layers whose cold blocks share a layout share a stack: ``blobs[s]``, ``(layers
    of the stack, slots, layouts[s].words)`` ``uint32``, holds each layer's record
    of each cold slot; ``where[layer]`` is a layer's ``(stack, index in it)``,
    ``None`` before its first cold block. ``blobs`` is only ever updated in place
    (a compiled decode step takes it as an input).

    Args:
        num_layers: Layers in the group.
        quant: Bits, group size and hot tail.
    """

    def __init__(self, num_layers: int, quant: KVQuant):
        self.quant = quant
        self.num_layers = num_layers
        self.blobs: list[mx.array] = []
        self.layouts: list[ColdLayout] = []
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
    ) -> list[mx.array]:
        """Quantize blocks ``at`` of each layer's full-precision ``keys``/``values``
        (``None``: a layer never written) into cold slots ``to`` of a tier of ``slots``:
        every layer at once where they share shapes and dtypes, by an entry of
        ``STORERS`` where one takes the call. Returns what to evaluate before the
        records are read."""
        shapes = {
            None if k is None else (k.shape, v.shape, k.dtype)
            for k, v in zip(keys, values, strict=True)
        }
        if None not in shapes and len(shapes) == 1:
            layout = ColdLayout.of_pool(keys[0], values[0], self.quant)
            if self._one_stack(layout, slots):
                for storer in STORERS:
                    done = storer(keys, values, at, to, self.blobs[0], layout, self.quant)
                    if done is not None:
                        return [done]
            k, v = mx.stack([x[at] for x in keys]), mx.stack([x[at] for x in values])
            self.store_layers(k, v, to, slots)
            return self.blobs
        for layer, (k, v) in enumerate(zip(keys, values, strict=True)):
            if k is not None:
                self.store(layer, k[at], v[at], to, slots)
        return self.blobs

    def store_layers(self, keys: mx.array, values: mx.array, at: mx.array, slots: int) -> None:
        """Quantize every layer's ``(num_layers, n, bs, H, D)`` K and V into cold slots
        ``at`` of a tier of ``slots``: one quantization and one write when the layers
        make one stack in order (the usual case), else layer by layer."""
        k, v = self.quant.quantize(keys), self.quant.quantize(values)
        layout = ColdLayout.of(k, v)
        if not self.blobs:
            self._new_stack(layout, slots, self.num_layers)
            self.where = [(0, layer) for layer in range(self.num_layers)]
        if self.where != [(0, layer) for layer in range(self.num_layers)]:
            for layer in range(self.num_layers):
                parts = [tuple(x[layer] for x in q) for q in (k, v)]
                self.write(layer, *parts, at, slots)
            return
        self._grow(slots)
        self.blobs[0][:, at] = layout.join(k, v)

    def write(
        self, layer: int, keys: Quantized, values: Quantized, at: mx.array, slots: int
    ) -> None:
        """Put one layer's quantized ``(n, bs, H, ...)`` K and V parts into cold slots
        ``at`` of a tier of ``slots`` (e.g. blocks read back from disk)."""
        layout = ColdLayout.of(keys, values)
        s, i = self._place(layer, layout, slots)
        self.blobs[s][i, at] = layout.join(keys, values)

    def write_layers(
        self, layers: list[tuple[Quantized, Quantized]], at: mx.array, slots: int
    ) -> None:
        """Put each layer's quantized ``(n, bs, H, ...)`` K and V parts into cold slots
        ``at`` of a tier of ``slots``; into a fresh store whose layers share a layout,
        as one stack made at once (not grown a layer at a time)."""
        layouts = [ColdLayout.of(k, v) for k, v in layers]
        if not self.blobs and len(set(layouts)) == 1:
            self._new_stack(layouts[0], slots, self.num_layers)
            self.where = [(0, layer) for layer in range(self.num_layers)]
        for layer, (k, v) in enumerate(layers):
            self.write(layer, k, v, at, slots)

    def read(self, layer: int, at: mx.array) -> tuple[mx.array, mx.array]:
        """Cold slots ``at`` (any shape) dequantized: ``(*at.shape, bs, H, D)`` K and V."""
        k, v = self.parts(layer, at)
        return self.quant.dequantize(k), self.quant.dequantize(v)

    def parts(self, layer: int, at: mx.array) -> tuple[Quantized, Quantized]:
        """Cold slots ``at`` (any shape) of a layer as K's and V's quantized
        ``(*at.shape, bs, H, ...)`` parts (the layer must hold cold blocks)."""
        s, i = self.where[layer]
        return self.layouts[s].split(self.blobs[s][i, at])

    def layer_parts(self, layer: int) -> tuple[Quantized, Quantized] | None:
        """One layer's K and V parts, each ``(slots, bs, H, ...)``; ``None`` before its
        first cold block."""
        if self.where[layer] is None:
            return None
        s, i = self.where[layer]
        return self.layouts[s].split(self.blobs[s][i])

    def stack(self, layer: int) -> tuple[mx.array, ColdLayout, int]:
        """A layer's stack: its records, their layout, and the layer's index in it (the
        layer must hold cold blocks)."""
        s, i = self.where[layer]
        return self.blobs[s], self.layouts[s], i

    def adopt(self, layer: int, keys: Quantized, values: Quantized) -> None:
        """Install a layer's existing arrays (every cold slot), e.g. from a saved cache."""
        slots = keys[0].shape[0]
        layout = ColdLayout.of(keys, values)
        s, i = self._place(layer, layout, slots)
        if self.blobs[s].shape[1] != slots:
            raise ValueError(f"expected {self.blobs[s].shape[1]} cold blocks, got {slots}.")
        self.blobs[s][i] = layout.join(keys, values)

    def layer_bytes_per_block(self, layer: int) -> int:
        """Bytes one cold block takes in one layer (0 before its first cold block)."""
        if self.where[layer] is None:
            return 0
        return self.layouts[self.where[layer][0]].words * 4

    def bytes_per_block(self) -> int:
        """Bytes one cold block takes over every layer."""
        return sum(self.layer_bytes_per_block(layer) for layer in range(self.num_layers))

    def _place(self, layer: int, layout: ColdLayout, slots: int) -> tuple[int, int]:
        """A layer's ``(stack, index)``: on its first write a new row of the stack of its
        layout (or a new stack); every stack grown to ``slots``."""
        if self.where[layer] is None:
            if layout in self.layouts:
                s = self.layouts.index(layout)
                self.where[layer] = (s, self.blobs[s].shape[0])
                self.blobs[s] = grow_rows(self.blobs[s], self.blobs[s].shape[0] + 1)
            else:
                self.where[layer] = (len(self.blobs), 0)
                self._new_stack(layout, slots, 1)
        elif self.layouts[self.where[layer][0]] != layout:
            raise ValueError(f"cold blocks of layer {layer} in another layout: {layout}")
        self._grow(slots)
        return self.where[layer]

    def _one_stack(self, layout: ColdLayout, slots: int) -> bool:
        """Whether every layer's records are rows of one stack of ``layout``, in order, with
        ``slots`` slots (made so if the store is empty)."""
        if not self.blobs:
            self._new_stack(layout, slots, self.num_layers)
            self.where = [(0, layer) for layer in range(self.num_layers)]
        ordered = self.where == [(0, layer) for layer in range(self.num_layers)]
        if not ordered or self.layouts[0] != layout:
            return False
        self._grow(slots)
        return True

    def _new_stack(self, layout: ColdLayout, slots: int, layers: int) -> None:
        """Append a zero-filled stack of ``layers`` for blocks of ``layout``."""
        self.blobs.append(mx.zeros((layers, slots, layout.words), dtype=mx.uint32))
        self.layouts.append(layout)

    def _grow(self, slots: int) -> None:
        """Every stack with zero-filled slots up to ``slots``."""
        if any(x.shape[1] < slots for x in self.blobs):
            self.blobs[:] = [grow_rows(x, slots, axis=1) for x in self.blobs]


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


def grow_rows(x: mx.array | None, rows: int, axis: int = 0) -> mx.array | None:
    """``x`` with zero rows appended along ``axis`` up to ``rows`` (``None`` stays ``None``)."""
    if x is None or x.shape[axis] >= rows:
        return x
    shape = list(x.shape)
    shape[axis] = rows - x.shape[axis]
    return mx.concatenate([x, mx.zeros(shape, dtype=x.dtype)], axis=axis)
