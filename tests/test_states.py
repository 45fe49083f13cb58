"""StateSlots and the prefix index's recurrent-state snapshots: exact ids, LRU, ownership."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from mlx_paged.blocks import BlockPool, PrefixIndex, StateSlots
from mlx_paged.blocks.trie import node_at
from mlx_paged.storage import batch_bucket

BS = 4


class Recording(StateSlots):
    """StateSlots whose storage hooks record what they were asked to copy."""

    def __init__(self, *args):
        super().__init__(*args)
        self.log: list[tuple] = []
        self.values: dict[int, object] = {}  # slot -> the "state" it holds
        self.saved: dict[int, object] = {}  # snapshot -> the state copied out

    def _clear(self, slot):
        self.log.append(("clear", slot))
        self.values[slot] = None

    def _copy_in(self, snapshot, slot):
        self.log.append(("in", snapshot, slot))
        self.values[slot] = self.saved[snapshot]

    def _copy_out(self, slot, snapshot):
        self.log.append(("out", slot, snapshot))
        self.saved[snapshot] = self.values[slot]

    def _free(self, snapshot):
        self.log.append(("free", snapshot))
        del self.saved[snapshot]


def make(num_blocks=16, slots=4, snapshots=8):
    pool = BlockPool(num_blocks, BS)
    states = Recording(slots, snapshots)
    return pool, states, PrefixIndex([pool], [None], states)


def park(pool, index, tokens, length=None):
    """A sequence that wrote ``length`` tokens detaches: its blocks are parked."""
    length = len(tokens) if length is None else length
    table = pool.allocate(-(-length // BS))
    index.insert(tokens, [(0, table)], length=length)
    pool.release_all(table)
    return table


def test_slots_are_taken_lowest_first_and_cleared_or_restored():
    states = Recording(3, 4)
    assert [states.take_slot() for _ in range(3)] == [0, 1, 2]
    assert states.take_slot() is None, "all slots taken: back-pressure, not an error"
    states.values[1] = "A"
    sid = states.snapshot(1)
    assert sid == 0 and states.saved == {0: "A"}
    states.free_slot(1)
    assert states.take_slot(sid) == 1 and states.values[1] == "A"
    assert states.log[-1] == ("in", 0, 1)
    states.free_slot(0)
    assert states.take_slot() == 0 and states.log[-1] == ("clear", 0)
    st_ = states.stats()
    assert (st_.slots, st_.slots_used, st_.snapshots) == (3, 3, 1)
    states.check_invariants([0, 1, 2], [0])


def test_bad_slot_and_snapshot_ids_are_value_errors():
    states = Recording(2, 2)
    with pytest.raises(ValueError, match="not taken"):
        states.free_slot(0)
    with pytest.raises(ValueError, match="not taken"):
        states.snapshot(5)
    with pytest.raises(ValueError, match="not held"):
        states.take_slot(7)
    with pytest.raises(ValueError, match="positive int"):
        StateSlots(0, 4)
    with pytest.raises(ValueError, match="positive int"):
        StateSlots(4, True)


def test_match_adopts_only_where_a_snapshot_ends():
    pool, states, index = make()
    tokens = list(range(10))  # nodes end at 4, 8 and 10
    park(pool, index, tokens)
    assert index.match(tokens + [99]) is None, "blocks without a state cannot be adopted"
    slot = states.take_slot()
    states.values[slot] = "at 8"
    assert index.add_snapshot(tokens, 8, lambda: states.snapshot(slot))
    assert not index.add_snapshot(tokens, 8, lambda: states.snapshot(slot)), "one per node"
    assert not index.add_snapshot(tokens, 6, lambda: states.snapshot(slot)), "no node ends at 6"
    m = index.match(tokens + [99])
    assert (m.length, m.blocks, m.snapshot) == (8, [[0, 1]], 0)
    states.values[slot] = "at 10"
    assert index.add_snapshot(tokens, 10, lambda: states.snapshot(slot))
    m = index.match(tokens + [99])
    assert (m.length, m.blocks, m.snapshot) == (10, [[0, 1, 2]], 1)
    # A prompt diverging inside the partial tail falls back to the snapshot at 8.
    assert index.match([*range(9), 77]).length == 8
    assert index.match([0, 1, 2, 3, 4, 5]) is None, "nothing ends at a snapshot up to 6"
    index.check_invariants()
    states.check_invariants([slot], index.snapshots)
    # Where prompts stop sharing whole blocks, snapshots aside: a cut worth snapshotting.
    assert index.full_blocks_matched(tokens + [99]) == 8
    assert index.full_blocks_matched([0, 1, 2, 3, 4, 5]) == 4
    assert index.full_blocks_matched([9, 9, 9, 9]) == 0


def test_snapshots_leave_with_their_blocks():
    pool, states, index = make(num_blocks=3)
    slot = states.take_slot()
    park(pool, index, list(range(8)))
    index.add_snapshot(list(range(8)), 8, lambda: states.snapshot(slot))
    index.add_snapshot(list(range(8)), 4, lambda: states.snapshot(slot))
    assert sorted(index.snapshots) == [0, 1] and pool.num_cached == 2
    pool.allocate(3)  # evicts both cached blocks: the first takes its subtree
    assert index.snapshots == [] and states.ids() == []
    assert ("free", 0) in states.log and ("free", 1) in states.log
    index.check_invariants()
    states.check_invariants([slot], index.snapshots)


def test_the_least_recently_used_snapshot_is_evicted_at_the_cap():
    pool, states, index = make(snapshots=2)
    slot = states.take_slot()
    for first in (0, 10, 20):
        tokens = [first, first + 1, first + 2, first + 3]
        park(pool, index, tokens)
        index.add_snapshot(tokens, 4, lambda: states.snapshot(slot))
        if first == 10:
            other = states.take_slot(0)  # adopting snapshot 0 makes it more recent than 1
            states.free_slot(other)
    assert sorted(index.snapshots) == [0, 2], "snapshot 1 was least recently used"
    assert index.match([10, 11, 12, 13, 99]) is None
    assert pool.num_cached == 3, "its blocks stay cached"
    index.check_invariants()
    states.check_invariants([slot], index.snapshots)


class SnapshotMachine(RuleBasedStateMachine):
    """Random parks, snapshots, adoptions and evictions keep index and states in step."""

    def __init__(self):
        super().__init__()
        self.pool, self.states, self.index = make(num_blocks=12, slots=3, snapshots=4)
        self.held: list[int] = []

    @rule(data=st.data(), n=st.integers(1, 12))
    def park_with_snapshot(self, data, n):
        if not self.pool.can_allocate(-(-n // BS)):
            return
        tokens = data.draw(st.lists(st.integers(0, 2), min_size=n, max_size=n))
        park(self.pool, self.index, tokens)
        if self.held:
            at = data.draw(st.integers(1, n))
            slot = self.held[0]
            self.index.add_snapshot(tokens, at, lambda: self.states.snapshot(slot))

    @precondition(lambda self: len(self.held) < 3)
    @rule(tokens=st.lists(st.integers(0, 2), min_size=1, max_size=12))
    def adopt(self, tokens):
        m = self.index.match(tokens)
        if m is not None:
            assert m.snapshot in self.states.ids()
            assert node_at(self.index._root, tokens, m.length, BS).snapshot == m.snapshot
        self.held.append(self.states.take_slot(m.snapshot if m else None))

    @precondition(lambda self: self.held)
    @rule()
    def finish(self):
        self.states.free_slot(self.held.pop())

    @rule(n=st.integers(1, 4))
    def pressure(self, n):
        taken = self.pool.allocate(min(n, self.pool.num_available))
        self.pool.release_all(taken)

    @invariant()
    def consistent(self):
        self.index.check_invariants()
        self.pool.check_invariants()
        self.states.check_invariants(self.held, self.index.snapshots)


TestSnapshotMachine = SnapshotMachine.TestCase
TestSnapshotMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)


def test_state_pool_writes_a_steps_taken_slots_in_one_scatter_per_entry():
    """Slots taken between forwards start from their snapshots (or zeros) when the arrays are
    next used, one scatter per entry, even for a snapshot dropped in between."""
    import mlx.core as mx

    from mlx_paged.storage import StatePool

    pool = StatePool([2], num_slots=4, num_snapshots=1)
    for slot in range(3):
        assert pool.take_slot() == slot
    rows = mx.arange(3 * 2 * 3, dtype=mx.float32).reshape(3, 2, 3)
    pool.write(0, 3, [rows + 0, rows + 100])  # all 3 rows: the pool keeps these arrays
    snap = pool.snapshot(1)  # slot 1's state
    for slot in (0, 1):
        pool.free_slot(slot)
    assert pool.take_slot(snap) == 0  # from the snapshot
    assert pool.take_slot() == 1  # zeros
    pool.drop(snap)  # before the arrays are used
    assert pool.ids() == []
    k, v = pool.read(0, mx.array([0, 1, 2], dtype=mx.int32))
    assert mx.array_equal(k, mx.stack([rows[1], mx.zeros((2, 3)), rows[2]]))
    assert mx.array_equal(v, mx.stack([rows[1] + 100, mx.zeros((2, 3)), rows[2] + 100]))


def test_a_snapshot_holds_a_copy_of_its_rows_not_a_view_of_the_pool():
    """Each snapshot's arrays lie in buffers of their own (a slice of the pool's would keep
    the whole array alive and stop it being updated in place), and a slot adopting one
    after the pool's later writes gets the state as it was taken."""
    import mlx.core as mx

    from mlx_paged.storage import StatePool

    pool = StatePool([2], num_slots=4, num_snapshots=4)
    for slot in range(3):
        assert pool.take_slot() == slot
    rows = mx.arange(3 * 2 * 3, dtype=mx.float32).reshape(3, 2, 3)
    pool.write(0, 3, [rows + 0, rows + 100])
    mx.eval(pool.evaluated())
    held = [np.asarray(a) for a in pool.arrays[0]]  # the buffers snapshots are taken from
    snaps = [pool.snapshot(slot) for slot in (2, 0, 1)]
    pool.write(0, 3, [rows + 1000, rows + 2000])
    for sid, slot in zip(snaps, (2, 0, 1), strict=True):
        k, v = pool.snapshot_state(sid)[0]
        for copy in (np.asarray(k), np.asarray(v)):  # buffers of their own, not views
            assert not any(np.shares_memory(copy, whole) for whole in held)
        assert mx.array_equal(k, rows[slot : slot + 1])
        assert mx.array_equal(v, rows[slot : slot + 1] + 100)
    pool.free_slot(0)
    assert pool.take_slot(snaps[0]) == 0  # slot 2's state as it was
    k, _ = pool.read(0, mx.array([0, 1], dtype=mx.int32))
    assert mx.array_equal(k, mx.stack([rows[2], rows[1] + 1000]))


