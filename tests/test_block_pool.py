"""BlockPool: exact ids, refcounts, LRU eviction and back-pressure; no device needed."""

from __future__ import annotations

from collections import deque

import pytest
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from mlx_paged import BlockPool, PagedCacheStats
from mlx_paged.blocks.pool import GROWTH, ready_run
from mlx_paged.blocks.tiers import COLD, TieredBlockPool


def parked_and_cached(pool: BlockPool, ids: list[int]) -> None:
    """Park ``ids`` (held by one sequence) and release them one by one, in order."""
    for b in ids:
        pool.park(b)
    for b in ids:
        pool.release(b)


# ---- allocation and refcounts ---------------------------------------------


def test_allocate_hands_out_ids_in_order():
    """Fresh blocks come out 0, 1, 2, ... with refcount 1."""
    pool = BlockPool(8, 4)
    assert pool.allocate(3) == [0, 1, 2]
    assert pool.allocate(2) == [3, 4]
    assert pool.refcounts == [1, 1, 1, 1, 1, 0, 0, 0]
    assert pool.num_free == 3
    assert pool.allocate(0) == []
    pool.check_invariants(tables=[[0, 1, 2], [3, 4]])


def test_released_blocks_are_reused_after_untouched_ones():
    """The free list is FIFO: a released block goes to its back."""
    pool = BlockPool(4, 4)
    assert pool.allocate(2) == [0, 1]
    pool.release(0)
    assert pool.refcounts == [0, 1, 0, 0]
    assert pool.allocate(2) == [2, 3]
    assert pool.allocate(1) == [0]
    pool.check_invariants(tables=[[0, 1, 2, 3]])


def test_retain_and_release_count_holders():
    """Each retain adds a holder; the last release frees the block."""
    pool = BlockPool(4, 4)
    (b,) = pool.allocate(1)
    pool.retain(b)
    pool.retain(b)
    assert pool.refcounts[b] == 3
    assert pool.is_shared(b)
    pool.release(b)
    pool.release(b)
    assert pool.refcounts[b] == 1
    assert not pool.is_shared(b)
    assert pool.num_free == 3
    pool.release(b)
    assert pool.refcounts[b] == 0
    assert pool.num_free == 4
    pool.check_invariants(tables=[])


def test_stats_fields():
    """stats() counts live, cached and free blocks and the bytes of the whole pool."""
    pool = BlockPool(6, 4)
    pool.bytes_per_block = 100
    a, b, c = pool.allocate(3)
    parked_and_cached(pool, [c])
    assert pool.stats() == PagedCacheStats(
        total_blocks=6, live_blocks=2, cached_blocks=1, free_blocks=3, block_size=4, bytes=600
    )
    pool.retain(c)  # adopt it again: cached -> live
    pool.release(a)
    assert pool.stats() == PagedCacheStats(
        total_blocks=6, live_blocks=2, cached_blocks=0, free_blocks=4, block_size=4, bytes=600
    )


# ---- parking and the LRU of cached blocks ---------------------------------


def test_block_is_cached_only_when_the_index_is_its_only_holder():
    """park adds a holder; the block becomes evictable once the sequences let go."""
    pool = BlockPool(4, 4)
    (b,) = pool.allocate(1)
    pool.park(b)
    assert pool.refcounts[b] == 2
    assert pool.num_cached == 0  # a sequence still holds it
    pool.release(b)
    assert pool.refcounts[b] == 1
    assert pool.num_cached == 1
    assert pool.num_available == 4
    pool.retain(b)  # a new sequence adopts the cached block
    assert pool.refcounts[b] == 2
    assert pool.num_cached == 0
    assert pool.num_available == 3
    pool.release(b)
    assert pool.num_cached == 1
    pool.unpark(b)
    assert pool.refcounts[b] == 0
    assert b not in pool.parked
    assert pool.stats().free_blocks == 4
    pool.check_invariants(tables=[])


def test_unpark_of_a_live_block_keeps_it_live():
    """Unparking a block a sequence still holds only drops the index's reference."""
    pool = BlockPool(4, 4)
    (b,) = pool.allocate(1)
    pool.park(b)
    pool.unpark(b)
    assert pool.refcounts[b] == 1
    assert b not in pool.parked
    assert (pool.num_cached, pool.num_free) == (0, 3)
    pool.check_invariants(tables=[[b]])


