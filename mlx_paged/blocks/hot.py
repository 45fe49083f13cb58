"""Where a block table's hot blocks sit, kept across appends and migrations.

The cold tier's bookkeeping asks every decode step whether a table has a batch of
blocks due, and at each migration which blocks are due and where they sit. A table
of a long sequence holds hundreds or thousands of blocks, nearly all of them cold,
and only its last few hot. Scanning every id in Python each time a table gains a
block, and again at every migration, cost 0.1-0.3 ms a step at 64 streams of 4k-16k
tokens (BENCHMARKS.md, "The cold tier's bookkeeping without scans").

``hot_positions`` keeps a table's hot positions with a copy of the ids it read them
from. A table whose ids only grew at the end since then (checked by comparing the
copy with the table's first ids, in C) has only its new ids scanned; any other change
scans it whole. ``repoint`` moves blocks to new ids at the kept positions and keeps
the positions right. The answer is always the one a full scan gives.
``steps_until_due`` reads the kept positions to tell how many tokens the tables can
take before one has a batch due.
"""

from __future__ import annotations

import math
from typing import Any, Protocol

from .tiers import COLD

_KEY = "hot_positions"


class BlockTable(Protocol):
    """What these functions read of a ``table.BlockTable``."""

    blocks: list[int]
    first: int
    lengths: list[int]
    version: int
    _derived: dict[str, tuple[Any, ...]]


def hot_positions(table: BlockTable) -> list[int]:
    """Ascending indices into ``table.blocks`` of its hot blocks (not cold, not holes)."""
    blocks = table.blocks
    held = table._derived.get(_KEY)
    if held is not None:
        version, first, seen, hot = held
        n = len(seen)
        if version == table.version and n == len(blocks):
            return hot
        if first == table.first and len(blocks) >= n and blocks[:n] == seen:
            hot = hot + [i for i in range(n, len(blocks)) if 0 <= blocks[i] < COLD]
            _keep(table, hot)
            return hot
    hot = [i for i, b in enumerate(blocks) if 0 <= b < COLD]
    _keep(table, hot)
    return hot


def repoint(table: BlockTable, moved: dict[int, int]) -> bool:
    """Give ``table``'s hot blocks that are keys of ``moved`` their new ids (which must
    not be hot ids) and bump its version; return whether it held any."""
    blocks = table.blocks
    hot = hot_positions(table)
    if moved.keys().isdisjoint(map(blocks.__getitem__, hot)):
        return False
    kept = []
    for i in hot:
        new = moved.get(blocks[i])
        if new is None:
            kept.append(i)
        else:
            blocks[i] = new
    table.version += 1
    _keep(table, kept)
    return True


def steps_until_due(
    tables: list[BlockTable], block_size: int, hot_tokens: int, batch: int
) -> float:
    """How many more tokens every one of ``tables`` can take, one a step, before ``batch``
    of one's hot blocks lie wholly behind its last ``hot_tokens`` tokens (0 or less: they
    do now; infinite for no table). It holds while tables only grow and none has a block
    copied on write: nothing else puts a hot block where a cold one was.

    While a table's blocks stay the same, one comparison of its lengths with the length
    at which its ``batch``-th hot block falls behind the hot tail. Runs every decode step
    over every running table, so the loop is kept lean."""
    least = math.inf
    for t in tables:
        key = (t.version, t.first, len(t.blocks), hot_tokens, batch)
        held = t._derived.get("cold_at")
        if held is None or held[0] != key:
            held = t._derived["cold_at"] = (key, _cold_at(t, block_size, hot_tokens, batch))
        if t.lengths and held[1] - min(t.lengths) < least:
            least = held[1] - min(t.lengths)
    return least


def _cold_at(table: BlockTable, block_size: int, hot_tokens: int, batch: int) -> float:
    """The least length of every layer at which ``batch`` hot blocks of ``table`` lie behind
    its hot tail. While it holds fewer, the least that blocks appended later could make
    it: beyond the tokens its blocks hold."""
    if batch <= 0:
        return -math.inf
    hot = hot_positions(table)
    if len(hot) < batch:
        return (len(table.blocks) + batch - len(hot) + table.first) * block_size + hot_tokens
    return (hot[batch - 1] + 1 + table.first) * block_size + hot_tokens


def _keep(table: BlockTable, hot: list[int]) -> None:
    table._derived[_KEY] = (table.version, table.first, list(table.blocks), hot)