class StatePoolMachine(RuleBasedStateMachine):
    """``StatePool``'s arrays against a plain record of every slot's and snapshot's state,
    through takes, frees, snapshots and forwards over taken slots in any order."""

    def __init__(self):
        import mlx.core as mx

        from mlx_paged.storage import StatePool

        super().__init__()
        self.mx = mx
        self.pool = StatePool([2, 1], num_slots=5, num_snapshots=3)
        self.slots: dict[int, list[float]] = {}  # taken slot -> its state: one value a layer
        self.snaps: dict[int, list[float]] = {}
        self.steps = 0

    def _rows(self, value: float, b: int, entry: int):
        return self.mx.full((b, 2, 1 + entry), value, dtype=self.mx.float32)

    @rule(data=st.data())
    def take(self, data):
        snap = data.draw(st.sampled_from([None, *sorted(self.snaps)]))
        slot = self.pool.take_slot(snap)
        if slot is None:
            assert len(self.slots) == self.pool.num_slots
            return
        assert slot == min(set(range(self.pool.num_slots)) - set(self.slots))
        self.slots[slot] = list(self.snaps[snap]) if snap is not None else [0.0, 0.0]

    @precondition(lambda self: self.slots)
    @rule(data=st.data())
    def free(self, data):
        slot = data.draw(st.sampled_from(sorted(self.slots)))
        self.pool.free_slot(slot)
        del self.slots[slot]

    @precondition(lambda self: self.slots and self.steps)
    @rule(data=st.data())
    def snapshot(self, data):
        slot = data.draw(st.sampled_from(sorted(self.slots)))
        before = set(self.pool.ids())
        sid = self.pool.snapshot(slot)
        for gone in before - set(self.pool.ids()):
            del self.snaps[gone]  # the least recently used, evicted
        self.snaps[sid] = list(self.slots[slot])

    @precondition(lambda self: self.snaps)
    @rule(data=st.data())
    def drop(self, data):
        sid = data.draw(st.sampled_from(sorted(self.snaps)))
        self.pool.drop(sid)
        del self.snaps[sid]

    @precondition(lambda self: self.slots)
    @rule(data=st.data())
    def forward(self, data):
        """A step over some taken slots (often all of them in slot order): each layer reads
        their states and adds the step's number to them."""
        mx = self.mx
        taken = sorted(self.slots)
        batch = data.draw(st.one_of(st.just(taken), st.permutations(taken)))
        batch = batch[: data.draw(st.integers(1, len(batch)))]
        rows = self.pool.rows(batch)
        if batch == taken and taken == list(range(len(taken))):  # the first rows, or all
            held = min(batch_bucket(rows), self.pool.num_slots)
            assert rows == len(batch) and self.pool.rows_held == held
        self.steps += 1
        for layer in range(2):
            read = self.pool.read(layer, rows)
            written = []
            for e, got in enumerate(read):
                if got is None:  # nothing written yet: every state is zero
                    assert all(self.slots[s][layer] == 0 for s in batch)
                    got = self._rows(0.0, len(batch), e)
                want = [self.slots[s][layer] for s in batch]
                assert got[:, 0, 0].tolist() == want, (layer, e, batch)
                written.append(got + self.steps)
            if isinstance(rows, int) and rows == self.pool.rows_held:
                for e, a in enumerate(read):
                    assert a is None or a is self.pool.arrays[layer][e]
            self.pool.write(layer, rows, written)
        for s in batch:
            self.slots[s] = [v + self.steps for v in self.slots[s]]
        mx.eval(self.pool.evaluated())

    @invariant()
    def consistent(self):
        self.pool.check_invariants(list(self.slots), list(self.snaps))
        self.pool.evaluated()  # taken slots' starting states written: rows for all of them
        assert self.pool.rows_held > max(self.slots, default=-1)
        # A few shapes for a compiled step: 1, 2, 4, then every slot (5), as rows grow.
        assert self.pool.rows_held in (0, 1, 2, 4, 5)
        for held in self.pool.arrays:
            for a in held:
                assert a is None or a.shape[0] == self.pool.rows_held
        for sid, values in self.snaps.items():
            state = self.pool.snapshot_state(sid)
            for layer in range(2):
                for a in state[layer]:
                    assert a is None or a[0, 0, 0].item() == values[layer]


TestStatePoolMachine = StatePoolMachine.TestCase
TestStatePoolMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
