"""The portable block read: a layer's tokens from the pool as contiguous K/V, in MLX ops.

Every device block-read kernel (``mlx_paged.attention.kernels.read``) must match
it byte for byte.
"""

from __future__ import annotations

import mlx.core as mx


def take_slots(pool: mx.array, slots: mx.array) -> mx.array:
    """Contiguous ``(B, H, T, D)``: the pool rows at ``(B, T)`` slots, with portable MLX ops."""
    nb, bs, h, d = pool.shape
    B, T = slots.shape
    by_head = pool.reshape(nb * bs, h, d).swapaxes(0, 1)  # (H, slots, D), a view
    # Gathering along the slot axis writes a contiguous (H, B, T, D): SDPA is several
    # times slower on strided K/V.
    x = mx.take(by_head, slots, axis=1)
    return x.reshape(1, h, T, d) if B == 1 else mx.contiguous(x.swapaxes(0, 1))


def take_blocks(keys: mx.array, values: mx.array, slots: mx.array) -> tuple[mx.array, mx.array]:
    """The portable read of K and V, which the kernels must match exactly."""
    return take_slots(keys, slots), take_slots(values, slots)
