"""A saved ``PagedKVCache`` layer (its ``state``) restored into a private pool."""

from __future__ import annotations

import mlx.core as mx

from ..blocks import COLD, HOLE, BlockTable, is_cold
from ..storage import KVPool, check_kv_quant


def restore_layer(state: tuple) -> tuple[KVPool, BlockTable, int | None]:
    """A private one-layer pool and table holding a saved layer's blocks, and its window."""
    keys, values, blocks, first, offset, window, block_size, dtype = state[:8]
    cold = state[8:14]
    quant = check_kv_quant(*(int(x) for x in state[14:17])) if cold else None
    pool = KVPool(1, int(block_size), None, None, quant)
    table = pool.new_table()
    table.first = int(first)
    table.lengths[0] = int(offset)
    ids = blocks.tolist() if blocks is not None and blocks.size else []
    hot = [b for b in ids if b != HOLE and not is_cold(b)]
    frozen = [b - COLD for b in ids if is_cold(b)]
    if keys is not None and (hot or frozen):
        new_hot = iter(pool.blocks.allocate(len(hot)))
        new_cold = iter(c + COLD for c in pool.blocks.cold.allocate(len(frozen)))
        table.blocks.extend(
            HOLE if b == HOLE else next(new_cold if is_cold(b) else new_hot) for b in ids
        )
        idx = mx.array(hot, dtype=mx.int32)
        pool.adopt_layer(0, keys[idx], values[idx], getattr(mx, dtype))
        if frozen:
            at = mx.array(frozen, dtype=mx.int32)
            pool.adopt_cold(0, tuple(x[at] for x in cold[:3]), tuple(x[at] for x in cold[3:]))
    return pool, table, None if window is None else int(window)
