"""PrefixIndex on plain BlockPools: exact block ids, refcounts and eviction order."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from mlx_paged.blocks import BlockPool, Cursor, PrefixIndex
from mlx_paged.blocks.trie import RecentWalk

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


def test_a_chain_deeper_than_pythons_recursion_limit_is_evicted_and_cleared():
    n = 3000  # a 48k-token prompt at 16-token blocks
    (pool,), index = make(num_blocks=n + 1)
    a = write(pool, n * BS)
    index.insert(list(range(n * BS)), [(0, a)])
    pool.release(a[0])  # the root's block becomes the oldest cached one
    pool.release_all(a[1:])
    # Evicting the root's block drops the whole chain, the deepest block first.
    assert pool.allocate(2) == [n, n - 1]
    assert (pool.num_free, pool.num_cached, index.num_blocks) == (n - 1, 0, 0)
    index.check_invariants()
    pool.release_all([n, n - 1])
    b = write(pool, n * BS)
    index.insert(list(range(1, n * BS + 1)), [(0, b)])
    pool.release_all(b)
    index.clear()
    assert (pool.num_free, pool.num_cached, index.num_blocks) == (n + 1, 0, 0)
    assert index.match(list(range(1, n * BS + 1))) is None
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

    @rule()
    def clear(self):
        held = {b for _, table in self.live for b in table}
        self.index.clear()
        assert self.index.num_blocks == 0 and self.pool.num_cached == 0
        assert not self.pool.parked and self.index.match(list(range(2 * BS))) is None
        # Blocks the live tables hold stay theirs; every other block is free.
        assert self.pool.num_free == self.pool.capacity - len(held)
        assert all(self.pool.refcount(b) == sum(b in t for _, t in self.live) for b in held)

    @invariant()
    def consistent(self):
        self.pool.check_invariants(tables=[t for _, t in self.live])
        self.index.check_invariants()


PrefixIndexMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=30)
test_prefix_index_machine = PrefixIndexMachine.TestCase


def trie(index: PrefixIndex) -> dict[tuple[int, ...], tuple]:
    """Every node's tokens from the root, with its blocks."""
    out, stack = {}, [(index._root, ())]
    while stack:
        node, path = stack.pop()
        for key, child in node.children.items():
            out[path + key] = tuple(child.blocks)
            stack.append((child, path + key))
    return out


class CursorMachine(RuleBasedStateMachine):
    """Two worlds run the same sequences: one matches on from its last match's walk
    (``RecentWalk``) and inserts through each sequence's cursor (``PrefixMatch.cursor``,
    moved by every insert), the other walks from the root every time. Matches, block
    ids, refcounts and the trie stay the same in both."""

    windows: tuple = (None,)

    def __init__(self):
        super().__init__()
        self.pools = [[BlockPool(12, BS) for _ in self.windows] for _ in range(2)]
        self.indexes = [PrefixIndex(pools, list(self.windows)) for pools in self.pools]
        self.live: list[tuple[list[int], list, Cursor]] = []  # (tokens, spans per world, cursor)

    def _adopt(self, pools, m, tokens):
        """Spans ``(first, table)`` per group for ``tokens`` after match ``m``, or None."""
        spans, hit = [], m.length if m else 0
        for g, pool in enumerate(pools):
            first, table = (m.firsts[g], list(m.blocks[g])) if m else (0, [])
            pool.retain_all(table)
            need = -(-len(tokens) // BS) - first - len(table)
            cow = 1 if hit % BS and table and pool.is_shared(table[-1]) else 0
            if need + cow > pool.num_available:
                pool.release_all(table)
                for (_, t), p in zip(spans, pools, strict=False):
                    p.release_all(t)
                return None
            if cow:
                (new,) = pool.allocate(1)
                pool.release(table[-1])
                table[-1] = new
            spans.append((first, table + pool.allocate(need)))
        return spans

    @rule(tokens=TOKENS)
    def start(self, tokens):
        self.indexes[1]._recent = RecentWalk()  # the reference walks from the root
        matches = [index.match(tokens[:-1]) for index in self.indexes]
        found = [m and (m.length, m.blocks, m.firsts, m.cursor.depth) for m in matches]
        assert found[0] == found[1]
        spans = [self._adopt(p, m, tokens) for p, m in zip(self.pools, matches, strict=True)]
        assert (spans[0] is None) == (spans[1] is None)
        if spans[0] is not None:
            self.live.append((tokens, spans, matches[0].cursor if matches[0] else Cursor()))

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 100), upto=st.integers(0, 14))
    def written(self, i, upto):
        """A forward's blocks indexed (``Scheduler.index_written``): full blocks only."""
        tokens, spans, cursor = self.live[i % len(self.live)]
        length = min(upto, len(tokens))
        self.indexes[0].insert(tokens, spans[0], length, partial=False, cursor=cursor)
        self.indexes[1].insert(tokens, spans[1], length, partial=False)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 100), partial=st.booleans())
    def finish(self, i, partial):
        tokens, spans, cursor = self.live.pop(i % len(self.live))
        self.indexes[0].insert(tokens, spans[0], partial=partial, cursor=cursor)
        self.indexes[1].insert(tokens, spans[1], partial=partial)
        for pools, world in zip(self.pools, spans, strict=True):
            for pool, (_, table) in zip(pools, world, strict=True):
                pool.release_all(table)

    @rule(n=st.integers(1, 4), g=st.integers(0, 3))
    def pressure(self, n, g):
        for pools in self.pools:
            pool = pools[g % len(pools)]
            ids = pool.allocate(n)
            if ids is not None:
                pool.release_all(ids)

    @invariant()
    def same(self):
        for a, b in zip(*self.pools, strict=True):
            assert a.refcounts == b.refcounts and a.parked == b.parked
        assert trie(self.indexes[0]) == trie(self.indexes[1])
        self.indexes[0].check_invariants()


