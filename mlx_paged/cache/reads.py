"""Where one sequence's layer reads in a ``KVPool``: the first token a sliding window
reads and its mask, the blocks as a fused kernel's ``PagedView``, and the stand-ins a
deferred read returns. The layers of a step share what they can through the table
(``BlockTable.derived``)."""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask

from ..attention import ColdView, PagedView, stand_ins
from ..blocks import BlockTable
from ..storage import KVPool
from .batch import pad_tables


def read_start(offset: int, window: int | None, block_size: int) -> int:
    """First token a layer with ``window`` reads for queries from ``offset``: the start of
    the block holding the oldest key they see."""
    if window is None:
        return 0
    oldest = max(0, offset - window + 1)
    return oldest - oldest % block_size


def window_mask(
    n: int, offset: int, window: int, block_size: int, window_size: int | None, as_array: bool
) -> mx.array | str | None:
    """A sliding layer's mask for ``n`` queries from ``offset`` against the keys it reads
    (from the start of the block holding the oldest key they see)."""
    # A wider window sees no more: the layer holds no keys older than its own.
    seen = min(window_size or window, window)
    before = offset - read_start(offset, window, block_size)  # keys older than the queries
    if not as_array and before + n <= seen:
        return None if n == 1 else "causal"
    return create_causal_mask(n, before, window_size=seen)


def paged_view(
    p: KVPool,
    t: BlockTable,
    layer: int,
    offset: int,
    window: int | None,
    new: tuple[mx.array, mx.array] | tuple[None, None] = (None, None),
) -> PagedView:
    """One layer of one sequence as a ``PagedView`` of the pool (a kernel's input), with
    ``new`` the step's K/V for the kernel to store (``PagedView.new_keys``)."""
    block_tables, starts, lengths = view_arrays(p, t, offset)
    cold = p.cold_arrays(layer) if p.has_cold(t) else None
    return PagedView(
        p.keys[layer],
        p.values[layer],
        block_tables,
        starts,
        lengths,
        window,
        None if cold is None else ColdView(*cold),
        *new,
    )


def view_arrays(pool: KVPool, table: BlockTable, offset: int) -> tuple[mx.array, ...]:
    """A one-sequence view's block table (padded, ``pad_tables``), start and length; the
    layers of a step share them, and the steps between two table changes the first two."""
    ids, starts = table.derived(
        "view",
        (table.version, table.first, len(table.blocks)),
        lambda: (
            pad_tables(pool.table_ids(table)[None]),
            mx.array([table.first * pool.block_size], dtype=mx.int32),
        ),
    )
    return ids, starts, table.derived("view_length", offset, _length, offset)


def _length(offset: int) -> mx.array:
    return mx.array([offset], dtype=mx.int32)


def table_stand_ins(table: BlockTable, shapes: tuple, dtype: mx.Dtype) -> tuple[mx.array, mx.array]:
    """Stand-ins of ``shapes`` for a deferred read, made once per step for the table's layers."""
    return table.derived("stand_ins", (*shapes, dtype), lambda: stand_ins(*shapes, dtype))