def test_eviction_takes_the_oldest_cached_block_first():
    """allocate evicts in LRU order and tells on_evict about each block."""
    evicted = []
    pool = BlockPool(3, 4, on_evict=evicted.append)
    ids = pool.allocate(3)
    assert ids == [0, 1, 2]
    for b in ids:
        pool.park(b)
    for b in (1, 0, 2):  # cached order: 1, 0, 2
        pool.release(b)
    assert pool.num_cached == 3 and pool.num_free == 0
    assert pool.allocate(2) == [1, 0]
    assert evicted == [1, 0]
    assert pool.parked == {2}
    assert pool.refcounts == [1, 1, 1]
    pool.check_invariants(tables=[[1, 0]])


def test_retaining_a_cached_block_refreshes_its_lru_position():
    """A cached block that was adopted and released again is the newest cached one."""
    evicted = []
    pool = BlockPool(3, 4, on_evict=evicted.append)
    parked_and_cached(pool, pool.allocate(3))  # cached order: 0, 1, 2
    pool.retain(0)
    pool.release(0)  # cached order: 1, 2, 0
    assert pool.allocate(3) == [1, 2, 0]
    assert evicted == [1, 2, 0]


def test_release_all_releases_last_first():
    """After release_all the table's head is the most recently cached block."""
    evicted = []
    pool = BlockPool(3, 4, on_evict=evicted.append)
    table = pool.allocate(3)
    for b in table:
        pool.park(b)
    pool.release_all(table)
    assert pool.num_cached == 3
    assert pool.allocate(2) == [2, 1]
    assert evicted == [2, 1]
    assert pool.parked == {0}  # the head survives longest
    pool.check_invariants(tables=[[2, 1]])


# ---- back-pressure and growth ---------------------------------------------


def test_fixed_pool_returns_none_and_changes_nothing_when_short():
    """allocate returns None if free + cached blocks are too few, and touches nothing."""
    evicted = []
    pool = BlockPool(4, 4, on_evict=evicted.append)
    live = pool.allocate(2)
    (c,) = pool.allocate(1)
    parked_and_cached(pool, [c])  # 2 live, 1 cached, 1 free
    before = (list(pool.refcounts), set(pool.parked), pool.stats())
    assert not pool.can_allocate(3)
    assert pool.allocate(3) is None
    assert (list(pool.refcounts), set(pool.parked), pool.stats()) == before
    assert evicted == []
    pool.check_invariants(tables=[live])
    assert pool.can_allocate(2)
    assert pool.allocate(2) == [3, c]
    assert evicted == [c]


def test_growable_pool_grows_on_demand():
    """With num_blocks=None the pool grows by its shortfall or a quarter, instead of refusing."""
    pool = BlockPool(None, 4)
    assert pool.growable
    assert pool.capacity == 0
    assert pool.can_allocate(10**6)
    assert pool.allocate(3) == [0, 1, 2]
    assert pool.capacity == 3
    assert pool.allocate(1) == [3]  # a quarter of 3 is 0: the shortfall, 1
    assert pool.capacity == 4
    assert pool.allocate(10) == list(range(4, 14))
    assert pool.capacity == 14
    assert pool.allocate(1) == [14]  # a quarter of 14: 3 more
    assert (pool.capacity, pool.num_free) == (17, 2)
    pool.check_invariants(tables=[list(range(15))])


def test_make_room_grows_once_so_that_the_allocations_after_it_do_not():
    pool = BlockPool(None, 4)
    pool.make_room(10)
    assert (pool.capacity, pool.num_free) == (10, 10)
    assert [pool.allocate(3), pool.allocate(3), pool.allocate(4)] == [
        [0, 1, 2], [3, 4, 5], [6, 7, 8, 9]
    ]  # fmt: skip
    assert pool.capacity == 10
    pool.make_room(1)  # short by 1, but a quarter of 10 is 2
    assert (pool.capacity, pool.num_free) == (12, 2)
    pool.make_room(2)  # room already
    assert pool.capacity == 12
    fixed = BlockPool(4, 4)
    fixed.make_room(10)  # a fixed pool is left as it is
    assert (fixed.capacity, fixed.num_free) == (4, 4)


