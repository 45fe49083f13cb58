"""Recurrent-state arrays: one slot per running request, and snapshots at prefix ends.

``StatePool`` holds, for each recurrent layer of a hybrid model (mlx-lm's
``ArraysCache``), one array per state entry (conv state, SSM state, ...) shaped
``[rows_held, *entry_shape]``, created at the entry's first write. A batched
forward gathers the rows of its requests' slots and scatters the new state back,
so requests join and leave without any state moving. A step whose requests are
slots ``0 .. B-1`` in order reads and writes the first ``B`` rows as a slice, or,
when ``B`` rows are all the arrays hold, replaces the arrays themselves. The rows
held follow ``batch_bucket`` (1, 2, 4, 8, then multiples of 8, up to the slots):
they grow when a higher slot is taken and shrink when every slot taken lies in a
smaller bucket, so a compiled step (``engine/compiled.py``) meets a few array
shapes, not one per request count. A snapshot is a copy of one slot's rows in
every layer. Bookkeeping (ids, LRU) is ``StateSlots``'.
"""

from __future__ import annotations

from collections.abc import Iterable

import mlx.core as mx

from ..blocks import StateSlots

#: One sequence's state: per recurrent layer, per entry, ``(1, *entry_shape)`` or ``None``.
State = list[list[mx.array | None]]


