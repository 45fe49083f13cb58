"""mlx-lm's cache protocol over the block pool: one layer of one sequence, or of a batch."""

from .batch import BatchPagedKVCache, DecodeBatch
from .layout import PagedLayout, make_paged_cache
from .paged import PagedKVCache

__all__ = ["BatchPagedKVCache", "DecodeBatch", "PagedKVCache", "PagedLayout", "make_paged_cache"]
