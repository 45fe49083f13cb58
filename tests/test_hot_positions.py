"""A table's kept hot positions (``blocks/hot.py``) against a full scan of its ids, through
every change the block tables make: appends with and without a version bump, copy-on-write,
trims from either end, holes, forks, releases and migrations to the cold tier. The same
changes check ``steps_until_due`` against tokens appended one at a time, and its promise
that, while a table does not shrink, only a copy on write brings its next batch nearer
than its growth does."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from mlx_paged.blocks import COLD, HOLE, BlockTables, TieredBlockPool
from mlx_paged.blocks.hot import hot_positions, repoint

BLOCK = 4
HOT = 6  # tokens of each table's hot tail


def scan(blocks: list[int]) -> list[int]:
    return [i for i, b in enumerate(blocks) if 0 <= b < COLD]


def tokens_until_due(t, batch: int) -> int:
    """Tokens appended one at a time (new blocks are hot) until ``batch`` hot blocks lie
    behind the hot tail."""
    hot = scan(t.blocks) + list(range(len(t.blocks), len(t.blocks) + batch))
    k = 0
    while sum(p < (t.lengths[0] + k - HOT) // BLOCK - t.first for p in hot) < batch:
        k += 1
    return k


class HotPositionsMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.pool = TieredBlockPool(None, BLOCK)
        self.tables = BlockTables(1, BLOCK, pool=self.pool)
        self.live = [self.tables.new_table()]
        self.promised = {}  # per batch, each table's (table, tokens until due, tokens taken)
        self.taken = {}  # per table, tokens appended so far
        self.copied = 0

    def _grow(self, table, n, bump):
        start = table.lengths[0]
        if bump:
            self.tables.reserve(table, start, start + n)
        else:  # as a table filled from the prefix index or the disk tier is
            table.blocks.extend(self.pool.allocate(self.tables._missing(table, start + n)))
        table.lengths[0] = start + n
        self.taken[id(table)] = self.taken.get(id(table), 0) + n

    @rule(i=st.integers(0, 7), n=st.integers(1, 9), bump=st.booleans())
    def write(self, i, n, bump):
        self._grow(self.live[i % len(self.live)], n, bump)

    @rule(i=st.integers(0, 7))
    def fork(self, i):
        self.live.append(self.tables.fork(self.live[i % len(self.live)]))

    @precondition(lambda self: len(self.live) > 1)
    @rule(i=st.integers(0, 7))
    def release(self, i):
        self.tables.release(self.live.pop(i % len(self.live)))

    @rule(i=st.integers(0, 7), cut=st.integers(0, 12))
    def truncate(self, i, cut):
        t = self.live[i % len(self.live)]
        self.tables.truncate(t, 0, max(t.first * BLOCK, t.lengths[0] - cut))
        for batch in (1, 2, 3):  # a table that shrinks may get hot blocks where cold ones were
            self.promised.pop((id(t), batch), None)

    @rule(i=st.integers(0, 7), upto=st.integers(0, 12))
    def drop_before(self, i, upto):
        t = self.live[i % len(self.live)]
        position = min(upto * BLOCK // 2, t.lengths[0])
        if HOLE not in t.blocks[: position // BLOCK - t.first]:  # windows keep no holes
            self.tables.drop_before(t, position)

    @rule(i=st.integers(0, 7), a=st.integers(0, 40), n=st.integers(0, 12))
    def drop_range(self, i, a, n):
        t = self.live[i % len(self.live)]
        start = max(a, t.first * BLOCK)
        self.tables.drop_range(t, start, min(start + n, t.lengths[0]))

    @rule(i=st.integers(0, 7), at=st.integers(0, 40))
    def copy_on_write(self, i, at):
        t = self.live[i % len(self.live)]
        shared = [j for j, b in enumerate(t.blocks) if b != HOLE and self.pool.is_shared(b)]
        if shared:
            self.tables.copy_on_write_block(t, shared[at % len(shared)])

    @rule(batch=st.integers(1, 3))
    def migrate(self, batch):
        """As ``KVPool.maybe_migrate`` does, on every live table."""
        if self.tables.steps_until_due(self.live, HOT, batch) <= 0:
            due = [b for t in self.live for b in self.tables.cold_candidates(t, HOT)]
            self.tables.migrate(due)

    @rule(i=st.integers(0, 7), k=st.integers(0, 3))
    def migrate_some(self, i, k):
        """Any hot blocks, not only the ones behind a tail, and shared ones among them."""
        t = self.live[i % len(self.live)]
        hot = [b for b in t.blocks if 0 <= b < COLD]
        self.tables.migrate(hot[k : 2 * k + 1])

    @invariant()
    def positions_match_a_scan(self):
        for t in self.live:
            assert hot_positions(t) == scan(t.blocks)
            n = (t.lengths[0] - HOT) // BLOCK - t.first
            expect = [b for b in t.blocks[: max(n, 0)] if 0 <= b < COLD]
            assert self.tables.cold_candidates(t, HOT) == expect
            for batch in (1, 2, 3):
                steps = self.tables.steps_until_due([t], HOT, batch)
                assert (steps <= 0) == (len(expect) >= batch)
                assert max(steps, 0) == tokens_until_due(t, batch)
                taken = self.taken.get(id(t), 0)
                was, before, then = self.promised.get((id(t), batch), (None, 0, 0))
                if was is t and self.tables.copied == self.copied:
                    assert steps >= before - (taken - then)
                self.promised[id(t), batch] = (t, steps, taken)
            assert self.tables.steps_until_due(self.live, HOT, 2) == min(
                self.tables.steps_until_due([t], HOT, 2) for t in self.live
            )
        self.copied = self.tables.copied
        self.pool.check_invariants([t.blocks for t in self.live])


TestHotPositions = HotPositionsMachine.TestCase
TestHotPositions.settings = settings(max_examples=150, stateful_step_count=30, deadline=None)


def test_repoint_moves_every_copy_of_a_block_and_keeps_the_rest():
    pool = TieredBlockPool(None, BLOCK)
    tables = BlockTables(1, BLOCK, pool=pool)
    t = tables.new_table()
    t.blocks.extend(pool.allocate(4))
    t.blocks.append(HOLE)
    t.blocks.append(t.blocks[1])  # the same id twice
    pool.retain(t.blocks[1])
    before = t.version
    assert not repoint(t, {99: COLD + 7})  # holds none of them: nothing changes
    assert t.version == before
    b1 = t.blocks[1]
    cold = pool.migrate(b1)  # the pool's move; the table still holds the hot id
    assert repoint(t, {b1: cold})
    assert t.blocks == [0, cold, 2, 3, HOLE, cold]
    assert t.version == before + 1
    assert hot_positions(t) == [0, 2, 3] == scan(t.blocks)