def batch_bucket(rows: int) -> int:
    """The next power of two up to 8, then the next multiple of 8: the rows a compiled
    decode step pads a batch to, and the rows the state arrays hold. A count that grows and
    shrinks by one at a time meets one array shape per bucket instead of one per count."""
    if rows <= 8:
        return 1 << max(0, rows - 1).bit_length()
    return -(-rows // 8) * 8


class StatePool(StateSlots):
    """Per-layer state arrays over ``StateSlots``' slot and snapshot ids.

    Args:
        entries: Per recurrent layer, its ``ArraysCache`` size (state entries).
        num_slots: Requests that can run at once.
        num_snapshots: Most snapshots held at once.
    """

    def __init__(self, entries: list[int], num_slots: int, num_snapshots: int):
        super().__init__(num_slots, num_snapshots)
        self.arrays: list[list[mx.array | None]] = [[None] * n for n in entries]
        self._snapshots: dict[int, State] = {}
        # Slots taken since the arrays were last used, and what each starts from (a
        # snapshot's state, or ``None``: zeros): written together, one scatter per entry.
        self._pending: dict[int, State | None] = {}
        #: Rows of every state array: more than any slot taken.
        self.rows_held = 0

    @property
    def num_layers(self) -> int:
        return len(self.arrays)

    # ---- a forward's reads and writes ------------------------------------

    def rows(self, slots: list[int]) -> mx.array | int:
        """How a step addresses its requests' slots: ``B`` when they are slots ``0 .. B-1``
        in order (read as a slice and written without a scatter; when no other slot is
        taken, the arrays shrink to ``B``'s bucket, and are read and replaced whole when
        that is ``B``), else a ``(B,)`` int32 index array (a gather and a scatter per
        entry)."""
        b = len(slots)
        if slots != list(range(b)):
            return mx.array(slots, dtype=mx.int32)
        held = self._bucket(b)
        if held < self.rows_held and self.num_slots - len(self._free_slots) == b:
            self.flush()
            self._resize(held)
        return b

    def read(self, layer: int, rows: mx.array | int) -> list[mx.array | None]:
        """``(B, *entry_shape)`` state of one layer for ``rows`` (``None`` for an entry
        nothing has written yet: every sequence still starts from zeros)."""
        self.flush()
        if isinstance(rows, int):
            whole = rows == self.rows_held
            return [a if a is None or whole else a[:rows] for a in self.arrays[layer]]
        return [None if a is None else a[rows] for a in self.arrays[layer]]

    def write(self, layer: int, rows: mx.array | int, entries: list[mx.array | None]) -> None:
        """Store ``(B, *entry_shape)`` new state of one layer in ``rows``. A write of every
        row keeps ``entries``' arrays as the pool's, which later writes update in place:
        pass arrays nothing else reads."""
        self.flush()
        held = self.arrays[layer]
        if len(entries) != len(held):
            raise ValueError(f"layer {layer} has {len(held)} state entries, got {len(entries)}.")
        for e, new in enumerate(entries):
            if new is None:
                continue
            self._ensure(layer, e, new)
            if isinstance(rows, int) and rows == self.rows_held:
                held[e] = new  # every row, in order: the new state is the array
            elif isinstance(rows, int):
                held[e][:rows] = new
            else:
                held[e][rows] = new

    def evaluated(self) -> list[mx.array]:
        """Every allocated state array (to evaluate with a forward's writes)."""
        self.flush()
        return [a for layer in self.arrays for a in layer if a is not None]

    def check_invariants(self, slots: Iterable[int], snapshots: Iterable[int]) -> None:
        """``StateSlots``' checks, and that arrays are held for exactly the snapshots held."""
        super().check_invariants(slots, snapshots)
        held = sorted(self._snapshots)
        assert held == sorted(self.ids()), f"arrays for snapshots {held}, ids {self.ids()}"

    def snapshot_state(self, snapshot: int) -> State:
        """A snapshot's arrays (read-only: tests compare them with a dense cache)."""
        return self._snapshots[snapshot]

    # ---- StateSlots hooks -------------------------------------------------

    def _clear(self, slot: int) -> None:
        self._pending[slot] = None

    def _copy_in(self, snapshot: int, slot: int) -> None:
        self._pending[slot] = self._snapshots[snapshot]  # held here even if the id goes

    def flush(self) -> None:
        """Write the pending slots' starting states: one scatter per state entry for all of
        them (a burst of requests adopting snapshots takes many slots in one step). Reads
        and writes flush first; so does a compiled step, before it may trace."""
        if not self._pending:
            return
        pending, self._pending = self._pending, {}
        self._resize(max(self.rows_held, self._bucket(max(pending) + 1)))
        at = mx.array(list(pending), dtype=mx.int32)
        for layer, held in enumerate(self.arrays):
            for e, a in enumerate(held):
                saved = [None if s is None else s[layer][e] for s in pending.values()]
                if a is None:
                    if any(x is not None for x in saved):  # snapshots come from written arrays
                        raise AssertionError(f"a snapshot holds layer {layer} entry {e}, unwritten")
                    continue
                zero = mx.zeros((1, *a.shape[1:]), dtype=a.dtype)
                a[at] = mx.concatenate([zero if x is None else x for x in saved])

    def _copy_out(self, slot: int, snapshot: int) -> None:
        self.flush()
        # A gather makes a copy (a slice could share the pool's buffer and stop it
        # being updated in place); evaluate it now so it holds no graph.
        at = mx.array([slot], dtype=mx.int32)
        state = [[None if a is None else a[at] for a in layer] for layer in self.arrays]
        mx.eval([a for layer in state for a in layer if a is not None])
        self._snapshots[snapshot] = state

    def _put(self, snapshot: int, state: State) -> None:
        """Hold ``state`` as a snapshot, making the entries a fresh pool lacks."""
        if len(state) != self.num_layers:
            raise ValueError(f"expected {self.num_layers} layers of state, got {len(state)}.")
        for layer, (held, saved) in enumerate(zip(self.arrays, state, strict=True)):
            if len(saved) != len(held):
                raise ValueError(f"layer {layer} has {len(held)} state entries, got {len(saved)}.")
            for e, s in enumerate(saved):
                if s is not None:
                    self._ensure(layer, e, s)
        self._snapshots[snapshot] = state

    def _ensure(self, layer: int, e: int, like: mx.array) -> None:
        """Make state entry ``e`` of ``layer`` for arrays shaped ``like`` (``(B, *shape)``),
        or check that it holds them."""
        held = self.arrays[layer]
        if held[e] is None:
            held[e] = mx.zeros((self.rows_held, *like.shape[1:]), dtype=like.dtype)
            self.bytes_per_state += like.nbytes // like.shape[0]
        elif held[e].shape[1:] != like.shape[1:] or held[e].dtype != like.dtype:
            raise ValueError(
                f"layer {layer} state {e}: expected {held[e].shape[1:]} {held[e].dtype}, "
                f"got {like.shape[1:]} {like.dtype}."
            )

    def _bucket(self, rows: int) -> int:
        """Rows the arrays hold for ``rows`` in use: their ``batch_bucket``, at most every slot."""
        return min(batch_bucket(rows), self.num_slots)

    def _resize(self, rows: int) -> None:
        """Give every state array ``rows`` rows: cut off the last ones (no slot is taken
        there), or add zeros."""
        if rows == self.rows_held:
            return
        for held in self.arrays:
            for e, a in enumerate(held):
                if a is None:
                    continue
                if rows < self.rows_held:
                    held[e] = a[:rows]
                else:
                    zeros = mx.zeros((rows - self.rows_held, *a.shape[1:]), dtype=a.dtype)
                    held[e] = mx.concatenate([a, zeros])
        self.rows_held = rows

    def _free(self, snapshot: int) -> None:
        del self._snapshots[snapshot]
