"""Block bookkeeping in pure Python: ids, refcounts, block tables and the prefix index."""

from .pool import (
    BlockPool,
    PagedCacheStats,
    PoolExhaustedError,
    PoolTooSmallError,
    check_block_size,
    ready_run,
)
from .prefix_index import Cursor, PrefixIndex, PrefixMatch
from .states import StateSlots, StateStats
from .table import HOLE, BlockTable, BlockTables, LayerKind
from .tiers import COLD, TieredBlockPool, TierStats, is_cold

__all__ = [
    "HOLE",
    "BlockPool",
    "BlockTable",
    "BlockTables",
    "COLD",
    "Cursor",
    "LayerKind",
    "PagedCacheStats",
    "PoolExhaustedError",
    "PoolTooSmallError",
    "PrefixIndex",
    "PrefixMatch",
    "StateSlots",
    "StateStats",
    "TierStats",
    "TieredBlockPool",
    "check_block_size",
    "is_cold",
    "ready_run",
]
