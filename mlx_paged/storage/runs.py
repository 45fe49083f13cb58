"""One-token writes, and runs of consecutive blocks read as views of the pool.

A decode step writes one token per layer: ``claim_slot`` gives it a slot in a block the
table owns, and ``put`` (or a kernel that stores it, ``PagedView.new_keys``) writes it. A
sequence whose blocks are consecutive hot ids (a fresh sequence alone in its pool, as
``make_paged_cache`` gives) fills one stretch of each pool array: ``run_view`` and
``append_view`` hand attention strided views of it, which it reads in place as it reads
mlx-lm's dense buffer.
"""

from __future__ import annotations

import mlx.core as mx

from ..blocks import COLD, BlockTable
from .arrays import LayerArrays


class TokenRuns(LayerArrays):
    """A ``LayerArrays``' one-token writes and its reads of consecutive blocks as views
    (arguments as there)."""

    def claim_slot(self, table: BlockTable, layer: int) -> tuple[int, int]:
        """Count one more token of the layer and return its (block id, slot), the block the
        table's own: the write of a decode step, left to the caller (``put_token``, or a
        kernel that stores it, ``PagedView.new_keys``)."""
        start, bs = table.lengths[layer], self.block_size
        i = start // bs - table.first
        if i >= len(table.blocks) or self.blocks.is_shared(table.blocks[i]):  # usually ours
            self.reserve(table, start, start + 1)
        table.lengths[layer] = start + 1
        return table.blocks[start // bs - table.first], start % bs

    def put(self, layer: int, block: int, slot: int, keys: mx.array, values: mx.array) -> None:
        """Write one token's ``(1, H, 1, D)`` K/V at ``(block, slot)`` (``claim_slot``'s)."""
        put_token(self.keys[layer], block, slot, self.to_storage(keys))
        put_token(self.values[layer], block, slot, self.to_storage(values))

    def append(self, table: BlockTable, layer: int, keys: mx.array, values: mx.array) -> None:
        """Decode-step write of one token: ``(1, n_kv_heads, 1, head_dim)``."""
        if keys.ndim != 4 or keys.shape[2] != 1:
            raise ValueError(f"append writes one token, shape (1, H, 1, D); got {keys.shape}.")
        self.write_prefill(table, layer, keys, values)

    def append_view(
        self, table: BlockTable, layer: int, keys: mx.array, values: mx.array
    ) -> tuple[mx.array, mx.array] | None:
        """A one-token write at the layer's tail, then all its tokens as views of the pool.

        ``append`` then ``run_view`` in one call, for the common decode step of a
        sequence alone in its pool (``make_paged_cache``): the token's block is already
        the sequence's own, all its blocks are consecutive hot ids, the pool stores the
        model's dtype and the K/V shapes are those of the layer's last one-token write.
        Returns ``None``, having written nothing, where any of that does not hold.
        """
        if not self.passed_check(layer, keys, values):
            return None
        start, bs = table.lengths[layer], self.block_size
        i = start // bs
        run = (table.version, self.blocks.shares, i)
        first = table.derived("append_run", run, self._append_run, table, i)
        ks, vs = self.keys, self.values
        if first is None or ks[layer].dtype != keys.dtype:
            return None
        put_token(ks[layer], first + i, start % bs, keys)
        put_token(vs[layer], first + i, start % bs, values)
        end = table.lengths[layer] = start + 1
        return slot_view(ks[layer], first * bs, end), slot_view(vs[layer], first * bs, end)

    def _append_run(self, table: BlockTable, i: int) -> int | None:
        """``table``'s first block id if ``append_view`` may write its block ``i``: no block
        given back, block ``i`` reserved and its own, every block a consecutive hot id.
        (Memoized per table version and pool ``shares``: a block only becomes shared
        through a retain or a park, which count in ``shares``.)"""
        if table.first or self.quant is not None or i >= len(table.blocks):
            return None
        if self.blocks.is_shared(table.blocks[i]):
            return None
        return consecutive_start(table.blocks)

    def run_view(
        self, table: BlockTable, layer: int, start: int, end: int
    ) -> tuple[mx.array, mx.array] | None:
        """Tokens ``[start, end)`` of one layer as ``(1, H, T, D)`` views of the pool, or ``None``.

        Only where their blocks are consecutive hot ids and the pool stores the layer's
        input dtype (a fresh sequence in its own pool, as ``make_paged_cache`` gives):
        then they fill one stretch of each pool array, and attention reads it in place,
        as it reads mlx-lm's dense buffer. No gather, no copy, no custom kernel.
        """
        bs = self.block_size
        lo, hi = start // bs - table.first, -(-end // bs) - table.first
        first = table.derived(
            "run", (table.version, lo, hi), lambda: consecutive_start(table.blocks[lo:hi])
        )
        keys, values = self.keys[layer], self.values[layer]
        if first is None or keys.dtype != self.input_dtypes[layer]:
            return None
        at = first * bs + start % bs
        return slot_view(keys, at, end - start), slot_view(values, at, end - start)


def consecutive_start(ids: list[int]) -> int | None:
    """``ids[0]`` if ``ids`` are consecutive hot block ids, else ``None``."""
    if not ids or ids[0] < 0 or ids[-1] >= COLD:
        return None
    first = ids[0]
    return first if ids == list(range(first, first + len(ids))) else None


def put_token(pool: mx.array, block: int, slot: int, x: mx.array) -> None:
    """Write one token's ``(1, H, 1, D)`` K or V into ``pool[block, slot]`` in place.

    Python slices make a static slice update, which MLX does in place (an index array,
    ``mx.slice_update``, made a dynamic one that copied the pool), and slices of the
    update's own shape leave no broadcast in the step's graph.
    """
    pool[block : block + 1, slot : slot + 1] = x.reshape(1, 1, x.shape[1], -1)


def slot_view(pool: mx.array, slot: int, n: int) -> mx.array:
    """Flat slots ``[slot, slot + n)`` of a row-contiguous ``[blocks, block_size, H, D]`` pool
    array as a ``(1, H, n, D)`` view (head stride ``D``, token stride ``H * D``)."""
    h, d = pool.shape[2], pool.shape[3]
    return mx.as_strided(pool, (1, h, n, d), (n * h * d, d, h * d, 1), slot * h * d)
