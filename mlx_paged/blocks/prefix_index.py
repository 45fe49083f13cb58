"""Prefix index: a radix trie from token prefixes to parked blocks.

Each trie node is one block of tokens: a full block (``block_size`` tokens) or
a sequence's partially filled tail. A node holds one block id per *group* (a
``BlockPool`` shared by a set of layers: the full-attention layers, or the
sliding-window layers of one window). Sliding-window groups give early blocks
back while a sequence runs, so their entries may be ``None``.

Every block the index holds is parked in its pool (one reference). When a pool
evicts a cached block it tells the index, which forgets it; a full-attention
block takes its whole subtree with it, since no prefix through it can be
rebuilt.

For a model with recurrent layers (``states``), a node may also hold a
snapshot of the recurrent state at its end (``StateSlots``). A prefix can be
adopted only up to a node that holds one, since the state cannot be rebuilt
from blocks; snapshots leave with their node, and a snapshot the state pool
evicts leaves its node.

With ``on_spill`` set, an eviction in a full-attention group first tells it of
every full block about to go (the evicted one and those below it): the tokens
through the block, its id per group (``None`` for a sliding-window group that
gave it back) and the snapshot ending there (or ``None``), so that a disk tier
can keep them. A sliding-window block about to go, and a snapshot the state pool
evicts, are told of the same way with their node, while its other blocks stay.
Pure Python: no MLX here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from .pool import BlockPool
from .states import StateSlots
from .trie import (
    Cursor,
    Node,
    RecentWalk,
    candidates,
    first_needed,
    node_at,
    node_tokens,
    post_order,
    walk,
)


@dataclass(frozen=True)
class PrefixMatch:
    """The longest cached prefix of a prompt that every group can serve.

    ``blocks[g]`` holds group ``g``'s block ids for logical blocks
    ``firsts[g] ..`` up to the one holding token ``length - 1``. The last block
    may be partially filled or shared: a writer must copy it first.
    ``snapshot`` is the recurrent state at ``length`` (models with recurrent
    layers only). ``cursor`` stands at the last full block of the match, for the
    adopting sequence's ``insert``s.
    """

    length: int
    blocks: list[list[int]]
    firsts: list[int]
    snapshot: int | None = None
    cursor: Cursor = field(default_factory=Cursor)


class PrefixIndex:
    """Finds and parks blocks by the tokens they hold.

    Args:
        pools: One ``BlockPool`` per group, all with the same block size. The
            index installs itself as each pool's ``on_evict`` hook.
        windows: Per group, the sliding window in tokens, or ``None`` for full
            attention.
        states: The recurrent-state snapshots of a hybrid model, or ``None``.
            The index installs itself as their ``on_evict`` hook.
    """

    def __init__(
        self,
        pools: Sequence[BlockPool],
        windows: Sequence[int | None],
        states: StateSlots | None = None,
    ):
        if len(pools) != len(windows) or not pools:
            raise ValueError("give one window (or None) per pool, and at least one pool.")
        sizes = {p.block_size for p in pools}
        if len(sizes) != 1:
            raise ValueError(f"all pools must share one block size, got {sorted(sizes)}.")
        self.block_size = sizes.pop()
        self.pools = list(pools)
        self.windows = list(windows)
        self._root = Node((), [None] * len(pools), None)
        self._owner: list[dict[int, Node]] = [{} for _ in pools]
        self.states = states
        self._snapshot_owner: dict[int, Node] = {}
        self._holes = 0  # sliding-window blocks forgotten by nodes that stay (``Cursor``)
        self._recent = RecentWalk()  # the last match's walk, which the next may resume
        self.on_spill: Callable[[list[int], list[int | None], int | None], None] | None = None
        if states is not None:
            states.on_evict = self._forget_snapshot
        for g, pool in enumerate(pools):
            pool.on_evict = lambda block_id, g=g: self._forget(g, block_id)
            if hasattr(pool, "on_rename"):  # a tiered pool re-points blocks it migrates
                pool.on_rename = lambda moved, g=g: self._rename(g, moved)

    # ---- public API -------------------------------------------------------

    def match(self, tokens: Sequence[int], states: bool = True) -> PrefixMatch | None:
        """The longest prefix of ``tokens`` whose K/V is cached, at token granularity (with
        recurrent states, ending where a snapshot does unless ``states`` is False).

        Returns ``None`` when nothing is cached. Does not take references: the caller
        retains the blocks it adopts."""
        path, length = self._recent.walk(self._root, tokens, self.block_size)
        bs = self.block_size
        # The longest candidate at which every group holds the blocks a continuation reads.
        for m, snapshot in candidates(path, length, bs, self.states is not None and states):
            if m <= 0:
                break
            hi = -(-m // bs)
            firsts = [first_needed(w, m, bs) for w in self.windows]
            blocks = [[n.blocks[g] for n in path[first:hi]] for g, first in enumerate(firsts)]
            if all(None not in group for group in blocks):
                full = m // bs
                cursor = Cursor(path[full - 1], full, self._holes) if full else Cursor()
                return PrefixMatch(m, blocks, firsts, snapshot, cursor)
        return None

    def insert(
        self,
        tokens: Sequence[int],
        tables: Sequence[tuple[int, Sequence[int]]],
        length: int | None = None,
        partial: bool = True,
        cursor: Cursor | None = None,
    ) -> int:
        """Park a sequence's blocks under the tokens they hold; return blocks newly parked.

        Args:
            tokens: The sequence's tokens; the first ``length`` have K/V written.
            tables: Per group, ``(first, blocks)``: ``blocks[i]`` holds logical
                block ``first + i``.
            length: Tokens with K/V (default: all of ``tokens``).
            partial: Also park a partially filled last block.
            cursor: This sequence's ``Cursor`` (its ``PrefixMatch.cursor``): the walk
                starts there, past blocks the caller holds, and moves it on.

        Blocks whose tokens are already indexed are left alone: the caller's
        reference to them stays the caller's.
        """
        if len(tables) != len(self.pools):
            raise ValueError(f"expected {len(self.pools)} tables, got {len(tables)}.")
        length = len(tokens) if length is None else length
        if not 0 <= length <= len(tokens):
            raise ValueError(f"length {length} is outside 0..{len(tokens)}.")
        bs = self.block_size
        full = length // bs
        node, skip = self._root, 0
        if cursor is not None and cursor.node is not None:
            if cursor.node.alive and cursor.holes == self._holes and cursor.depth <= full:
                node, skip = cursor.node, cursor.depth
        # The full blocks' tokens, each a tuple made in C: zip takes ``bs`` at a time.
        keys = list(zip(*[iter(tokens[skip * bs : full * bs])] * bs, strict=False))
        if partial and length > full * bs:
            keys.append(tuple(tokens[full * bs : length]))
        spans = [
            (g, first, blocks, self._owner[g], self.pools[g].park)
            for g, (first, blocks) in enumerate(tables)
        ]
        parked, groups = 0, len(self.pools)
        for i, key in enumerate(keys, skip):
            child = node.children.get(key)
            if child is None:
                if len(key) < bs and any(k[: len(key)] == key for k in node.children):
                    break  # a longer block already covers this partial tail
                child = node.children[key] = Node(key, [None] * groups, node)
                # Partial tails this block extends are redundant now.
                if len(node.children) > 1:
                    tails = [k for k in node.children if len(k) < len(key) and key[: len(k)] == k]
                    for k in tails:
                        self._remove(node.children[k])
            for g, first, blocks, owner, park in spans:
                if not 0 <= i - first < len(blocks) or child.blocks[g] is not None:
                    continue
                b = blocks[i - first]
                if b in owner:
                    continue  # indexed under other tokens (a partial adoption)
                park(b)
                child.blocks[g] = b
                owner[b] = child
                parked += 1
            node = child
            if cursor is not None and len(key) == bs:
                cursor.node, cursor.depth, cursor.holes = child, i + 1, self._holes
        self._prune(node)  # a last node that got no block leads nowhere
        return parked

    def add_snapshot(self, tokens: Sequence[int], length: int, take: Callable[[], int]) -> bool:
        """Give the node ending at ``length`` the snapshot ``take()`` makes, unless no node
        ends exactly there or it has one already; return whether it took one."""
        if self.states is None:
            raise ValueError("this index keeps no recurrent states.")
        node = node_at(self._root, tokens, length, self.block_size)
        if node is None or node.snapshot is not None:
            return False
        node.snapshot = take()
        self._snapshot_owner[node.snapshot] = node
        return True

    def full_blocks_matched(self, tokens: Sequence[int]) -> int:
        """Tokens of ``tokens`` whole indexed blocks cover from the start (snapshots aside)."""
        return walk(self._root, tokens, self.block_size)[1] // self.block_size * self.block_size

    def clear(self) -> None:
        """Forget every entry: their blocks and snapshots are unparked (freed where nothing
        else holds them) and nothing is spilled."""
        for child in list(self._root.children.values()):
            self._remove(child)

    @property
    def snapshots(self) -> list[int]:
        """Snapshot ids the index holds."""
        return list(self._snapshot_owner)

    @property
    def num_blocks(self) -> int:
        """Blocks the index holds, over all groups."""
        return sum(len(owner) for owner in self._owner)

    def check_invariants(self) -> None:
        """Assert that the index and the pools agree on every parked block."""
        for g, (pool, owner) in enumerate(zip(self.pools, self._owner, strict=True)):
            parked = pool.parked_ids()
            assert set(owner) == parked, (
                f"group {g}: index holds {sorted(owner)}, pool has parked {sorted(parked)}"
            )
            for b, node in owner.items():
                assert node.blocks[g] == b, f"group {g}: block {b} owned by a node that lost it"
        for sid, node in self._snapshot_owner.items():
            assert node.snapshot == sid, f"snapshot {sid} owned by a node that lost it"
        stack = [self._root]
        while stack:
            node = stack.pop()
            for key, child in node.children.items():
                assert child.key == key and child.parent is node, f"broken link at {key}"
                assert 0 < len(key) <= self.block_size, f"bad key length {len(key)}"
                assert len(key) == self.block_size or not child.children, "a partial has children"
                stack.append(child)

    # ---- internals --------------------------------------------------------

    def _forget_snapshot(self, snapshot: int) -> None:
        """State hook: a snapshot is being evicted."""
        node = self._snapshot_owner.pop(snapshot, None)
        if node is None:
            return
        if self.on_spill and _spillable(node, self.windows, self.block_size):
            self.on_spill(node_tokens(node), list(node.blocks), snapshot)  # the state is still here
        node.snapshot = None
        self._prune(node)

    def _forget(self, group: int, block_id: int) -> None:
        """Pool hook: a cached block is being reclaimed."""
        node = self._owner[group].get(block_id)
        if node is None:
            return
        if self.on_spill is not None and self.windows[group] is None:
            _spill(node, self.windows, self.block_size, self.on_spill)  # and its subtree
        elif self.on_spill is not None and _spillable(node, self.windows, self.block_size):
            self.on_spill(node_tokens(node), list(node.blocks), node.snapshot)  # with the window's
        del self._owner[group][block_id]
        node.blocks[group] = None
        if self.windows[group] is None:
            self._remove(node)
        else:
            self._holes += 1
            self._prune(node)

    def _rename(self, group: int, moved: dict[int, int]) -> None:
        """Pool hook: blocks got new ids (they moved to another tier)."""
        owner = self._owner[group]
        for old, new in moved.items():
            node = owner.pop(old, None)
            if node is not None:
                node.blocks[group] = new
                owner[new] = node

    def _remove(self, node: Node) -> None:
        """Drop a node and its subtree, each node's blocks unparked after its children's,
        then prune its parents."""
        for n in post_order(node):
            n.alive, n.children = False, {}
            for g, b in enumerate(n.blocks):
                if b is not None:
                    del self._owner[g][b]
                    n.blocks[g] = None
                    self.pools[g].unpark(b)
            if n.snapshot is not None:
                del self._snapshot_owner[n.snapshot]
                self.states.drop(n.snapshot)
                n.snapshot = None
        self._prune(node)

    def _prune(self, node: Node) -> None:
        """Remove a node that holds nothing and leads nowhere, and so on up its parents."""
        while node is not self._root and not node.children and _empty(node):
            node.alive, parent = False, node.parent
            if parent is None or parent.children.get(node.key) is not node:
                return
            del parent.children[node.key]
            node = parent


def _empty(node: Node) -> bool:
    """Whether ``node`` holds no block and no snapshot."""
    return node.snapshot is None and all(b is None for b in node.blocks)


def spill_parked(index: PrefixIndex) -> None:
    """Tell ``index.on_spill`` of every full block the index holds in every group."""
    bs = index.block_size
    for child in list(index._root.children.values()):
        if len(child.key) == bs and index.on_spill is not None:
            _spill(child, index.windows, bs, index.on_spill)


def path_blocks(index: PrefixIndex, tokens: Sequence[int], n: int) -> list[list[int | None]]:
    """The block per group of each of the first ``n`` full blocks of ``tokens`` the index
    holds (``n`` at most what ``full_blocks_matched`` covers)."""
    path, _ = walk(index._root, tokens[: n * index.block_size], index.block_size)
    assert len(path) >= n, f"the index holds {len(path)} of the {n} blocks asked for"
    return [list(node.blocks) for node in path[:n]]


def _spill(
    node: Node,
    windows: list[int | None],
    bs: int,
    spill: Callable[[list[int], list[int | None], int | None], None],
) -> None:
    """Tell ``spill`` of every full block at or under ``node`` that every full-attention
    group holds, parents first, with the snapshot ending there."""
    stack = [(node, node_tokens(node))]
    while stack:
        n, toks = stack.pop()
        if _spillable(n, windows, bs):
            spill(toks, list(n.blocks), n.snapshot)
        stack += [(c, toks + list(c.key)) for c in n.children.values() if len(c.key) == bs]


def _spillable(node: Node, windows: list[int | None], bs: int) -> bool:
    """Whether ``node`` is a full block that every full-attention group holds."""
    held = (b is not None for b, w in zip(node.blocks, windows, strict=True) if w is None)
    return len(node.key) == bs and all(held)
