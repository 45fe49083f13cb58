"""How each family's cache layout maps onto paged layers.

mlx-lm models describe their caches through ``model.make_cache()``; the list is
not always one entry per ``model.layers`` item, so we classify cache objects,
not layers.
"""

from __future__ import annotations

import mlx.nn as nn
from mlx_lm.models.cache import (
    ArraysCache,
    CacheList,
    ChunkedKVCache,
    KVCache,
    RotatingKVCache,
)

from ..blocks import LayerKind

#: Leading tokens mlx-lm's ``make_prompt_cache`` keeps under ``max_kv_size``.
SINK_TOKENS = 4


def model_type(model: nn.Module) -> str:
    """The model's ``model_type`` for error messages, or its class path."""
    name = getattr(model, "model_type", None) or getattr(
        getattr(model, "args", None), "model_type", None
    )
    return name or f"{type(model).__module__}.{type(model).__name__}"


def default_caches(model: nn.Module, max_kv_size: int | None = None) -> list:
    """What mlx-lm's ``make_prompt_cache(model, max_kv_size)`` would build.

    ``model.make_cache()`` where the model has one (mlx-lm then ignores
    ``max_kv_size``); else one ``RotatingKVCache(max_kv_size, keep=4)`` per
    layer, or one ``KVCache`` per layer without ``max_kv_size``. A hook set by
    ``install_paged_cache`` is looked through to the model's own.
    """
    make = getattr(model, "make_cache", None)
    make = getattr(make, "paged_original", make)
    if make is not None:
        return make()
    if max_kv_size is not None:
        return [RotatingKVCache(max_size=max_kv_size, keep=SINK_TOKENS) for _ in model.layers]
    return [KVCache() for _ in model.layers]


def classify(cache: object, family: str) -> LayerKind | None:
    """The paged kind replacing ``cache``, or ``None`` to keep it native.

    Raises:
        ValueError: for layouts mlx_paged cannot page, naming the model type.
    """
    if type(cache) is KVCache:
        return LayerKind()
    if type(cache) is RotatingKVCache:
        if cache.keep and not 0 < cache.keep < cache.max_size:
            raise ValueError(
                f"{family}: RotatingKVCache(max_size={cache.max_size}, keep={cache.keep}) keeps "
                "no window; max_kv_size must be larger than the kept tokens."
            )
        return LayerKind(window=cache.max_size, keep=cache.keep)
    if isinstance(cache, ArraysCache):
        return None  # recurrent / SSM state: small, per sequence, stays native
    if isinstance(cache, ChunkedKVCache):
        raise ValueError(
            f"{family}: ChunkedKVCache (chunked local attention) is not supported by mlx_paged; "
            "use mlx-lm's own cache for this model."
        )
    if isinstance(cache, CacheList):
        raise AssertionError("CacheList is unpacked by the caller")
    raise ValueError(
        f"{family}: cache type {type(cache).__name__} is not supported by mlx_paged "
        "(supported: KVCache, RotatingKVCache, ArraysCache, CacheList of those); "
        "use mlx-lm's own cache for this model."
    )
