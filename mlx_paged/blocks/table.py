"""Block tables: which blocks hold a sequence's tokens, and the bookkeeping on them.

A layer group is the set of layers that share block ids: all full-attention
layers of a model, or all sliding-window layers with one window (``LayerKind``).
``BlockTables`` makes, forks, trims and reserves the block tables of one group
over its ``BlockPool``. It moves no K/V: the storage layer subclasses it and
copies a block's bytes where this class only re-points a table. Pure Python.
"""

from __future__ import annotations

import bisect
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from .hot import hot_positions, repoint, steps_until_due
from .pool import BlockPool, PoolExhaustedError, PoolTooSmallError
from .tiers import TieredBlockPool, is_cold

T = TypeVar("T")


#: The id a block table holds in place of a block it gave back from its middle.
HOLE = -1


@dataclass(frozen=True)
class LayerKind:
    """Which group a paged layer joins.

    Full attention (``window`` ``None``), a sliding window of ``window``
    tokens, or, with ``keep`` > 0, a window that also keeps the first ``keep``
    tokens (mlx-lm's ``RotatingKVCache(max_size=window, keep=keep)``, what
    ``max_kv_size`` builds).
    """

    window: int | None = None
    keep: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "_hash", hash((self.window, self.keep)))

    def __hash__(self) -> int:  # kept: every step looks up each request's tables by kind
        return self._hash

    def __reduce__(self) -> tuple:  # made anew where unpickled: hash(None) is per process
        return LayerKind, (self.window, self.keep)


@dataclass
class BlockTable:
    """One sequence's blocks in one group, plus how far each layer has written.

    ``blocks[i]`` holds tokens ``[(first + i) * block_size, (first + i + 1) *
    block_size)``; ``first`` is the number of leading blocks already given back
    (sliding-window layers drop blocks that fell out of the window). A layer
    that keeps its first tokens gives back blocks from the middle instead, and
    ``HOLE`` marks them.
    """

    blocks: list[int] = field(default_factory=list)
    first: int = 0
    lengths: list[int] = field(default_factory=list)
    version: int = 0  # bumped whenever ``blocks`` or ``first`` changes
    # (version, start, end, pool shares) of the span ``reserve`` last made private: the
    # later layers of a prefill step skip the check while nothing changed.
    reserved_key: tuple | None = field(default=None, repr=False)
    # The mask the cache's make_mask last returned for this sequence's layers, so
    # attention can tell it from a mask the model made itself.
    mask: object = field(default=None, repr=False)
    # Device arrays derived from the table (block ids, pool slots, ...), each with the
    # key it was derived from; the layers of a step share them.
    _derived: dict[str, tuple[tuple, Any]] = field(default_factory=dict, repr=False)

    @property
    def end(self) -> int:
        """Tokens written by the furthest layer."""
        return max(self.lengths, default=0)

    def derived(self, name: str, key: tuple, make: Callable[..., T], *args: Any) -> T:
        """The value ``make(*args)`` gave for ``key`` under ``name``, made again when ``key``
        changes."""
        held = self._derived.get(name)
        if held is None or held[0] != key:
            held = self._derived[name] = (key, make(*args))
        return held[1]


