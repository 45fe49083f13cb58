"""A ``PagedKVCache`` layer as code written for mlx-lm's dense buffers sees it: its
``state`` (saved, and restored into a private pool) and its ``keys`` and ``values``."""

from __future__ import annotations

import mlx.core as mx

from ..blocks import COLD, HOLE, BlockTable, is_cold
from ..storage import KVPool, check_kv_quant


class LayerBuffers:
    """``PagedKVCache``'s members that stand for mlx-lm's dense buffers, read from (and
    written to) the blocks. Expects ``pool``, ``table``, ``layer``, ``window``, ``offset``,
    ``empty()`` and ``gather_visible()`` of the subclass."""

    @property
    def state(self) -> tuple:
        """This layer's pool arrays, the sequence's blocks and scalars.

        Evaluating it forces pending writes without copying; ``from_state``
        keeps only this sequence's blocks.
        """
        p, t = self.pool, self.table
        dtype = p.input_dtypes[self.layer]
        state = (
            p.keys[self.layer],
            p.values[self.layer],
            mx.array(t.blocks, dtype=mx.int32),
            t.first,
            self.offset,
            self.window,
            p.block_size,
            None if dtype is None else str(dtype).rsplit(".", 1)[-1],
        )
        parts = None if p.cold is None else p.cold.layer_parts(self.layer)
        if parts is None:
            return state
        q = p.quant
        return (*state, *parts[0], *parts[1], q.bits, q.group_size, q.hot_tokens)

    def keys_and_values(self) -> tuple[mx.array, mx.array]:
        """This layer's retained K/V as contiguous ``(1, H, T, D)`` arrays."""
        return self.gather_visible()

    @property
    def keys(self) -> mx.array | None:
        """The retained keys, ``(1, H, T, D)``, read from the blocks (``None`` before a write)."""
        return None if self.empty() else self.gather_visible()[0]

    @keys.setter
    def keys(self, value: mx.array) -> None:
        self._assign("keys", value)

    @property
    def values(self) -> mx.array | None:
        """The retained values, ``(1, H, T, D)``, read from the blocks (``None`` before a write)."""
        return None if self.empty() else self.gather_visible()[1]

    @values.setter
    def values(self, value: mx.array) -> None:
        self._assign("values", value)

    def _assign(self, name: str, value: mx.array) -> None:
        """A model replacing the retained K or V (deepseek_v32's indexer zeroes its values)."""
        want = None if self.empty() else getattr(self, name).shape
        if not isinstance(value, mx.array) or value.shape != want:
            got = getattr(value, "shape", type(value).__name__)
            raise ValueError(
                f"a paged cache's {name} can only be replaced by an array of their shape {want}, "
                f"got {got}; the K/V lives in shared blocks."
            )
        self.pool.overwrite(self.table, self.layer, name, value)


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
