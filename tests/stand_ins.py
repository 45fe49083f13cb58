"""What a fused decode kernel does to the pool, in MLX ops, for tests of kernels that
store the step's K/V (``PagedView.new_keys``) on machines without one."""

from __future__ import annotations

import mlx.core as mx

from mlx_paged.attention import PagedView


def store_new_rows(view: PagedView) -> None:
    """What the CUDA kernel does first with ``FW``: each sequence's new K/V row into its slot
    (``view.keys`` is the pool's own array, updated in place)."""
    at = view.lengths - 1
    col = ((at - view.starts) // view.block_size)[:, None]
    blocks = mx.take_along_axis(view.block_tables, col, axis=1)[:, 0]
    slots = at % view.block_size
    view.keys[blocks, slots] = view.new_keys[:, :, 0]
    view.values[blocks, slots] = view.new_values[:, :, 0]
