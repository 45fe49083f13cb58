"""Block bookkeeping in pure Python: ids, refcounts, block tables and the prefix index."""

from .pool import BlockPool, PagedCacheStats, PoolExhaustedError, check_block_size
from .prefix_index import PrefixIndex, PrefixMatch
from .table import HOLE, BlockTable, BlockTables, LayerKind

__all__ = [
    "HOLE",
    "BlockPool",
    "BlockTable",
    "BlockTables",
    "LayerKind",
    "PagedCacheStats",
    "PoolExhaustedError",
    "PrefixIndex",
    "PrefixMatch",
    "check_block_size",
]
