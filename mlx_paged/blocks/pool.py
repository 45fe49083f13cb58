"""Block bookkeeping: ids, refcounts, the free list and the LRU of cached blocks.

Pure Python on purpose: the scheduler and the prefix index call this on every
step, and its tests run without a device.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np

#: A growable pool that runs short grows by its shortfall or by this fraction of its
#: capacity, whichever is more. Every layer's arrays are copied into larger ones then, old
#: and new alive at once: a quarter keeps that peak at 2.25x the pool and the unused
#: tail under a quarter, where doubling gave 3x and up to a half (measured in
#: BENCHMARKS.md, mlx-lm's batch_generate), for more, still geometric, copies.
GROWTH = 0.25


#: What ``retain`` and ``release`` say of a free block.
_RETAIN_FREE = "is free; allocate it instead of retaining it"
_RELEASE_FREE = "is already free; it was released twice"


class PoolExhaustedError(RuntimeError):
    """Raised when a write needs more blocks than the pool can free right now."""


class PoolTooSmallError(ValueError):
    """Raised when a sequence needs more blocks than a fixed-size pool holds at all."""


@dataclass(frozen=True)
class PagedCacheStats:
    """A snapshot of a block pool.

    ``live`` blocks are held by at least one sequence; ``cached`` blocks are
    held only by the prefix index (evictable); ``free`` blocks hold nothing.
    ``bytes`` is the device memory the pool's arrays occupy across all layers.
    """

    total_blocks: int
    live_blocks: int
    cached_blocks: int
    free_blocks: int
    block_size: int
    bytes: int


def check_block_size(block_size: object) -> int:
    """Return ``block_size`` if it is a positive int, else raise ValueError."""
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(
            f"block_size must be a positive int, got {block_size!r}; 16 is a good default."
        )
    return block_size


class BlockPool:
    """Owns block ids and their refcounts; nothing else changes them.

    A block's refcount counts the sequences whose block table holds it, plus
    one if it is parked (held by the prefix index). Parked blocks whose only
    holder is the index are *cached*: they stay findable until the pool needs
    their memory, then they are evicted least recently used first.

    Args:
        num_blocks: Capacity in blocks, or ``None`` to grow on demand.
        block_size: Token slots per block.
        on_evict: Called with a block id right before a cached block is
            reclaimed, so whoever parked it can forget it.
    """

    def __init__(
        self,
        num_blocks: int | None,
        block_size: int,
        on_evict: Callable[[int], None] | None = None,
    ):
        self.block_size = check_block_size(block_size)
        if num_blocks is not None and (
            isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks <= 0
        ):
            raise ValueError(
                f"num_blocks must be a positive int or None (grow on demand), got {num_blocks!r}."
            )
        self.growable = num_blocks is None
        self.capacity = 0
        self.refcounts: list[int] = []
        self.parked: set[int] = set()
        self.on_evict = on_evict
        self.bytes_per_block = 0
        # Counts every added holder (retain, park): a private block stays private while
        # this is unchanged, so writers may skip re-checking blocks they just reserved.
        self.shares = 0
        self._free: deque[int] = deque()
        self._cached: OrderedDict[int, None] = OrderedDict()  # oldest first
        self._grow(num_blocks or 0)

    # ---- public API -------------------------------------------------------

    @property
    def num_free(self) -> int:
        """Blocks that hold nothing."""
        return len(self._free)

    @property
    def num_cached(self) -> int:
        """Blocks held only by the prefix index."""
        return len(self._cached)

    @property
    def num_available(self) -> int:
        """Blocks an allocation could get now: free plus evictable."""
        return len(self._free) + len(self._cached)

    def can_allocate(self, n: int) -> bool:
        """Whether ``allocate(n)`` would succeed (growable pools always can)."""
        return self.growable or n <= self.num_available

    def make_room(self, n: int) -> None:
        """Grow a growable pool now, once, if ``allocate(n)`` would grow it: a caller that
        is about to take ``n`` blocks in several allocations spares the storage a copy per
        growth. A fixed pool is left as it is."""
        if self.growable and n > self.num_available:
            self._grow(max(n - self.num_available, int(self.capacity * GROWTH)))

    def allocate(self, n: int) -> list[int] | None:
        """Take ``n`` blocks with refcount 1, evicting cached blocks if needed.

        Returns ``None`` (back-pressure) when the pool cannot supply ``n``
        blocks even after evicting every cached block; nothing changes then.
        """
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of blocks ({n}).")
        if n > self.num_available:
            if not self.growable:
                return None
            self.make_room(n)
        while len(self._free) < n:
            self._evict_one()
        ids = [self._free.popleft() for _ in range(n)]
        for b in ids:
            assert self.refcounts[b] == 0, (
                f"block {b} on the free list has refcount {self.refcounts[b]}"
            )
            self.refcounts[b] = 1
        return ids

    def retain(self, block_id: int) -> None:
        """Add a holder to a live or cached block."""
        if not 0 <= block_id < self.capacity or self.refcounts[block_id] == 0:
            self._check_held(block_id, _RETAIN_FREE)
        self._cached.pop(block_id, None)
        self.refcounts[block_id] += 1
        self.shares += 1

    def retain_all(self, block_ids: Iterable[int]) -> None:
        """``retain`` each of several blocks (an adoption of a long prefix takes thousands:
        the checks are inline, and only a failing one goes through ``_check_held``)."""
        refcounts, cached, capacity, n = self.refcounts, self._cached, self.capacity, 0
        try:
            for b in block_ids:
                if not 0 <= b < capacity or refcounts[b] == 0:
                    self._check_held(b, _RETAIN_FREE)
                cached.pop(b, None)
                refcounts[b] += 1
                n += 1
        finally:
            self.shares += n

    def release(self, block_id: int) -> None:
        """Drop a holder; a block nobody holds goes back to the free list."""
        held = 0 <= block_id < self.capacity and self.refcounts[block_id] > 0
        if not held or block_id in self._cached:
            self._check_held(block_id, _RELEASE_FREE, release=True)
        self.refcounts[block_id] -= 1
        self._settle(block_id)

    def release_all(self, block_ids: Iterable[int]) -> None:
        """Release several blocks, last first, so a table's head stays cached longest."""
        refcounts, cached, capacity = self.refcounts, self._cached, self.capacity
        free, parked = self._free, self.parked
        for b in reversed(list(block_ids)):
            if not 0 <= b < capacity or refcounts[b] == 0 or b in cached:
                self._check_held(b, _RELEASE_FREE, release=True)
            rc = refcounts[b] = refcounts[b] - 1
            if rc == 0:  # as _settle, inline: thousands a long prefix
                free.append(b)
            elif rc == 1 and b in parked:
                cached[b] = None

    def park(self, block_id: int) -> None:
        """Let the prefix index hold a block (one reference), keeping it cached after use."""
        self._check_id(block_id)
        if block_id in self.parked:
            raise ValueError(f"block {block_id} is already parked.")
        if self.refcounts[block_id] == 0:
            raise ValueError(f"block {block_id} is free; only written blocks can be parked.")
        self.parked.add(block_id)
        self.refcounts[block_id] += 1
        self.shares += 1

    def unpark(self, block_id: int) -> None:
        """Drop the prefix index's reference to a block."""
        if block_id not in self.parked:
            raise ValueError(f"block {block_id} is not parked.")
        self.parked.discard(block_id)
        self._cached.pop(block_id, None)
        self.refcounts[block_id] -= 1
        self._settle(block_id)

    def is_shared(self, block_id: int) -> bool:
        """Whether a write into this block must copy it first."""
        return self.refcounts[block_id] > 1

    def refcount(self, block_id: int) -> int:
        """Holders of a block: tables holding it, plus one if parked."""
        self._check_id(block_id)
        return self.refcounts[block_id]

    def parked_ids(self) -> set[int]:
        """Ids the prefix index holds a reference to."""
        return set(self.parked)

    def stats(self) -> PagedCacheStats:
        """Counts of total, live, cached and free blocks, and the pool's bytes."""
        cached, free = len(self._cached), len(self._free)
        return PagedCacheStats(
            total_blocks=self.capacity,
            live_blocks=self.capacity - cached - free,
            cached_blocks=cached,
            free_blocks=free,
            block_size=self.block_size,
            bytes=self.capacity * self.bytes_per_block,
        )

    def check_invariants(self, tables: Iterable[Iterable[int]] | None = None) -> None:
        """Assert the pool's invariants; with ``tables``, also exact refcounts.

        ``tables`` are the block tables of every sequence that holds blocks of
        this pool; each block's refcount must equal its number of appearances
        plus one if parked.
        """
        free = set(self._free)
        assert len(free) == len(self._free), "a block is on the free list twice"
        cached = set(self._cached)
        assert not free & cached, f"blocks both free and cached: {free & cached}"
        assert cached <= self.parked, f"cached blocks not parked: {cached - self.parked}"
        for b, rc in enumerate(self.refcounts):
            assert rc >= 0, f"block {b} has refcount {rc}"
            assert (rc == 0) == (b in free), f"block {b}: refcount {rc}, on free list {b in free}"
            is_cached = b in self.parked and rc == 1
            assert is_cached == (b in cached), f"block {b}: refcount {rc}, cached {b in cached}"
        assert len(self.refcounts) == self.capacity
        if tables is not None:
            expected = [1 if b in self.parked else 0 for b in range(self.capacity)]
            for table in tables:
                for b in table:
                    expected[b] += 1
            for b, (want, got) in enumerate(zip(expected, self.refcounts, strict=True)):
                assert want == got, f"block {b}: refcount {got}, but {want} holders"

    # ---- internals --------------------------------------------------------

    def _grow(self, n: int) -> None:
        start = self.capacity
        self.capacity += n
        self.refcounts.extend([0] * n)
        self._free.extend(range(start, self.capacity))

    def _settle(self, block_id: int) -> None:
        rc = self.refcounts[block_id]
        if rc == 0:
            self._free.append(block_id)
        elif rc == 1 and block_id in self.parked:
            self._cached[block_id] = None

    def _evict_one(self) -> None:
        block_id, _ = self._cached.popitem(last=False)
        if self.on_evict is not None:
            self.on_evict(block_id)
        self.parked.discard(block_id)
        self.refcounts[block_id] = 0
        self._free.append(block_id)

    def _check_held(self, block_id: int, free: str, release: bool = False) -> None:
        """Raise for a block that is not held, saying ``free`` of a free one (for ``release``,
        also for one held by the index alone)."""
        self._check_id(block_id)
        if self.refcounts[block_id] == 0:
            raise ValueError(f"block {block_id} {free}.")
        if release and block_id in self._cached:
            raise ValueError(
                f"block {block_id} is held only by the prefix index; call unpark, not release."
            )

    def _check_id(self, block_id: int) -> None:
        if not 0 <= block_id < self.capacity:
            raise ValueError(f"block id {block_id} is outside the pool (0..{self.capacity - 1}).")


