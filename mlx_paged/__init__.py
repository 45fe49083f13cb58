"""mlx_paged: a paged KV cache for mlx-lm."""

from .block_pool import BlockPool, PagedCacheStats, PoolExhaustedError
from .cache import PagedKVCache, make_paged_cache

__all__ = [
    "BlockPool",
    "PagedCacheStats",
    "PagedKVCache",
    "PoolExhaustedError",
    "make_paged_cache",
]

__version__ = "0.1.0"
