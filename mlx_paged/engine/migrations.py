"""When a decode step asks the cold tier whether blocks are due, and when it need not.

Before every decode step the engine moves the blocks behind its requests' hot tails
to the cold tier once a batch is due (``KVPool.migrate_due``). Telling whether one
is due is a pass over every running table: 0.09-0.11 ms a step at 64 streams, most of
the cold tier's extra host time in a step that migrates nothing (BENCHMARKS.md, runs
589-591).

The pass also tells how many tokens every table can take, one a step, before one
could be due. That holds while the tables only grow by decode steps: no prefill
forward, the same requests running, and no block copied on write (the one change
that makes a block hot again). ``MigrationCheck`` counts the decode steps and skips
the pass until they are used up or one of those changes.
"""

from __future__ import annotations

import math
import operator

from ..blocks import LayerKind
from ..storage import KVPool
from .request import Request


class MigrationCheck:
    """Moves due blocks to the cold tier before decode steps, skipping the check while
    no table can have a batch due.

    Args:
        pools: The engine's K/V storage per layer group.
    """

    def __init__(self, pools: dict[LayerKind, KVPool]):
        self.pools = pools
        self.steps: float = 0  # decode steps left before a check is needed
        self.reqs: list[Request] = []  # the requests the count was made for
        self.copied = 0  # the pools' copy-on-write count then

    def migrate(self, reqs: list[Request]) -> int:
        """Quantize the blocks due for the cold tier in every request; return how many
        moved (none without a check)."""
        tiered = [(kind, pool) for kind, pool in self.pools.items() if pool.quant is not None]
        if not tiered:
            return 0
        copied = sum(pool.copied for _, pool in tiered)
        if self.steps > 0 and copied == self.copied and _same(reqs, self.reqs):
            return 0
        moved, steps = 0, math.inf
        for kind, pool in tiered:
            n, s = pool.migrate_due([r.tables[kind] for r in reqs])
            moved, steps = moved + n, min(steps, s)
        self.steps, self.reqs, self.copied = steps, list(reqs), copied
        return moved

    def decoded(self) -> None:
        """A decode step was built: every request in it takes one token."""
        self.steps -= 1

    def forwarded(self) -> None:
        """A prefill forward was built: its tables may take many tokens."""
        self.steps = 0


def _same(a: list[Request], b: list[Request]) -> bool:
    return len(a) == len(b) and all(map(operator.is_, a, b))