#: Fewest blocks ``ready_run`` readies as one run: a prompt shorter than this reads few
#: earlier tokens' K/V, and the sort is not worth it.
RUN_BLOCKS = 32


def ready_run(pool: BlockPool, n: int, least: int = RUN_BLOCKS) -> None:
    """Ready ``n`` blocks for one sequence's coming allocations as one run of consecutive
    ids where the free ids allow: evict cached blocks until ``n`` are free (or none is
    left: a growable pool grows later, in ``allocate``, with the ids after its last), then
    put the first run of ``n`` consecutive free ids (else the one that reaches the pool's
    end, else the longest) at the head of the free list, the rest after it in order. A
    sequence whose blocks are consecutive ids reads its K/V in place (``KVPool.run_view``).
    Best effort: allocations in between take ids from the same head. Admission readies a
    new prompt's blocks so: its prefill chunks then read its K/V in place instead of
    gathering every earlier token's (a 32k-token prompt's 2,048-token chunks re-read them).
    Fewer than ``least`` are left as they are."""
    if n < max(1, least) or (not pool.growable and n > pool.num_available):
        return
    while len(pool._free) < n and pool._cached:
        pool._evict_one()
    if not pool._free:
        return
    ids = np.sort(np.fromiter(pool._free, dtype=np.int64, count=len(pool._free)))
    breaks = np.flatnonzero(np.diff(ids) != 1) + 1
    starts = np.concatenate(([0], breaks))
    lengths = np.diff(np.concatenate((starts, [ids.size])))
    fits = np.flatnonzero(lengths >= n)
    if not fits.size and ids[-1] == pool.capacity - 1:  # growth continues the last run
        fits = np.array([starts.size - 1])
    at = int(starts[fits[0] if fits.size else int(np.argmax(lengths))])
    pool._free = deque(np.concatenate((ids[at:], ids[:at])).tolist())
