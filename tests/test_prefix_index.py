"""PrefixIndex on plain BlockPools: exact block ids, refcounts and eviction order."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from mlx_paged.blocks import BlockPool, PrefixIndex

BS = 4


def make(num_blocks: int = 16, windows=(None,)):
    pools = [BlockPool(num_blocks, BS) for _ in windows]
    return pools, PrefixIndex(pools, list(windows))


def write(pool: BlockPool, n_tokens: int) -> list[int]:
    """A sequence's table after writing ``n_tokens`` (fresh blocks)."""
    return pool.allocate(-(-n_tokens // BS))


def finish(pools, index, tokens, tables, length=None):
    """Detach: park, then release the sequence's references."""
    index.insert(tokens, [(0, t) for t in tables], length=length)
    for pool, table in zip(pools, tables, strict=True):
        pool.release_all(table)


def test_match_full_blocks_and_partial_tail():
    (pool,), index = make()
    tokens = list(range(10))  # blocks [0..3] [4..7] [8, 9]
    table = write(pool, 10)
    assert table == [0, 1, 2]
    finish([pool], index, tokens, [table])
    assert pool.refcounts[:3] == [1, 1, 1] and pool.num_cached == 3
    index.check_invariants()

    m = index.match(list(range(10)) + [99])
    assert (m.length, m.blocks, m.firsts) == (10, [[0, 1, 2]], [0])
    m = index.match([0, 1, 2, 3, 4, 5, 77])  # diverges mid-block: token granularity
    assert (m.length, m.blocks) == (6, [[0, 1]])
    m = index.match([0, 1, 2, 3, 4, 5, 6, 7, 8])  # shorter than the cached partial tail
    assert (m.length, m.blocks) == (9, [[0, 1, 2]])
    assert index.match([5, 6]) is None
    assert index.match([]) is None
    assert pool.refcounts[:3] == [1, 1, 1], "match must not take references"


def test_duplicate_blocks_are_not_parked_twice():
    (pool,), index = make()
    tokens = list(range(8))
    first = write(pool, 8)
    finish([pool], index, tokens, [first])
    second = write(pool, 8)  # same tokens computed again elsewhere
    assert second == [2, 3]
    assert index.insert(tokens, [(0, second)]) == 0
    pool.release_all(second)
    assert pool.num_free == 14 and pool.num_cached == 2
    assert index.match(tokens + [1]).blocks == [[0, 1]]
    index.check_invariants()


def test_longer_tail_replaces_the_partial_it_extends():
    (pool,), index = make()
    short = write(pool, 6)
    finish([pool], index, list(range(6)), [short])
    longer = write(pool, 7)
    assert longer == [2, 3]
    # The longer sequence shares block 0 with the index (adopted), then its own tail.
    finish([pool], index, list(range(7)), [longer])
    assert index.match(list(range(7)) + [50]).blocks == [[0, 3]]
    assert pool.refcounts[1] == 0, "the redundant partial block went back to the free list"
    index.check_invariants()


def test_eviction_is_lru_and_takes_leaves_first():
    (pool,), index = make(num_blocks=5)
    a = write(pool, 8)  # tokens 0..7
    finish([pool], index, list(range(8)), [a])
    # b shares a's first block, then diverges
    pool.retain(0)
    b = [0, *pool.allocate(1)]
    finish([pool], index, [0, 1, 2, 3, 40, 41, 42, 43], [b])
    assert pool.num_cached == 3 and pool.num_free == 2
    got = pool.allocate(3)
    # Free blocks first, then the oldest cached leaf: a's tail (block 1).
    assert got == [3, 4, 1]
    assert index.match(list(range(8))).length == 4
    assert index.match([0, 1, 2, 3, 40, 41, 42, 43]).length == 8
    index.check_invariants()


def test_evicting_a_full_block_drops_its_subtree():
    (pool,), index = make(num_blocks=3)
    a = write(pool, 12)
    index.insert(list(range(12)), [(0, a)])
    for b in (1, 2, 0):  # the middle block becomes the oldest cached one
        pool.release(b)
    # Evicting block 1 orphans block 2, so the index gives both back.
    assert pool.allocate(1) == [2]
    assert (pool.num_free, pool.num_cached, pool.refcounts) == (1, 1, [1, 0, 1])
    assert index.match(list(range(12))).length == 4
    assert index.num_blocks == 1
    index.check_invariants()


def test_window_group_needs_only_the_blocks_in_the_window():
    pools, index = make(windows=(None, 6))
    full, win = pools
    tokens = list(range(16))
    t_full = write(full, 16)
    t_win = write(win, 16)
    # The windowed layer gave back blocks 0 and 1 while it ran.
    win.release(t_win[0])
    win.release(t_win[1])
    index.insert(tokens, [(0, t_full), (2, t_win[2:])])
    full.release_all(t_full)
    win.release_all(t_win[2:])
    m = index.match(tokens + [7])
    # A continuation at 16 reads from 16 - 6 + 1 = 11: window blocks from 2.
    assert (m.length, m.blocks, m.firsts) == (16, [[0, 1, 2, 3], [2, 3]], [0, 2])
    # At length 8 it would need window block 0, which is gone.
    assert index.match(list(range(8)) + [99]) is None or index.match(list(range(8))).length < 8
    index.check_invariants()


def test_bad_arguments():
    with pytest.raises(ValueError, match="one window"):
        PrefixIndex([BlockPool(4, BS)], [None, 8])
    with pytest.raises(ValueError, match="block size"):
        PrefixIndex([BlockPool(4, 4), BlockPool(4, 8)], [None, 8])
    (pool,), index = make()
    with pytest.raises(ValueError, match="expected 1 tables"):
        index.insert([1, 2], [])
    with pytest.raises(ValueError, match="outside"):
        index.insert([1, 2], [(0, [])], length=5)


# ---- property test --------------------------------------------------------

TOKENS = st.lists(st.integers(0, 3), min_size=1, max_size=14)


class PrefixIndexMachine(RuleBasedStateMachine):
    """Sequences adopt, write, finish; blocks get evicted. The index never lies.

    The model: every parked block's contents are the tokens its sequence wrote,
    kept in ``content``. A match is checked against it token by token.
    """

    def __init__(self):
        super().__init__()
        self.pool = BlockPool(12, BS)
        self.index = PrefixIndex([self.pool], [None])
        self.content: dict[int, tuple[int, ...]] = {}  # block -> tokens written into it
        self.live: list[tuple[list[int], list[int]]] = []  # (tokens, table)

    @rule(tokens=TOKENS)
    def start(self, tokens):
        m = self.index.match(tokens[:-1])
        hit = m.length if m else 0
        table = []
        if m:
            for b in m.blocks[0]:
                self.pool.retain(b)
                table.append(b)
            for i, b in enumerate(table):  # adopted K/V matches the tokens
                lo = i * BS
                n = min(BS, hit - lo)
                assert self.content[b][:n] == tuple(tokens[lo : lo + n])
        # Write the rest: copy a shared partial tail, then fresh blocks.
        need = -(-len(tokens) // BS) - len(table)
        cow = 1 if hit % BS and self.pool.is_shared(table[-1]) else 0
        if need + cow > self.pool.num_available:
            self.pool.release_all(table)
            return
        if cow:
            (new,) = self.pool.allocate(1)
            self.content[new] = self.content[table[-1]][: hit % BS]
            self.pool.release(table[-1])
            table[-1] = new
        table += self.pool.allocate(need)
        for i, b in enumerate(table):
            lo = i * BS
            have = self.content.get(b, ()) if i * BS < hit else ()
            have = have[: max(0, hit - lo)]
            self.content[b] = have + tuple(tokens[lo + len(have) : lo + BS])
        self.live.append((tokens, table))

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 100), partial=st.booleans())
    def finish(self, i, partial):
        tokens, table = self.live.pop(i % len(self.live))
        self.index.insert(tokens, [(0, table)], partial=partial)
        self.pool.release_all(table)

    @rule(n=st.integers(1, 4))
    def pressure(self, n):
        ids = self.pool.allocate(n)
        if ids is not None:
            for b in ids:
                self.content.pop(b, None)
            self.pool.release_all(ids)

    @invariant()
    def consistent(self):
        self.pool.check_invariants(tables=[t for _, t in self.live])
        self.index.check_invariants()


PrefixIndexMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=30)
test_prefix_index_machine = PrefixIndexMachine.TestCase
