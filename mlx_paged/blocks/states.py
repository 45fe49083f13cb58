"""Recurrent-state bookkeeping: the slots of running requests and snapshots at prefix ends.

A hybrid model's recurrent layers (mlx-lm's ``ArraysCache``: a conv state and an
SSM / delta-rule state) cannot be rebuilt from K/V blocks. Each running request
holds one *slot* of the per-layer state arrays. A *snapshot* is a copy of every
recurrent layer's state of one sequence at one token position; the prefix index
holds it on the node that ends there, so a request adopting that prefix copies it
into its slot and prefills only the rest.

``StateSlots`` owns slot and snapshot ids and the snapshots' LRU order; it moves
no arrays: the storage layer's ``StatePool`` subclasses it and copies state where
this class only hands out ids. Pure Python.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class StateStats:
    """Slots in use out of ``slots``, snapshots held, and the bytes of both."""

    slots: int
    slots_used: int
    snapshots: int
    slot_bytes: int
    snapshot_bytes: int


class StateSlots:
    """Hands out state slots to running requests and ids to snapshots.

    Every snapshot has exactly one holder, the prefix-index node at whose end it
    was taken: adopting it copies it, so nothing else keeps it alive. When
    ``num_snapshots`` are held, taking another evicts the least recently used
    (``on_evict`` tells the index first).

    Args:
        num_slots: Requests that can run at once (the engine's ``max_batch_size``).
        num_snapshots: Most snapshots held at once.
    """

    def __init__(self, num_slots: int, num_snapshots: int):
        for name, v in (("num_slots", num_slots), ("num_snapshots", num_snapshots)):
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"{name} must be a positive int, got {v!r}.")
        self.num_slots = num_slots
        self.num_snapshots = num_snapshots
        #: Called with a snapshot id right before the LRU snapshot is evicted.
        self.on_evict: Callable[[int], None] | None = None
        #: Bytes of one request's state over all recurrent layers (set by the storage layer).
        self.bytes_per_state = 0
        self._free_slots = list(range(num_slots - 1, -1, -1))  # pop() takes the lowest
        self._lru: OrderedDict[int, None] = OrderedDict()  # snapshot ids, oldest first
        self._next_id = 0

    # ---- slots ------------------------------------------------------------

    def take_slot(self, snapshot: int | None = None) -> int | None:
        """A free slot holding ``snapshot``'s state (a fresh, zero state if ``None``).

        Returns ``None`` when every slot is taken (back-pressure).
        """
        if snapshot is not None:
            self._check_snapshot(snapshot)
        if not self._free_slots:
            return None
        slot = self._free_slots.pop()
        if snapshot is None:
            self._clear(slot)
        else:
            self._lru.move_to_end(snapshot)
            self._copy_in(snapshot, slot)
        return slot

    def free_slot(self, slot: int) -> None:
        """Give a slot back; its state is cleared when it is next taken."""
        if not 0 <= slot < self.num_slots or slot in self._free_slots:
            raise ValueError(f"slot {slot} is not taken (slots 0..{self.num_slots - 1}).")
        self._free_slots.append(slot)
        self._free_slots.sort(reverse=True)

    # ---- snapshots --------------------------------------------------------

    def snapshot(self, slot: int) -> int:
        """Copy a slot's state into a new snapshot and return its id (evicting the LRU one
        when ``num_snapshots`` are held)."""
        if not 0 <= slot < self.num_slots or slot in self._free_slots:
            raise ValueError(f"slot {slot} is not taken; only a running request has a state.")
        return self._new_snapshot(lambda sid: self._copy_out(slot, sid))

    def restore(self, state: object) -> int:
        """A new snapshot holding ``state`` (read back from elsewhere, e.g. a disk tier);
        its id. Evicts the LRU one when ``num_snapshots`` are held."""
        return self._new_snapshot(lambda sid: self._put(sid, state))

    def drop(self, snapshot: int) -> None:
        """The holder gives a snapshot up (its index node went away)."""
        self._check_snapshot(snapshot)
        del self._lru[snapshot]
        self._free(snapshot)

    def ids(self) -> list[int]:
        """Snapshot ids held, least recently used first."""
        return list(self._lru)

    def stats(self) -> StateStats:
        """Slots and snapshots in use and their bytes."""
        used = self.num_slots - len(self._free_slots)
        return StateStats(
            slots=self.num_slots,
            slots_used=used,
            snapshots=len(self._lru),
            slot_bytes=self.num_slots * self.bytes_per_state,
            snapshot_bytes=len(self._lru) * self.bytes_per_state,
        )

    def check_invariants(self, slots: Iterable[int], snapshots: Iterable[int]) -> None:
        """Assert that ``slots`` (held by running requests) and ``snapshots`` (held by the
        index) are exactly what is taken here."""
        slots, snapshots = list(slots), list(snapshots)
        assert len(set(slots)) == len(slots), f"a slot is held twice: {sorted(slots)}"
        taken = set(range(self.num_slots)) - set(self._free_slots)
        assert len(self._free_slots) == len(set(self._free_slots)), "a slot is free twice"
        assert set(slots) == taken, f"slots held {sorted(slots)}, taken {sorted(taken)}"
        assert len(set(snapshots)) == len(snapshots), "a snapshot has two holders"
        assert set(snapshots) == set(self._lru), (
            f"index holds snapshots {sorted(snapshots)}, pool has {sorted(self._lru)}"
        )
        assert len(self._lru) <= self.num_snapshots, "more snapshots than num_snapshots"

    # ---- what the storage layer does with the arrays ----------------------

    def _clear(self, slot: int) -> None:
        """Reset a slot to the state of an empty sequence."""

    def _copy_in(self, snapshot: int, slot: int) -> None:
        """Copy a snapshot into a slot."""

    def _copy_out(self, slot: int, snapshot: int) -> None:
        """Copy a slot into a new snapshot."""

    def _put(self, snapshot: int, state: object) -> None:
        """Hold ``state`` as a new snapshot."""

    def _free(self, snapshot: int) -> None:
        """Release a snapshot's memory."""

    # ---- internals --------------------------------------------------------

    def _new_snapshot(self, fill: Callable[[int], None]) -> int:
        """A new snapshot id, evicting the LRU one when ``num_snapshots`` are held, filled
        by ``fill(id)``."""
        while len(self._lru) >= self.num_snapshots:
            self._evict_one()
        sid = self._next_id
        self._next_id += 1
        fill(sid)
        self._lru[sid] = None
        return sid

    def _evict_one(self) -> None:
        sid = next(iter(self._lru))
        if self.on_evict is not None:
            self.on_evict(sid)  # the index forgets it (and may drop it itself)
        if sid in self._lru:
            self.drop(sid)

    def _check_snapshot(self, snapshot: int) -> None:
        if snapshot not in self._lru:
            raise ValueError(f"snapshot {snapshot} is not held.")