class WindowCursorMachine(CursorMachine):
    """The same with a sliding-window group beside the full one."""

    windows = (None, 6)


CursorMachine.TestCase.settings = settings(max_examples=80, stateful_step_count=30)
WindowCursorMachine.TestCase.settings = settings(max_examples=80, stateful_step_count=30)
test_inserts_through_a_cursor_equal_walks_from_the_root = CursorMachine.TestCase
test_with_a_window_group_too = WindowCursorMachine.TestCase


def test_a_cursor_resumes_where_its_last_insert_ended_and_restarts_once_its_node_is_gone():
    pools, index = make(16)
    tokens = list(range(12))
    table = write(pools[0], 12)
    cursor = Cursor()
    index.insert(tokens, [(0, table)], length=8, partial=False, cursor=cursor)
    assert cursor.depth == 2 and cursor.node.blocks == [table[1]]
    # The next insert starts at block 2: a cursor that claims more than the tokens have
    # is not trusted (it walks from the root).
    assert index.insert(tokens, [(0, table)], cursor=cursor) == 1
    assert cursor.depth == 3 and cursor.node.blocks == [table[2]]
    pools[0].release_all(table)
    # Evicting block 0 takes the whole path; the cursor's node left the trie.
    pools[0].allocate(16)
    assert not cursor.node.alive and index.num_blocks == 0
    pools[0].release_all(range(16))
    again = write(pools[0], 12)
    assert index.insert(tokens, [(0, again)], cursor=cursor) == 3
    m = index.match(tokens + [99])
    assert m.length == 12 and m.cursor.depth == 3 and m.cursor.node.blocks == [again[2]]


def test_a_cursor_on_another_sequences_evicted_blocks_walks_again_from_the_root():
    """S and X write the same tokens side by side; X finishes first, so S's forward finds
    X's blocks indexed and its cursor stands on them. X's blocks are evicted; S's finish
    parks S's own blocks from the root."""
    pools, index = make(8)
    pool, tokens = pools[0], list(range(8))
    s, x = write(pool, 8), write(pool, 8)
    cursor = Cursor()
    finish(pools, index, tokens, [x])
    index.insert(tokens, [(0, s)], length=8, partial=False, cursor=cursor)
    assert cursor.depth == 2 and cursor.node.blocks == [x[1]]  # X's node: S's block not parked
    assert pool.refcounts[s[0]] == pool.refcounts[s[1]] == 1
    pool.allocate(8 - 4)  # the 4 free blocks, then X's two cached ones
    pool.allocate(2)
    assert not cursor.node.alive and index.num_blocks == 0
    assert index.insert(tokens, [(0, s)], cursor=cursor) == 2
    assert index.match(tokens + [9]).blocks == [s] and cursor.node.blocks == [s[1]]


def test_a_cursor_past_a_forgotten_window_block_walks_again_from_the_root():
    """X's blocks are indexed first, so S's forward leaves S's own blocks unparked and its
    cursor on X's nodes. X's window blocks are evicted while its full blocks stay: S's
    finish parks S's window blocks in the holes, as a walk from the root would."""
    pools, index = make(8, windows=(None, 100))
    tokens = list(range(8))
    s, x = [write(p, 8) for p in pools], [write(p, 8) for p in pools]
    finish(pools, index, tokens, x)
    cursor = Cursor()
    index.insert(tokens, [(0, t) for t in s], length=8, partial=False, cursor=cursor)
    assert cursor.depth == 2 and cursor.node.blocks == [x[0][1], x[1][1]]
    pools[1].release_all(pools[1].allocate(6))  # 4 free, then X's two window blocks
    assert cursor.node.alive and cursor.node.blocks == [x[0][1], None]
    assert index.insert(tokens, [(0, t) for t in s], cursor=cursor) == 2
    assert trie(index) == {(0, 1, 2, 3): (x[0][0], s[1][0]), tuple(tokens): (x[0][1], s[1][1])}


def test_a_match_walks_on_from_the_last_ones_blocks_while_they_stay():
    pools, index = make(num_blocks=8)
    tokens = list(range(12))
    finish(pools, index, tokens, [write(pools[0], 12)])  # blocks 0, 1, 2
    assert index.match(tokens[:8] + [50, 51]).blocks == [[0, 1]]
    recent = index._recent
    assert recent.tokens == tokens[:8] and [n.blocks for n in recent.path] == [[0], [1]]
    assert index.match(tokens + [7]).blocks == [[0, 1, 2]]  # on from block 1's node
    assert [n.blocks for n in recent.path] == [[0], [1], [2]]
    # Eviction takes the last node (block 2), and the same tokens come back in block 3: a
    # walk on from the dead node would miss it.
    held = pools[0].allocate(6)
    assert not recent.path[-1].alive
    pools[0].release_all(held)
    table = pools[0].allocate(3)
    finish(pools, index, tokens, [table])  # parks only table[2]: 0 and 1 hold the rest
    assert index.match(tokens + [7]).blocks == [[0, 1, table[2]]]
    assert [pools[0].refcounts[b] for b in (0, 1, table[2])] == [1, 1, 1]
    assert index.match([9] + tokens) is None and recent.tokens == [] and recent.path == []