def test_growable_pool_reuses_cached_blocks_before_growing():
    """A growable pool evicts cached blocks rather than grow when they suffice."""
    pool = BlockPool(None, 4)
    parked_and_cached(pool, pool.allocate(2))
    assert pool.allocate(1) == [0]
    assert pool.capacity == 2


# ---- bad input ------------------------------------------------------------


@pytest.mark.parametrize("block_size", [0, -4, 1.5, "16", True, None])
def test_bad_block_size_raises(block_size):
    """block_size must be a positive int (bool is not an int here)."""
    with pytest.raises(ValueError, match="block_size must be a positive int"):
        BlockPool(8, block_size)


@pytest.mark.parametrize("num_blocks", [0, -1, 2.5, True, "8"])
def test_bad_num_blocks_raises(num_blocks):
    """num_blocks must be a positive int or None."""
    with pytest.raises(ValueError, match="num_blocks must be a positive int or None"):
        BlockPool(num_blocks, 4)


def test_misuse_raises_value_error_and_changes_nothing():
    """Releasing/retaining a free block, double park, stray unpark: ValueError."""
    pool = BlockPool(4, 4)
    (b,) = pool.allocate(1)
    pool.park(b)
    before = (list(pool.refcounts), set(pool.parked), pool.stats())
    with pytest.raises(ValueError, match="block 1 is already free; it was released twice"):
        pool.release(1)
    with pytest.raises(ValueError, match="block 2 is free; allocate it"):
        pool.retain(2)
    with pytest.raises(ValueError, match="block 0 is already parked"):
        pool.park(b)
    with pytest.raises(ValueError, match="block 3 is free; only written blocks"):
        pool.park(3)
    with pytest.raises(ValueError, match="block 1 is not parked"):
        pool.unpark(1)
    with pytest.raises(ValueError, match="cannot allocate a negative number"):
        pool.allocate(-1)
    assert (list(pool.refcounts), set(pool.parked), pool.stats()) == before
    pool.check_invariants(tables=[[b]])


@pytest.mark.parametrize("method", ["retain", "release", "park", "retain_all", "release_all"])
@pytest.mark.parametrize("block_id", [-1, 4, 100])
def test_out_of_range_id_raises(method, block_id):
    """Ids outside 0..capacity-1 are refused with the valid range in the message."""
    pool = BlockPool(4, 4)
    pool.allocate(4)
    with pytest.raises(ValueError, match=r"outside the pool \(0\.\.3\)"):
        getattr(pool, method)([block_id] if method.endswith("_all") else block_id)


def test_bulk_retain_and_release_refuse_what_one_at_a_time_does():
    """retain_all and release_all raise retain's and release's errors, at the bad block."""
    pool = BlockPool(4, 4)
    a, b = pool.allocate(2)
    parked_and_cached(pool, [b])
    with pytest.raises(ValueError, match="block 2 is free; allocate it"):
        pool.retain_all([a, 2])
    with pytest.raises(ValueError, match="block 3 is already free; it was released twice"):
        pool.release_all([3])
    with pytest.raises(ValueError, match="block 1 is held only by the prefix index"):
        pool.release_all([b])
    assert pool.refcount(a) == 2  # retained before the bad block
    pool.check_invariants(tables=[[a], [a]])


def test_tiered_bulk_calls_match_one_at_a_time_per_tier():
    """A tiered pool's retain_all/release_all split the ids by tier; each tier's blocks are
    released last first, as release_all does, and counted as shares."""
    pools = [TieredBlockPool(4, 4, cold_blocks=4) for _ in range(2)]
    for pool in pools:
        hot = pool.allocate(4)
        cold = [pool.migrate(b) for b in hot[:2]]
        parked_and_cached(pool, hot[2:] + cold)
    table = [COLD, 2, COLD + 1, 3]
    one, bulk = pools
    shares = bulk.shares
    for x in table:
        one.retain(x)
    bulk.retain_all(table)
    assert bulk.shares - shares == len(table)
    for x in reversed(table):
        one.release(x)
    bulk.release_all(table)
    assert [p.refcounts for p in pools] == [one.refcounts] * 2
    assert [list(p._cached) for p in pools] == [list(one._cached)] * 2
    assert [list(p.cold._cached) for p in pools] == [list(one.cold._cached)] * 2
    assert list(bulk.cold._cached) == [1, 0] and list(bulk._cached) == [3, 2]


