"""Records the attention router, the kernels and the caches share.

A leaf module of the attention package (it imports only the storage's cold
layout), so kernels and caches can speak of a ``PagedView`` without importing the
router.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import NamedTuple

import mlx.core as mx

from ..storage.cold import ColdLayout


class ColdView(NamedTuple):
    """One layer's quantized blocks (mlx_paged's cold tier), in ``mx.quantize``'s format.

    ``blob`` ``(layers, cold_blocks, layout.words)`` ``uint32`` holds one record per
    cold block of every layer of a stack (``ColdLayout``: K's and V's packed values,
    scales and biases), of which this view reads layer ``layer``. A block table entry
    ``COLD + i`` (``mlx_paged.blocks.COLD``) names cold block ``i``.
    """

    blob: mx.array
    layout: ColdLayout
    bits: int
    group_size: int
    layer: int = 0

    def parts(self) -> tuple[tuple[mx.array, ...], tuple[mx.array, ...]]:
        """This layer's K and V (packed values, scales, biases), each
        ``(cold_blocks, block_size, n_kv_heads, ...)``."""
        return self.layout.split(self.blob[self.layer])

    def dequantized(self) -> tuple[mx.array, mx.array]:
        """This layer's cold blocks as ``(cold_blocks, block_size, n_kv_heads, D)`` K and V."""
        gs, bits = self.group_size, self.bits
        k, v = self.parts()
        return (
            mx.dequantize(*k, group_size=gs, bits=bits),
            mx.dequantize(*v, group_size=gs, bits=bits),
        )


class Rope(NamedTuple):
    """A layer's rotary position embedding, for a kernel that applies it itself.

    ``freqs`` ``(D / 2,)`` float32: each rotated pair's angle per position (mlx's
    ``scale`` over its wavelength); the pairs are ``(i, i + D / 2)`` of the whole head,
    or ``(2i, 2i + 1)`` with ``traditional``. ``apply`` is the layer's own RoPE, for every
    path that does not.
    """

    freqs: mx.array
    traditional: bool
    apply: Callable[[mx.array, mx.array], mx.array]  # (x, offset) -> rotated x


class PagedView(NamedTuple):
    """Where one layer's K/V lie in the blocks, for a batch of ``B`` sequences.

    The key at token position ``p`` of sequence ``b`` is
    ``keys[block_tables[b, (p - starts[b]) // block_size], p % block_size]``.
    A decode query of sequence ``b`` sits at position ``lengths[b] - 1`` and
    attends to positions ``max(starts[b], lengths[b] - window) .. lengths[b] - 1``
    (``window`` ``None`` means no limit). Rows of ``block_tables`` past a
    sequence's last block hold arbitrary ids and must not be read; caches pad
    the width to ``table_width(blocks)`` so kernels see few distinct shapes. Entries of
    ``COLD`` and above name blocks of ``cold`` (``None`` when no sequence of the
    batch holds one).

    With ``new_keys``/``new_values`` (``(B, n_kv_heads, 1, head_dim)`` in the pool's
    dtype) the step's own token is not in the pool yet: a kernel that takes the call
    stores those rows at position ``lengths[b] - 1`` and reads them there (only
    ``KERNELS`` entries whose ``writes`` is true are offered such a view). With ``rope``
    as well, the queries and ``new_keys`` are not rotated yet: the kernel rotates them to
    that position (only entries whose ``ropes`` is true take such a view).

    A named tuple: every layer of every decode step makes one, and a tuple is
    the cheapest immutable record to make.
    """

    keys: mx.array  # (num_blocks, block_size, n_kv_heads, k_head_dim)
    values: mx.array  # (num_blocks, block_size, n_kv_heads, v_head_dim)
    block_tables: mx.array  # (B, max_blocks) int32
    starts: mx.array  # (B,) int32, multiples of block_size
    lengths: mx.array  # (B,) int32
    window: int | None
    cold: ColdView | None = None
    new_keys: mx.array | None = None
    new_values: mx.array | None = None
    rope: Rope | None = None

    @property
    def block_size(self) -> int:
        return self.keys.shape[1]


