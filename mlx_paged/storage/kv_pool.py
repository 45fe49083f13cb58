"""Per-layer K/V storage in blocks: the writes, the copy-on-write copy and the reads.

A ``KVPool`` serves one layer group (see ``mlx_paged.blocks.BlockTables``, whose
bookkeeping it inherits). Each layer has its own K and V arrays in layout A,
``[num_blocks, block_size, n_kv_heads, head_dim]``, created at the layer's
first write; K and V head dims may differ.

Each pool array has exactly one reference, held here, and every write replaces
it, so MLX can donate the buffer and update it in place instead of copying the
whole pool.

With a ``KVQuant``, the pool also has a cold tier (``mlx_paged.blocks.tiers``):
full blocks behind a sequence's hot tail are quantized per block (packed values,
scales and biases per layer, ``[cold_blocks, block_size, n_kv_heads, ...]``)
and their hot blocks go back to the pool. Reads dequantize cold blocks where
they lie; nothing writes them again.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import mlx.core as mx

from ..blocks import COLD, BlockTable
from .cold import TierPlan, read_tiered
from .read import take_blocks
from .runs import TokenRuns

#: A device read of pool slots: ``read(keys, values, slots)`` returns ``(B, H, T, D)``
#: K and V in the pool's dtype, or ``None`` to leave the read to ``take_blocks``.
Reader = Callable[[mx.array, mx.array, mx.array], "tuple[mx.array, mx.array] | None"]


class KVPool(TokenRuns):
    """K/V arrays for a layer group, on top of the group's block-table bookkeeping.

    Writes, copies, migration to the cold tier and reads of tokens; the arrays
    themselves are ``LayerArrays``' (arguments as there).
    """

    # ---- writes -----------------------------------------------------------

    def write_prefill(
        self, table: BlockTable, layer: int, keys: mx.array, values: mx.array
    ) -> None:
        """Write a chunk of K/V, ``(1, n_kv_heads, n_new, head_dim)``, at the layer's tail."""
        self.check_write(layer, keys, values)
        start = table.lengths[layer]
        n = keys.shape[2]
        if n == 0:
            return
        if n == 1:
            self.put(layer, *self.claim_slot(table, layer), keys, values)
            return
        if table.reserved_key != (table.version, start, start + n, self.blocks.shares):
            self.reserve(table, start, start + n)
        k = self.to_storage(keys[0].swapaxes(0, 1))  # (n, H, Dk)
        v = self.to_storage(values[0].swapaxes(0, 1))  # (n, H, Dv)
        ids, slots = self._write_index(table, start, n)
        self.keys[layer][ids, slots] = k
        self.values[layer][ids, slots] = v
        table.lengths[layer] = start + n

    def copy_block(self, src: int, dst: int) -> None:
        """Copy block ``src`` (either tier) into hot block ``dst``, every layer (copy-on-write).

        The copy is queued and made with the others queued before the arrays are next used
        (``flush_copies``): a burst of requests adopting a prefix that ends inside a block
        copies it once per request.
        """
        if src in self._copies:  # a queued copy's destination: its rows are not there yet
            self.flush_copies()
        self._copies[dst] = src

    # ---- the cold tier ----------------------------------------------------

    def maybe_migrate(self, tables: list[BlockTable]) -> int:
        """Quantize the blocks behind the tables' hot tails once one table has enough due;
        return how many moved.

        Call between steps (before a step's first write). Once any table has a batch
        due (``KVQuant.migrate_blocks``), every table's due blocks move with it: one
        pass re-points every table holding one, one quantization for all layers; the
        hot blocks go back to the pool. A migration's host work is mostly the same
        whatever it moves, so sequences of staggered lengths share one every batch
        of tokens instead of taking one each.
        """
        return self.migrate_due(tables)[0]

    def migrate_due(self, tables: list[BlockTable]) -> tuple[int, float]:
        """``maybe_migrate``, and how many tokens every table can then take, one a step,
        before a batch could be due (``steps_until_due``): 0 after a migration or before
        the first write, infinite without a cold tier."""
        q = self.quant
        if q is None:
            return 0, math.inf
        if self.keys[0] is None:
            return 0, 0
        steps = self.steps_until_due(tables, q.hot_tokens, q.migrate_blocks(self.block_size))
        if steps > 0:
            return 0, steps
        due = [b for t in tables for b in self.cold_candidates(t, q.hot_tokens)]
        moved = self.migrate(due)
        if moved:
            self._quantize(list(moved), [new - COLD for new in moved.values()])
        return len(moved), 0

    def tier_plan(self, rows: list[list[int]]) -> TierPlan:
        """How ``read_tiered`` reads these equal-length rows of block ids (both tiers)."""
        return TierPlan(rows, self.block_size)

    def read_tiered(self, layer: int, plan: TierPlan) -> tuple[mx.array, mx.array]:
        """``(B, H, width * block_size, D)`` K and V of the plan's blocks, in the input dtype.

        Hot blocks are gathered as ``take_blocks`` does; cold ones dequantized.
        """
        k, v = self.keys[layer], self.values[layer]
        return read_tiered(k, v, self.cold, layer, plan, self.input_dtypes[layer])

    def overwrite(self, table: BlockTable, layer: int, name: str, x: mx.array) -> None:
        """Replace a layer's retained ``"keys"`` or ``"values"`` with ``(1, H, T, D)`` ``x``.

        What a model assigning ``cache.keys`` means; shared blocks are copied first.
        """
        start, end = table.first * self.block_size, table.lengths[layer]
        self.reserve(table, start, end)
        ids, slots = self._write_index(table, start, end - start)
        getattr(self, name)[layer][ids, slots] = self.to_storage(x[0].swapaxes(0, 1))

    # ---- reads ------------------------------------------------------------

    def gather(
        self,
        table: BlockTable,
        layer: int,
        start: int,
        end: int,
        read: Reader | None = None,
        sinks: int = 0,
    ) -> tuple[mx.array, mx.array]:
        """Tokens ``[0, sinks)`` then ``[start, end)`` of one layer as ``(1, H, T, D)`` K and V.

        ``start`` must not precede the table's first retained block. ``read`` lets a
        device kernel copy (``fused_read``): worth it for a prefill chunk, whose
        attention reads these arrays, not for a decode step, whose fused kernel
        never evaluates them.
        """
        if self.has_cold(table):
            assert not sinks, "layers that keep sinks have no cold tier"
            bs = self.block_size
            lo, hi = start // bs, -(-end // bs)
            plan = table.derived(
                "tier_plan",
                (table.version, lo, hi),
                lambda: self.tier_plan([table.blocks[lo - table.first : hi - table.first]]),
            )
            k, v = self.read_tiered(layer, plan)
            return k[:, :, start - lo * bs : end - lo * bs], v[
                :, :, start - lo * bs : end - lo * bs
            ]
        slots = self._token_slots(table, start, end, sinks)  # (1, T)
        keys, values = self.keys[layer], self.values[layer]
        fetched = read(keys, values, slots) if read is not None else None
        k, v = fetched or take_blocks(keys, values, slots)
        dtype = self.input_dtypes[layer]
        return (k, v) if k.dtype == dtype else (k.astype(dtype), v.astype(dtype))

    def table_ids(self, table: BlockTable) -> mx.array:
        """The retained block ids of a table as an int32 array (cached until it changes)."""
        return self._block_ids(table, table.first, table.first + len(table.blocks))

    def gather_visible(self, table: BlockTable, layer: int) -> tuple[mx.array, mx.array]:
        """Every retained token of one layer: the bytes the dense cache would hold."""
        return self.gather(table, layer, table.first * self.block_size, table.lengths[layer])

    # ---- internals --------------------------------------------------------

    def _write_index(self, table: BlockTable, start: int, n: int) -> tuple[mx.array, mx.array]:
        """(block id, offset) of tokens ``[start, start + n)``, shared by a step's layers."""

        def make() -> tuple[mx.array, mx.array]:
            bs = self.block_size
            lo, hi = start // bs, -(-(start + n) // bs)
            pos = mx.arange(start, start + n, dtype=mx.int32)
            return self._block_ids(table, lo, hi)[pos // bs - lo], pos % bs

        return table.derived("write_index", (table.version, start, n), make)

    def _token_slots(self, table: BlockTable, start: int, end: int, sinks: int = 0) -> mx.array:
        """``(1, T)`` pool slots of tokens ``[0, sinks)`` then ``[start, end)`` (memoized)."""
        bs = self.block_size
        assert start // bs >= table.first, f"tokens from {start} were already given back"

        def span(a: int, b: int) -> mx.array:
            lo, hi = a // bs, -(-b // bs)
            ids = self._block_ids(table, lo, hi)
            slots = (ids[:, None] * bs + mx.arange(bs, dtype=mx.int32)).reshape(-1)
            return slots[a - lo * bs : b - lo * bs]

        def make() -> mx.array:
            if not sinks:
                return span(start, end)[None]
            return mx.concatenate([span(0, sinks), span(start, end)])[None]

        return table.derived("slots", (table.version, start, end, sinks), make)

    def _block_ids(self, table: BlockTable, lo: int, hi: int) -> mx.array:
        """Block ids for logical blocks ``[lo, hi)``, reused while the table is unchanged."""
        return table.derived(
            "ids",
            (table.version, lo, hi),
            lambda: mx.array(table.blocks[lo - table.first : hi - table.first], dtype=mx.int32),
        )
