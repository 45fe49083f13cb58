"""Batched steps over block tables: ``n`` new tokens per sequence, no padding in storage.

``DecodeBatch`` describes, for one layer group, where the new tokens of each
sequence go and which blocks their queries read (``n = 1`` for decode; equal
suffixes of newly admitted requests are prefilled together the same way).
``StepPagedKVCache`` (``step.py``) is one layer's view of it in mlx-lm's cache protocol, so
the model runs one
forward over every running sequence with per-sequence offsets (array rope
offsets) and lengths. Sequences join and leave between steps without anyone's
K/V moving: only the small block-table arrays are rebuilt.
"""

from __future__ import annotations

from functools import cached_property

import mlx.core as mx
import numpy as np

from ..attention import (
    stand_ins,
    table_width,
)
from ..blocks import BlockTable
from ..storage import KVPool, TierPlan


class DecodeBatch:
    """One step of ``B`` sequences in one layer group, ``n_new`` query tokens each.

    Every table must already hold private blocks for its new tokens
    (``KVPool.reserve``). ``counts`` gives how many of a sequence's ``n_new``
    tokens are real; the rest are right padding, whose K/V is never stored and
    whose queries see only real keys (their outputs are meaningless).

    Args:
        pool: The group's storage.
        tables: One per sequence, in batch order.
        window: The group's sliding window, or ``None``.
        n_new: Query tokens per sequence.
        offsets: Position of each sequence's first new token (default: what
            layer 0 of its table has written).
        counts: Real new tokens per sequence (default: ``n_new`` each).
    """

    #: How many arrays ``arrays()`` gives and ``of_arrays`` takes.
    STEP_ARRAYS = 4

    def __init__(
        self,
        pool: KVPool,
        tables: list[BlockTable],
        window: int | None,
        n_new: int = 1,
        offsets: list[int] | None = None,
        counts: list[int] | None = None,
    ):
        bs = self.block_size = pool.block_size
        self.tables, self.n_new = tables, n_new
        lengths = offsets if offsets is not None else [t.lengths[0] for t in tables]
        if counts is None and n_new == 1:  # a decode step: the common case, kept lean
            spans, starts, ids = _one_token_rows(tables, lengths, window, bs)
            self.new_tokens, self.padded, self.write_rows = [1] * len(tables), False, None
            self.counts = mx.array(self.new_tokens, dtype=mx.int32)
            self.write_ids = mx.array(np.array(ids, dtype=np.int32).reshape(-1, 1))  # (B, 1)
        else:
            counts = counts if counts is not None else [n_new] * len(tables)
            spans, starts = self._rows(tables, lengths, counts, window)
        self._spans = spans  # each row's table and the blocks [lo, hi) its queries read
        width = max(hi - lo for _, lo, hi in spans)
        self.has_cold = any(map(pool.has_cold, tables))
        self._plan: TierPlan | None = None
        self._pool = pool
        self.starts = mx.array(starts, dtype=mx.int32)  # (B,)
        self.offset = mx.array(lengths, dtype=mx.int32)  # (B,) position of the first new token
        self.lengths = self.offset + self.counts
        self.width = width * bs
        self.masks: dict[int | None, mx.array] = {}
        self._slots: mx.array | None = None
        self._stand_ins: dict[tuple, tuple[mx.array, mx.array]] = {}
        self._view_tables: mx.array | None = None

    def _rows(
        self, tables: list[BlockTable], lengths: list[int], counts: list[int], window: int | None
    ) -> tuple[list[tuple[BlockTable, int, int]], list[int]]:
        """Each row's span and first position, for any step; sets the new tokens' writes."""
        bs, n_new = self.block_size, self.n_new
        spans, starts, write_ids, write_rows = [], [], [], []
        for i, (t, n, c) in enumerate(zip(tables, lengths, counts, strict=True)):
            start = t.first if window is None else max(0, n - window + 1) // bs
            assert start >= t.first, f"block {start} was given back before the query read it"
            last = (n + max(c, 1) - 1) // bs
            lo = start - t.first
            spans.append((t, lo, max(lo, min(last - t.first + 1, len(t.blocks)))))
            starts.append(start * bs)
            write_ids.append([t.blocks[p // bs - t.first] for p in range(n, n + c)])
            write_rows.extend(range(i * n_new, i * n_new + c))
        self.new_tokens = counts  # real new tokens per sequence
        self.counts = mx.array(counts, dtype=mx.int32)  # (B,)
        self.padded = any(c != n_new for c in counts)
        if self.padded:  # flat (M,) indices of the real tokens
            self.write_rows = mx.array(write_rows, dtype=mx.int32)  # into (B * n_new)
            self.write_ids = mx.array([b for ids in write_ids for b in ids], dtype=mx.int32)
            pos = [p for n, c in zip(lengths, counts, strict=True) for p in range(n, n + c)]
            self.write_slots = mx.array(pos, dtype=mx.int32) % bs
        else:  # write_slots (B, n_new) made when first read
            self.write_rows = None
            self.write_ids = mx.array(write_ids, dtype=mx.int32)  # (B, n_new)
        return spans, starts

    @cached_property
    def block_tables(self) -> mx.array:
        """``(B, width)`` block ids each row's queries read, each row padded with its last
        id (the mask, and the kernels by ``lengths``, ignore them)."""
        return self._table_rows(self.width // self.block_size, "row")

    def _table_rows(self, cols: int, name: str) -> mx.array:
        """``(B, cols)`` int32 block ids of the rows, each padded on the right with its last
        id (0 for a row of none). A table keeps its row under ``name`` until it changes: most
        gain a block only every ``block_size`` steps, and a long row is slow to convert each
        step (BENCHMARKS.md, "A step's block tables kept")."""
        rows = [
            t.derived(
                name, (t.version, t.first, len(t.blocks), lo, hi, cols), _row, t, lo, hi, cols
            )
            for t, lo, hi in self._spans
        ]
        return mx.array(np.frombuffer(b"".join(rows), dtype=np.int32).reshape(len(rows), cols))

    @cached_property
    def write_slots(self) -> mx.array:
        """``(B, n_new)`` slots in their blocks of the new tokens (of an unpadded step)."""
        return (self.offset[:, None] + mx.arange(self.n_new)[None]) % self.block_size

    def arrays(self, width: int | None = None) -> list[mx.array]:
        """What ``of_arrays`` rebuilds a decode step from (``n_new`` 1, no padding): the
        block tables padded to the kernels' width or to ``width``, starts, offsets, and the
        new tokens' blocks (their slots follow from the offsets)."""
        assert self.n_new == 1 and not self.padded, "only an unpadded decode step"
        return [self._padded_tables(width), self.starts, self.offset, self.write_ids]

    @classmethod
    def of_arrays(cls, pool: KVPool, arrays: list[mx.array], has_cold: bool = False) -> DecodeBatch:
        """A decode step of ``arrays()``, made of arrays alone (inside ``mx.compile``: the
        step's Python runs once per shape); its tables are padded, which the kernels and
        the masks ignore. It has no tables to ``finish``. With ``has_cold``, its tables
        may name cold blocks, which a gather reads through a plan made from the tables."""
        tables, starts, offset, write_ids = arrays
        self = cls.__new__(cls)
        self.block_size, self._pool = pool.block_size, pool
        self.tables, self.n_new, self._spans = [None] * offset.shape[0], 1, []
        self.block_tables = self._view_tables = tables
        self.has_cold = has_cold
        self._plan = TierPlan.of_ids(tables, pool.block_size) if has_cold else None
        self.starts, self.offset = starts, offset
        self.new_tokens = [1] * offset.shape[0]
        self.counts = mx.ones_like(offset)
        self.lengths = offset + 1
        self.padded, self.write_rows = False, None
        self.write_ids, self.write_slots = write_ids, (offset % self.block_size)[:, None]
        self.width = tables.shape[1] * self.block_size
        self.masks, self._slots, self._stand_ins = {}, None, {}
        return self

    def write(self, pool: mx.array, new: mx.array) -> None:
        """Store ``(B, n_new, H, D)`` new K or V in a layer's pool array, real tokens only."""
        if self.write_rows is not None:
            new = new.reshape(-1, *new.shape[2:])[self.write_rows]  # (M, H, D)
        pool[self.write_ids, self.write_slots] = new

    def mask(self, window: int | None) -> mx.array:
        """``(B, 1, n_new, width)`` bool: which gathered keys each query may see."""
        if window not in self.masks:
            pos = self.starts[:, None, None] + mx.arange(self.width)[None, None]  # (B, 1, W)
            query = self.offset[:, None, None] + mx.arange(self.n_new)[None, :, None]  # (B, n, 1)
            ok = pos <= query
            if self.padded:  # padding queries see real keys only (one at least)
                real = self.offset + mx.maximum(self.counts, 1)  # (B,)
                ok = ok & (pos < real[:, None, None])
            if window is not None:
                ok = ok & (pos > query - window)
            self.masks[window] = ok[:, None]
        return self.masks[window]

    @property
    def slots(self) -> mx.array:
        """``(B, width)`` pool slots of the gathered tokens (made once per step)."""
        if self._slots is None:
            bs = self.block_size
            ids = self.block_tables[:, :, None] * bs + mx.arange(bs, dtype=mx.int32)
            self._slots = ids.reshape(len(self.tables), -1)
        return self._slots

    @property
    def plan(self) -> TierPlan | None:
        """How gathers read both tiers when any row holds a cold block (made once, when a
        gather first needs it: a step that a fused kernel serves never does)."""
        if self.has_cold and self._plan is None:
            self._plan = self._pool.tier_plan(np.array(self.block_tables).tolist())
        return self._plan

    @property
    def view_tables(self) -> mx.array:
        """``block_tables`` padded to ``table_width`` with each row's last id, for kernels."""
        if self._view_tables is None:
            self._view_tables = self._padded_tables()
        return self._view_tables

    def _padded_tables(self, to: int | None = None) -> mx.array:
        """``block_tables`` padded as ``pad_tables`` pads them, made on the host from the rows
        (no pad in the step's graph)."""
        width = self.width // self.block_size
        cols = max(table_width(width), to or 0)
        return self.block_tables if cols == width else self._table_rows(cols, "padded row")

    def stand_ins(self, h: int, dk: int, dv: int, dtype: mx.Dtype) -> tuple[mx.array, mx.array]:
        """``(B, h, width, dk|dv)`` stand-ins for deferred reads, made once per step."""
        key = (h, dk, dv, dtype)
        if key not in self._stand_ins:
            b, t = len(self.tables), self.width
            self._stand_ins[key] = stand_ins((b, h, t, dk), (b, h, t, dv), dtype)
        return self._stand_ins[key]

    def finish(self) -> None:
        """Record the step's tokens in every table (after the forward)."""
        for t, c in zip(self.tables, self.new_tokens, strict=True):
            n = t.lengths[0] + c
            t.lengths[:] = [n] * len(t.lengths)


def _one_token_rows(
    tables: list[BlockTable], lengths: list[int], window: int | None, bs: int
) -> tuple[list[tuple[BlockTable, int, int]], list[int], list[int]]:
    """Each row's span, first position and new token's block in a one-token step. The new
    token's block is the last one its query reads: its table already holds it."""
    spans, starts, ids = [], [], []
    for t, n in zip(tables, lengths, strict=True):
        first = t.first
        start = first if window is None else max(0, n - window + 1) // bs
        assert start >= first, f"block {start} was given back before the query read it"
        i = n // bs - first  # the new token's block
        spans.append((t, start - first, i + 1))
        starts.append(start * bs)
        ids.append(t.blocks[i])
    return spans, starts, ids


def _row(table: BlockTable, lo: int, hi: int, cols: int) -> bytes:
    """``table.blocks[lo:hi]`` as ``cols`` int32s, padded on the right with the last one."""
    row = np.zeros(cols, dtype=np.int32)
    if hi > lo:
        row[: hi - lo] = table.blocks[lo:hi]
        row[hi - lo :] = table.blocks[hi - 1]
    return row.tobytes()


def pad_tables(block_tables: mx.array, to: int | None = None) -> mx.array:
    """``(B, width)`` ids padded on the right to ``table_width(width)`` (or to ``to``, at
    least that) with each row's last id (kernels stop at each sequence's length and never
    read them)."""
    width = block_tables.shape[-1]
    extra = max(table_width(width), to or 0) - width
    if not extra:
        return block_tables
    return mx.pad(block_tables, [(0, 0)] * (block_tables.ndim - 1) + [(0, extra)], mode="edge")