class PrefillView(NamedTuple):
    """Where one layer's K/V lie for a batched prefill forward of ``B`` sequences.

    Query ``i`` of sequence ``b`` sits at position ``offsets[b] + i`` and sees the
    positions ``max(starts[b], offsets[b] + i - window + 1) .. min(offsets[b] + i,
    real - 1)``, where ``real = max(lengths[b], offsets[b] + 1)``: queries past a
    sequence's new tokens (right padding) see its real keys. Blocks are found as in
    ``PagedView``. The K/V of every position up to ``real`` are in the pool.
    """

    keys: mx.array  # (num_blocks, block_size, n_kv_heads, head_dim)
    values: mx.array  # (num_blocks, block_size, n_kv_heads, head_dim)
    block_tables: mx.array  # (B, max_blocks) int32
    starts: mx.array  # (B,) int32, multiples of block_size
    offsets: mx.array  # (B,) int32, position of each sequence's first query
    lengths: mx.array  # (B,) int32, offsets + real new tokens
    window: int | None

    @property
    def block_size(self) -> int:
        return self.keys.shape[1]


class Fetched:
    """Weak references to the K/V a paged cache last returned.

    Attention recognises the cache's own K/V by identity; holding them weakly
    keeps neither their buffers nor the pool arrays their lazy gather reads
    alive once the model is done with them.
    """

    __slots__ = ("_keys", "_values")

    def __init__(self, keys: mx.array, values: mx.array):
        self._keys, self._values = weakref.ref(keys), weakref.ref(values)

    def matches(self, keys: mx.array, values: mx.array) -> bool:
        """Whether ``keys`` and ``values`` are the very arrays recorded."""
        return self._keys() is keys and self._values() is values


class PagedLayerCache:
    """Base of the caches whose layers ``paged_attention`` serves.

    A subclass tells attention whether the K/V and mask it got are the cache's
    own (``fetched``) and where its blocks lie (``paged_view``).
    """

    def fetched(self, keys: mx.array, values: mx.array, mask: object) -> bool:
        """Whether attention got this layer's own K/V and mask, untouched by the model."""
        raise NotImplementedError

    def paged_view(self) -> PagedView:
        """Where this layer's K/V lie in the blocks, for fused kernels."""
        raise NotImplementedError

    def reads_in_place(self) -> bool:
        """Whether the last ``update_and_fetch`` returned views of the pool itself (blocks
        lying in one stretch), which MLX's own attention reads as a dense cache."""
        return False

    def prefill_view(self) -> PrefillView | None:
        """Where a batched prefill's K/V lie, for fused prefill kernels; ``None`` where the
        cache cannot describe its last forward that way."""
        return None

    def deferred_read(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array] | None:
        """The real K/V if ``keys``/``values`` are stand-ins this cache returned, else ``None``.

        A cache may return stand-ins (``stand_ins``) for a decode step's K/V while a
        fused kernel is expected to read the blocks itself (``routing.kernels_ready``);
        attention asks here before any other path reads them.
        """
        return None

    def kernel_stored(self, out: mx.array) -> None:
        """A kernel took the last decode step and stored its new K/V (``PagedView.new_keys``);
        ``out`` is its output. A cache whose arrays someone may read before ``out`` is
        evaluated makes those reads wait for it."""

    def rotated_queries(self, queries: mx.array) -> mx.array:
        """``queries`` as every path but a rotating kernel takes them: rotated by the layer's
        RoPE where its model left that to the kernel (``PagedView.rope``), else as they are."""
        return queries


def table_width(blocks: int) -> int:
    """The width of a ``PagedView.block_tables`` that holds ``blocks``.

    Every distinct width is another launch shape for the fused kernels (a trace
    and a compiled graph), so widths come in steps: up to 8 as they are, then 8
    per doubling (9, 10, .., 16, 18, .., 32, 36, ..). That pads at most 1/8 of a
    table, and a sequence growing from ``n`` to ``2n`` blocks meets 8 widths.
    """
    if blocks <= 8:
        return max(blocks, 1)
    step = 1 << (blocks - 1).bit_length() - 4  # 1/16 of the next power of two
    return -(-blocks // step) * step


def stand_ins(shape_k: tuple[int, ...], shape_v: tuple[int, ...], dtype: mx.Dtype):
    """Unevaluated arrays of K/V's shapes and dtype that hold no data of their own.

    What a cache returns for a decode step whose read it defers: attention
    recognises them by identity and a fused kernel reads the blocks instead.
    """
    zero = mx.zeros((1, 1, 1, 1), dtype=dtype)
    return mx.broadcast_to(zero, shape_k), mx.broadcast_to(zero, shape_v)
