"""Two tiers of block ids: full-precision (hot) blocks and quantized (cold) ones.

A cold block holds the same tokens as the hot block it came from, quantized,
in separate storage with its own capacity. Its id is its slot in that storage
plus ``COLD``, so one glance at an id tells the tier, and block tables, the
prefix index and refcounts work on both alike. A block moves to the cold tier
once (``TieredBlockPool.migrate``): it gets a cold id with the same holders, and
every holder's table is re-pointed. Nothing ever writes a cold block: it counts
as shared, so a writer copies it into a fresh hot block first. Pure Python.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from .pool import BlockPool, PagedCacheStats

#: Ids at or above this name cold blocks: slot ``id - COLD`` of the cold storage.
COLD = 1 << 30


def is_cold(block_id: int) -> bool:
    """Whether ``block_id`` names a cold (quantized) block."""
    return block_id >= COLD


@dataclass(frozen=True)
class TierStats:
    """Both tiers of a pool: blocks held (by sequences or the prefix index), bytes, moves.

    ``compression`` is how many times smaller a cold block is than a hot one
    (0 before the first cold block).
    """

    hot_blocks: int
    cold_blocks: int
    cold_cached_blocks: int
    cold_capacity: int
    block_size: int
    hot_bytes: int
    cold_bytes: int
    migrations: int

    @property
    def hot_tokens(self) -> int:
        """Token slots of the held hot blocks."""
        return self.hot_blocks * self.block_size

    @property
    def cold_tokens(self) -> int:
        """Token slots of the held cold blocks."""
        return self.cold_blocks * self.block_size

    @property
    def compression(self) -> float:
        hot = self.hot_bytes / max(self.hot_blocks, 1)
        cold = self.cold_bytes / self.cold_blocks if self.cold_blocks else 0
        return hot / cold if cold and hot else 0.0


class TieredBlockPool(BlockPool):
    """A ``BlockPool`` of hot blocks with a second pool of cold ones beside it.

    Allocation always gives hot blocks; ``migrate`` moves a hot block's
    holders to a new cold id. Every other call takes ids of either tier.

    Args:
        num_blocks: Hot capacity, or ``None`` to grow on demand.
        block_size: Token slots per block.
        cold_blocks: Cold capacity, or ``None`` to grow on demand.
        on_evict: As ``BlockPool``; called with cold ids too.
    """

    def __init__(
        self,
        num_blocks: int | None,
        block_size: int,
        cold_blocks: int | None = None,
        on_evict: Callable[[int], None] | None = None,
    ):
        self.cold = BlockPool(cold_blocks, block_size)
        self.migrations = 0
        #: Called with ``{old id: new id}`` as ``migrate`` moves a block (the prefix index
        #: re-points its entry; block tables are re-pointed by their ``BlockTables``).
        self.on_rename: Callable[[dict[int, int]], None] | None = None
        super().__init__(num_blocks, block_size, on_evict)

    @property
    def on_evict(self) -> Callable[[int], None] | None:
        return self._on_evict

    @on_evict.setter
    def on_evict(self, hook: Callable[[int], None] | None) -> None:
        self._on_evict = hook
        self.cold.on_evict = None if hook is None else (lambda c: hook(c + COLD))

    # ---- either tier ------------------------------------------------------

    def retain(self, block_id: int) -> None:
        if is_cold(block_id):
            self.cold.retain(block_id - COLD)
            self.shares += 1
        else:
            super().retain(block_id)

    def retain_all(self, block_ids: Iterable[int]) -> None:
        hot, cold = _by_tier(block_ids)
        super().retain_all(hot)
        self.cold.retain_all(cold)
        self.shares += len(cold)

    def release(self, block_id: int) -> None:
        if is_cold(block_id):
            self.cold.release(block_id - COLD)
        else:
            super().release(block_id)

    def release_all(self, block_ids: Iterable[int]) -> None:
        """Each tier's blocks last first, as ``BlockPool.release_all``."""
        hot, cold = _by_tier(block_ids)
        super().release_all(hot)
        self.cold.release_all(cold)

    def park(self, block_id: int) -> None:
        if is_cold(block_id):
            self.cold.park(block_id - COLD)
            self.shares += 1
        else:
            super().park(block_id)

    def unpark(self, block_id: int) -> None:
        if is_cold(block_id):
            self.cold.unpark(block_id - COLD)
        else:
            super().unpark(block_id)

    def is_shared(self, block_id: int) -> bool:
        """Cold blocks always: nothing writes one in place."""
        return is_cold(block_id) or super().is_shared(block_id)

    def refcount(self, block_id: int) -> int:
        """Holders of a block of either tier."""
        if is_cold(block_id):
            return self.cold.refcount(block_id - COLD)
        return super().refcount(block_id)

    def parked_ids(self) -> set[int]:
        return super().parked_ids() | {c + COLD for c in self.cold.parked}

    # ---- migration --------------------------------------------------------

    def migrate(self, block_id: int) -> int | None:
        """Give a live hot block's holders a cold id instead; return it.

        The cold id takes over the refcount and the parking; the hot id goes
        back to the free list (its K/V must be copied before the next
        allocation). Returns ``None``, changing nothing, when the cold tier is
        full and nothing in it can be evicted.
        """
        self._check_id(block_id)
        holders = self.refcounts[block_id]
        if is_cold(block_id) or holders == 0:
            raise ValueError(f"block {block_id} is not a live hot block.")
        got = self.cold.allocate(1)
        if got is None:
            return None
        c = got[0]
        self.cold.refcounts[c] = holders
        if block_id in self.parked:
            self.parked.discard(block_id)
            self._cached.pop(block_id, None)
            self.cold.parked.add(c)
            self.cold._settle(c)
        self.refcounts[block_id] = 0
        self._settle(block_id)
        self.shares += 1
        self.migrations += 1
        if self.on_rename is not None:
            self.on_rename({block_id: c + COLD})
        return c + COLD

    # ---- checks and stats -------------------------------------------------

    def tier_stats(self) -> TierStats:
        """Blocks and bytes held in each tier, and migrations so far."""
        hot, cold = self.capacity - self.num_free, self.cold.capacity - self.cold.num_free
        return TierStats(
            hot_blocks=hot,
            cold_blocks=cold,
            cold_cached_blocks=self.cold.num_cached,
            cold_capacity=self.cold.capacity,
            block_size=self.block_size,
            hot_bytes=hot * self.bytes_per_block,
            cold_bytes=cold * self.cold.bytes_per_block,
            migrations=self.migrations,
        )

    def stats(self) -> PagedCacheStats:
        """The hot tier's counts; ``bytes`` covers both tiers."""
        s = super().stats()
        cold = self.cold.capacity * self.cold.bytes_per_block
        return PagedCacheStats(
            s.total_blocks, s.live_blocks, s.cached_blocks, s.free_blocks, s.block_size,
            s.bytes + cold,
        )  # fmt: skip

    def check_invariants(self, tables: Iterable[Iterable[int]] | None = None) -> None:
        """``BlockPool.check_invariants`` for each tier; tables may hold ids of both."""
        if tables is None:
            super().check_invariants()
            self.cold.check_invariants()
            return
        tables = [list(t) for t in tables]
        super().check_invariants([[b for b in t if 0 <= b < COLD] for t in tables])
        self.cold.check_invariants([[b - COLD for b in t if is_cold(b)] for t in tables])


def _by_tier(block_ids: Iterable[int]) -> tuple[list[int], list[int]]:
    """Hot ids, and cold ones as their slots in the cold storage, each in their order."""
    ids = list(block_ids)
    if not ids or max(ids) < COLD:  # in C: a long prefix's thousands of hot ids
        return ids, []
    cold = [b - COLD for b in ids if b >= COLD]
    return ([b for b in ids if b < COLD] if cold else ids), cold
