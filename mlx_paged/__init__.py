"""mlx_paged: a paged KV cache for mlx-lm."""

from .block_pool import BlockPool, PagedCacheStats, PoolExhaustedError
from .cache import PagedKVCache, make_paged_cache
from .engine import EngineStats, Event, PagedEngine
from .prefix_index import PrefixIndex

__all__ = [
    "BlockPool",
    "EngineStats",
    "Event",
    "PagedEngine",
    "PagedCacheStats",
    "PagedKVCache",
    "PoolExhaustedError",
    "PrefixIndex",
    "make_paged_cache",
]

__version__ = "0.1.0"
