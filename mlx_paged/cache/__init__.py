"""mlx-lm's cache protocol over the block pool: one layer of one sequence, or of a batch."""

from .batch import DecodeBatch
from .batch_cache import PagedBatchKVCache
from .disk_prefix import load_prefix, save_prefix
from .layout import (
    PagedLayout,
    install_paged_cache,
    make_paged_cache,
    make_pools,
    uninstall_paged_cache,
)
from .paged import PagedKVCache
from .states import StepStateCache
from .step import StepPagedKVCache

__all__ = [
    "DecodeBatch",
    "PagedBatchKVCache",
    "PagedKVCache",
    "PagedLayout",
    "StepPagedKVCache",
    "StepStateCache",
    "install_paged_cache",
    "load_prefix",
    "make_paged_cache",
    "make_pools",
    "save_prefix",
    "uninstall_paged_cache",
]
