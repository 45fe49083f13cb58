"""The prefix index's trie: its nodes, a sequence's place in it, and walks over it.

Pure Python: no MLX here.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from itertools import chain


@dataclass(eq=False, slots=True)
class Node:
    """One block of tokens in the trie: a full block, or a sequence's partial tail."""

    key: tuple[int, ...]  # this block's tokens; shorter than block_size for a partial tail
    blocks: list[int | None]  # block id per group
    parent: Node | None
    children: dict[tuple[int, ...], Node] = field(default_factory=dict)
    snapshot: int | None = None  # recurrent state at this node's end (``StateSlots`` id)
    alive: bool = True  # in the trie (``_remove`` clears it)


@dataclass(eq=False, slots=True)
class Cursor:
    """Where one sequence's full blocks were last found or indexed: the node of its
    ``depth``-th full block (``None``: the root). ``insert`` resumes there, so a long
    prompt's blocks are walked once, not at every forward. It starts over from the root
    where that would park a block the resumed walk would not: when the node has left the
    trie, or when a node kept a hole for a sliding-window block the index forgot since
    (``holes``: the index's count of those then)."""

    node: Node | None = None
    depth: int = 0
    holes: int = 0


def candidates(
    path: list[Node], length: int, bs: int, states: bool
) -> Iterator[tuple[int, int | None]]:
    """``(length, snapshot)`` a match may end at, longest first: the whole ``length``, then
    shorter block-aligned lengths (lazily: a long prompt has thousands, and the first
    usually holds); with ``states``, only where a node of ``path`` ends with a snapshot."""
    if not states:
        yield from ((m, None) for m in chain([length], range((length - 1) // bs * bs, 0, -bs)))
        return
    ends = [(i * bs + len(node.key), node) for i, node in enumerate(path)]
    for m, node in reversed(ends):
        if m <= length and node.snapshot is not None:
            yield m, node.snapshot


def first_needed(window: int | None, length: int, bs: int) -> int:
    """First logical block a continuation after ``length`` tokens reads in a group with
    ``window``."""
    return 0 if window is None else max(0, length - window + 1) // bs


def post_order(node: Node) -> list[Node]:
    """``node``'s subtree, each node after its children (in order). A loop, not recursion:
    a long prompt's chain is thousands of nodes deep."""
    order, stack = [], [(node, False)]
    while stack:
        n, expanded = stack.pop()
        if expanded:
            order.append(n)
        else:
            stack.append((n, True))
            stack.extend((c, False) for c in reversed(list(n.children.values())))
    return order


def node_tokens(node: Node) -> list[int]:
    """The tokens from the root through ``node`` (its blocks' keys gathered, then joined
    once: prepending each would move the whole list per block)."""
    keys = []
    while node.parent is not None:
        keys.append(node.key)
        node = node.parent
    return list(chain.from_iterable(reversed(keys)))


def node_at(root: Node, tokens: Sequence[int], length: int, bs: int) -> Node | None:
    """The node under ``root`` whose tokens end exactly at ``length``, or ``None``."""
    node = root
    for lo in range(0, length, bs):
        node = node.children.get(tuple(tokens[lo : min(lo + bs, length)]))
        if node is None:
            return None
    return node if node is not root else None


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def walk(
    root: Node, tokens: Sequence[int], bs: int, known: Sequence[Node] = ()
) -> tuple[list[Node], int]:
    """Nodes along the longest match of ``tokens`` under ``root`` and the tokens matched;
    the last node may match partly. ``known``: the nodes of ``tokens``' first full blocks,
    found before (the walk goes on from the last of them)."""
    path = list(known)
    node, pos = (path[-1], len(path) * bs) if path else (root, 0)
    rest = iter(tokens[pos:] if pos else tokens)
    for key in zip(*[rest] * bs, strict=False):  # each full block's tokens
        child = node.children.get(key)
        if child is None:
            break
        path.append(child)
        node, pos = child, pos + bs
    rest = tuple(tokens[pos : pos + bs])
    best, best_len = None, 0
    for key, c in node.children.items():
        n = common_prefix(key, rest)
        if n > best_len:
            best, best_len = c, n
    if best is not None:
        path.append(best)
    return path, pos + best_len


@dataclass(slots=True)
class RecentWalk:
    """The last match's walk: its sequence's full blocks' tokens and their nodes.

    A burst's prompts share a long prefix. Comparing a prompt with the last one is one
    list comparison in C, where a walk costs Python per block (2,048 of them for a
    32k-token prompt), so a prompt that begins with the last one's full blocks walks
    on from their last node. That node still in the trie means every node before it is
    (a node leaves with its subtree).
    """

    tokens: list[int] = field(default_factory=list)
    path: list[Node] = field(default_factory=list)

    def walk(self, root: Node, tokens: Sequence[int], bs: int) -> tuple[list[Node], int]:
        """``walk(root, tokens, bs)``, resumed where the last one's full blocks allow."""
        n = len(self.tokens)
        known = self.path if n and self.path[-1].alive and tokens[:n] == self.tokens else ()
        path, length = walk(root, tokens, bs, known)
        full = length // bs
        self.tokens, self.path = list(tokens[: full * bs]), path[:full]
        return path, length
