"""mlx_paged: a paged KV cache for mlx-lm.

Layers, each importing only those below it: ``engine`` (scheduler, model
runner) → ``cache`` (mlx-lm's cache protocol) → ``attention`` (routing,
kernels) → ``storage`` (the pool's MLX arrays) → ``blocks`` (pure-Python
bookkeeping). Importing the package routes mlx-lm's attention to the paged path
and registers ``PagedKVCache`` for ``load_prompt_cache``.
"""

from .blocks import (
    BlockPool,
    PagedCacheStats,
    PoolExhaustedError,
    PoolTooSmallError,
    PrefixIndex,
)
from .cache import (
    PagedBatchKVCache,
    PagedKVCache,
    install_paged_cache,
    load_prefix,
    make_paged_cache,
    save_prefix,
    uninstall_paged_cache,
)
from .engine import (
    EngineStats,
    Event,
    PagedEngine,
    bucket_matmul_rows,
    few_row_matmuls,
    fuse_projections,
    rope_in_kernel,
)

__all__ = [
    "BlockPool",
    "EngineStats",
    "Event",
    "PagedEngine",
    "PagedBatchKVCache",
    "PagedCacheStats",
    "PagedKVCache",
    "PoolExhaustedError",
    "PoolTooSmallError",
    "PrefixIndex",
    "bucket_matmul_rows",
    "few_row_matmuls",
    "fuse_projections",
    "rope_in_kernel",
    "install_paged_cache",
    "load_prefix",
    "make_paged_cache",
    "save_prefix",
    "uninstall_paged_cache",
]

__version__ = "0.1.0"