def test_release_of_a_cached_block_is_refused():
    """Only the index holds a cached block, so a sequence's release is a misuse."""
    pool = BlockPool(2, 4)
    parked_and_cached(pool, pool.allocate(1))
    with pytest.raises(ValueError):
        pool.release(0)


def test_check_invariants_catches_wrong_refcounts():
    """The checker the other tests rely on does fail on a refcount mismatch."""
    pool = BlockPool(4, 4)
    pool.allocate(2)
    with pytest.raises(AssertionError, match="block 1: refcount 1, but 2 holders"):
        pool.check_invariants(tables=[[0, 1], [1]])
    pool.refcounts[3] = 1  # corrupt: a free block with a holder
    with pytest.raises(AssertionError, match="block 3"):
        pool.check_invariants()


# ---- property test --------------------------------------------------------


class BlockPoolMachine(RuleBasedStateMachine):
    """Random allocate/retain/release/park/unpark sequences against a plain model.

    The model keeps the free list (FIFO), the cached blocks (oldest first), the
    parked set and the holders' tables, and predicts exact ids and evictions.
    """

    @initialize(num_blocks=st.sampled_from([None, 1, 2, 4, 6]))
    def make_pool(self, num_blocks):
        self.evicted: list[int] = []
        self.pool = BlockPool(num_blocks, 4, on_evict=self.evicted.append)
        self.growable = num_blocks is None
        self.capacity = num_blocks or 0
        self.free = deque(range(self.capacity))
        self.cached: list[int] = []
        self.parked: set[int] = set()
        self.tables: list[list[int]] = []
        self.allocate(1)  # start with one sequence so that most rules apply

    # ---- model helpers ----

    def refcount(self, b: int) -> int:
        return sum(t.count(b) for t in self.tables) + (b in self.parked)

    def held(self) -> list[int]:
        return [b for b in range(self.capacity) if self.refcount(b) > 0]

    def settle(self, b: int) -> None:
        rc = self.refcount(b)
        if rc == 0:
            self.free.append(b)
        elif rc == 1 and b in self.parked:
            self.cached.append(b)

    def snapshot(self):
        return (list(self.pool.refcounts), set(self.pool.parked), self.pool.stats())

    # ---- rules ----

    @rule(n=st.integers(0, 6))
    def allocate(self, n):
        if n > len(self.free) + len(self.cached) and not self.growable:
            before = self.snapshot()
            assert self.pool.allocate(n) is None
            assert self.snapshot() == before
            return
        if n > len(self.free) + len(self.cached):
            grow = max(n - len(self.free) - len(self.cached), int(self.capacity * GROWTH))
            self.free.extend(range(self.capacity, self.capacity + grow))
            self.capacity += grow
        expected_evicted = []
        while len(self.free) < n:
            b = self.cached.pop(0)
            self.parked.discard(b)
            expected_evicted.append(b)
            self.free.append(b)
        if expected_evicted:
            event("allocation evicted cached blocks")
        expected = [self.free.popleft() for _ in range(n)]
        self.evicted.clear()
        assert self.pool.allocate(n) == expected
        assert self.evicted == expected_evicted
        if expected:
            self.tables.append(expected)

    @rule(n=st.integers(0, 12))
    def make_room(self, n):
        """Room for n blocks: a growable pool short of them grows as allocate(n) would."""
        if self.growable and n > len(self.free) + len(self.cached):
            grow = max(n - len(self.free) - len(self.cached), int(self.capacity * GROWTH))
            self.free.extend(range(self.capacity, self.capacity + grow))
            self.capacity += grow
        before = (list(self.pool.refcounts), set(self.pool.parked), self.pool.num_cached)
        self.pool.make_room(n)
        assert self.pool.capacity == self.capacity and self.pool.num_free == len(self.free)
        assert (self.pool.refcounts[: len(before[0])], self.pool.parked) == before[:2]
        assert self.pool.num_cached == before[2]  # nothing evicted
        assert self.pool.can_allocate(n) or not self.growable

    @rule(n=st.integers(0, 8), least=st.sampled_from([1, 4]))
    def ready_run(self, n, least):
        """Evict until n are free (never grow), then the first run of n consecutive free
        ids (else the run at the pool's end, else the first longest) heads the free list;
        fewer than ``least``: nothing."""
        evicted = []
        if n >= least and (self.growable or n <= len(self.free) + len(self.cached)):
            while len(self.free) < n and self.cached:
                b = self.cached.pop(0)
                self.parked.discard(b)
                evicted.append(b)
                self.free.append(b)
            if self.free:
                ids = sorted(self.free)
                runs = []  # (first index, length)
                for i, b in enumerate(ids):
                    if i and b == ids[i - 1] + 1:
                        runs[-1] = (runs[-1][0], runs[-1][1] + 1)
                    else:
                        runs.append((i, 1))
                fit = [r for r in runs if r[1] >= n]
                if not fit and ids[-1] == self.capacity - 1:
                    fit = runs[-1:]
                at = (fit or [max(runs, key=lambda r: r[1])])[0][0]
                self.free = deque(ids[at:] + ids[:at])
                if fit and fit[0][1] >= n:
                    event("a run of n consecutive free ids")
                    head = list(self.free)[:n]
                    assert head == list(range(head[0], head[0] + n))
        self.evicted.clear()
        ready_run(self.pool, n, least)
        assert self.evicted == evicted
        assert list(self.pool._free) == list(self.free)

    @precondition(lambda self: self.held())
    @rule(data=st.data())
    def retain(self, data):
        b = data.draw(st.sampled_from(self.held()))
        if self.tables and data.draw(st.booleans()):
            data.draw(st.sampled_from(self.tables)).append(b)
        else:
            self.tables.append([b])
        if b in self.cached:
            self.cached.remove(b)
        self.pool.retain(b)

    @precondition(lambda self: self.tables)
    @rule(data=st.data())
    def release(self, data):
        table = data.draw(st.sampled_from(self.tables))
        b = table.pop(data.draw(st.integers(0, len(table) - 1)))
        if not table:
            self.tables.remove(table)
        self.pool.release(b)
        self.settle(b)

    @precondition(lambda self: self.tables)
    @rule(data=st.data())
    def release_all(self, data):
        i = data.draw(st.integers(0, len(self.tables) - 1))
        table = self.tables[i]
        self.pool.release_all(table)
        while table:
            self.settle(table.pop())
        del self.tables[i]

    @precondition(lambda self: self.tables)
    @rule(data=st.data())
    def detach(self, data):
        """A finished sequence parks its blocks and releases them, like the prefix index."""
        i = data.draw(st.integers(0, len(self.tables) - 1))
        table = self.tables[i]
        for b in table:
            if b not in self.parked:
                self.pool.park(b)
                self.parked.add(b)
        self.pool.release_all(table)
        while table:
            self.settle(table.pop())
        del self.tables[i]

    @precondition(lambda self: any(b not in self.parked for b in self.held()))
    @rule(data=st.data())
    def park(self, data):
        b = data.draw(st.sampled_from([b for b in self.held() if b not in self.parked]))
        self.pool.park(b)
        self.parked.add(b)

    @precondition(lambda self: self.parked)
    @rule(data=st.data())
    def unpark(self, data):
        b = data.draw(st.sampled_from(sorted(self.parked)))
        self.pool.unpark(b)
        self.parked.discard(b)
        if b in self.cached:
            self.cached.remove(b)
        self.settle(b)

    @precondition(lambda self: self.free)
    @rule(data=st.data())
    def misuse_free_block(self, data):
        b = data.draw(st.sampled_from(list(self.free)))
        before = self.snapshot()
        for op in (self.pool.release, self.pool.retain, self.pool.park):
            with pytest.raises(ValueError):
                op(b)
        assert self.snapshot() == before

    # ---- checks after every step ----

    @invariant()
    def matches_model(self):
        self.pool.check_invariants(tables=self.tables)
        assert self.pool.capacity == self.capacity
        assert self.pool.refcounts == [self.refcount(b) for b in range(self.capacity)]
        assert self.pool.parked == self.parked
        assert (self.pool.num_free, self.pool.num_cached) == (len(self.free), len(self.cached))


BlockPoolMachine.TestCase.settings = settings(
    max_examples=100, stateful_step_count=50, deadline=None
)
test_block_pool_machine = BlockPoolMachine.TestCase