class BlockTables:
    """The block tables of one layer group, over the ``BlockPool`` that owns their ids.

    Args:
        num_layers: Layers in this group.
        block_size: Token slots per block.
        num_blocks: Fixed capacity, or ``None`` to grow on demand.
        pool: The ``BlockPool`` to use instead of a new one of ``num_blocks``
            (a ``TieredBlockPool`` for a quantized cold tier).
    """

    def __init__(
        self,
        num_layers: int,
        block_size: int,
        num_blocks: int | None = None,
        pool: BlockPool | None = None,
    ):
        self.blocks = pool if pool is not None else BlockPool(num_blocks, block_size)
        self.block_size = block_size
        self.num_layers = num_layers
        #: Tokens at the end of each sequence kept out of the cold tier (``None``: no tier).
        self.hot_tokens: int | None = None
        #: Blocks a sequence waits to have due before they move to the cold tier.
        self.migrate_blocks = 1
        # Every table made here, so a block moving to the cold tier is re-pointed in all.
        self._live: weakref.WeakValueDictionary[int, BlockTable] = weakref.WeakValueDictionary()
        self._made = 0
        #: Blocks copied on write so far (``steps_until_due`` holds only between copies).
        self.copied = 0

    # ---- tables -----------------------------------------------------------

    def new_table(self) -> BlockTable:
        """An empty table whose blocks are released when it is garbage collected."""
        table = BlockTable(lengths=[0] * self.num_layers)
        weakref.finalize(table, _release_quietly, self.blocks, table.blocks)
        self._made += 1
        self._live[self._made] = table
        return table

    def fork(self, table: BlockTable) -> BlockTable:
        """A new table holding references to the same blocks (no K/V is copied)."""
        self.blocks.retain_all(b for b in table.blocks if b != HOLE)
        forked = self.new_table()
        forked.blocks.extend(table.blocks)
        forked.first = table.first
        forked.lengths[:] = table.lengths
        return forked

    def release(self, table: BlockTable) -> None:
        """Give back every block of a table and empty it."""
        _release_held(self.blocks, table.blocks)
        table.blocks.clear()
        table.first = 0
        table.lengths[:] = [0] * self.num_layers
        table.version += 1

    def truncate(self, table: BlockTable, layer: int, length: int) -> None:
        """Set a layer's length to ``length`` and give back blocks no layer reaches."""
        table.lengths[layer] = length
        keep = -(-table.end // self.block_size) - table.first
        if keep < len(table.blocks):
            _release_held(self.blocks, table.blocks[keep:])
            del table.blocks[keep:]
            table.version += 1

    def drop_before(self, table: BlockTable, position: int) -> None:
        """Give back the blocks that hold only tokens before ``position``."""
        n = position // self.block_size - table.first
        if n > 0:
            self.blocks.release_all(table.blocks[:n])
            del table.blocks[:n]
            table.first += n
            table.version += 1

    def drop_range(self, table: BlockTable, start: int, end: int) -> None:
        """Give back the blocks that hold only tokens in ``[start, end)``, leaving holes."""
        bs = self.block_size
        lo, hi = -(-start // bs) - table.first, end // bs - table.first
        span = range(max(lo, 0), min(hi, len(table.blocks)))
        dropped = [i for i in span if table.blocks[i] != HOLE]
        if dropped:
            self.blocks.release_all(table.blocks[i] for i in dropped)
            for i in dropped:
                table.blocks[i] = HOLE
            table.version += 1

    # ---- the cold tier -----------------------------------------------------

    def hot_span(self, chunk: int) -> int | None:
        """Most full-precision blocks a sequence holds at once writing ``chunk`` tokens a step.

        ``None`` unless blocks behind the hot tail always find room in a cold tier
        that grows on demand (a full fixed tier leaves them hot).
        """
        if self.hot_tokens is None or not self.blocks.cold.growable:
            return None
        return -(-(self.hot_tokens + chunk) // self.block_size) + self.migrate_blocks + 1

    def cold_candidates(self, table: BlockTable, hot_tokens: int) -> list[int]:
        """Hot blocks of ``table`` whose tokens all lie before its hot tail, oldest first.

        The hot tail is the last ``hot_tokens`` tokens every layer has written.
        """
        n = (min(table.lengths, default=0) - hot_tokens) // self.block_size - table.first
        hot = hot_positions(table)
        return [table.blocks[i] for i in hot[: bisect.bisect_left(hot, n)]]

    def steps_until_due(self, tables: list[BlockTable], hot_tokens: int, batch: int) -> float:
        """How many more tokens every one of ``tables`` can take, one a step, before
        ``cold_candidates`` could give ``batch`` blocks for one of them (0 or less: it
        does now; infinite for no table): ``hot.steps_until_due``."""
        return steps_until_due(tables, self.block_size, hot_tokens, batch)

    def migrate(self, blocks: list[int]) -> dict[int, int]:
        """Move hot ``blocks`` (repeats allowed) to the cold tier; return ``{old: new}``.

        Every table holding a moved block is re-pointed, in one pass over the
        tables (the prefix index by its pool hook). Stops early, keeping the rest
        hot, when the cold tier is full. The caller copies the K/V of each old
        block before the pool allocates again.
        """
        pool = self.blocks
        if not isinstance(pool, TieredBlockPool):
            raise ValueError("this pool has no cold tier.")
        moved: dict[int, int] = {}
        for b in blocks:
            if b in moved:
                continue  # shared by two of the tables the blocks came from
            new = pool.migrate(b)
            if new is None:
                break
            moved[b] = new
        if moved:
            for t in list(self._live.values()):
                repoint(t, moved)
        return moved

    # ---- reservations -----------------------------------------------------

    def make_room(self, n: int) -> None:
        """Grow a growable pool (and its storage) once, if it must, so that ``n`` more blocks
        fit without another growth (``BlockPool.make_room``)."""
        capacity = self.blocks.capacity
        self.blocks.make_room(n)
        if self.blocks.capacity != capacity:
            self.grown()

    def blocks_needed(self, table: BlockTable, start: int, end: int) -> int:
        """Blocks ``reserve(table, start, end)`` would take: new ones plus copies of shared ones."""
        return len(self._shared_in(table, start, end)) + self._missing(table, end)

    def next_token_blocks(self, table: BlockTable) -> int:
        """``blocks_needed`` for the table's next token alone (a decode step's): a new block
        at a block boundary, a copy of a shared one, or none."""
        i = table.lengths[0] // self.block_size - table.first
        if i >= len(table.blocks):
            return i - len(table.blocks) + 1
        b = table.blocks[i]
        return int(b != HOLE and self.blocks.is_shared(b))

    def reserve(self, table: BlockTable, start: int, end: int) -> None:
        """Give tokens ``[start, end)`` private blocks in ``table``, copying shared ones.

        Raises:
            PoolTooSmallError: if the table would need more blocks than the pool has.
            PoolExhaustedError: if the blocks cannot be freed now; nothing changes.
        """
        bs = self.block_size
        span = -(-end // bs) - table.first
        if (
            not self.blocks.growable
            and span > self.blocks.capacity
            and span - sum(map(is_cold, table.blocks)) > self.blocks.capacity
        ):
            raise PoolTooSmallError(
                f"{end} tokens need {span} blocks of {bs}, but the pool holds only "
                f"{self.blocks.capacity}; pass a larger num_blocks (or None to grow)."
            )
        shared = self._shared_in(table, start, end)
        missing = self._missing(table, end)
        if not self.blocks.can_allocate(len(shared) + missing):
            raise PoolExhaustedError(
                f"the pool needs {len(shared) + missing} more blocks but only "
                f"{self.blocks.num_available} of {self.blocks.capacity} can be freed; "
                "release sequences or build a larger pool."
            )
        for i in shared:
            self.copy_on_write_block(table, i)
        if missing:
            table.blocks.extend(self._allocate(missing))
            table.version += 1
        table.reserved_key = (table.version, start, end, self.blocks.shares)

    def copy_on_write_block(self, table: BlockTable, index: int) -> int:
        """Give ``table.blocks[index]`` a private copy; return its id.

        The new block gets the old one's contents (``copy_block``) before this
        table's reference to the old one is released.
        """
        old = table.blocks[index]
        (new,) = self._allocate(1)
        self.copy_block(old, new)
        self.copied += 1
        table.blocks[index] = new
        table.version += 1
        self.blocks.release(old)
        return new

    # ---- storage hooks ----------------------------------------------------

    def copy_block(self, src: int, dst: int) -> None:
        """Copy block ``src``'s K/V into block ``dst`` (bookkeeping only here: no data)."""

    def grown(self) -> None:
        """Called after the pool grew, so storage can grow its arrays to match."""

    # ---- internals --------------------------------------------------------

    def _allocate(self, n: int) -> list[int]:
        capacity = self.blocks.capacity
        ids = self.blocks.allocate(n)
        if ids is None:
            raise PoolExhaustedError(
                f"the pool needs {n} more blocks but only {self.blocks.num_available} of "
                f"{capacity} can be freed; release sequences or build a larger pool."
            )
        if self.blocks.capacity != capacity:
            self.grown()
        return ids

    def _shared_in(self, table: BlockTable, start: int, end: int) -> list[int]:
        """Indices into ``table.blocks`` of shared blocks that tokens ``[start, end)`` touch."""
        bs = self.block_size
        lo, hi = start // bs - table.first, min(len(table.blocks), -(-end // bs) - table.first)
        held = ((i, table.blocks[i]) for i in range(lo, hi))
        return [i for i, b in held if b != HOLE and self.blocks.is_shared(b)]

    def _missing(self, table: BlockTable, end: int) -> int:
        """Blocks to append so that ``table`` reaches token ``end``."""
        return max(0, -(-end // self.block_size) - table.first - len(table.blocks))


def _release_held(pool: BlockPool, blocks: list[int]) -> None:
    """Release the blocks of a table slice, skipping holes."""
    pool.release_all([b for b in blocks if b != HOLE] if HOLE in blocks else blocks)


def _release_quietly(pool: BlockPool, blocks: list[int]) -> None:
    """Finalizer: a table dropped without ``release`` gives its blocks back."""
    _release_held(pool, blocks)
    blocks.clear()
