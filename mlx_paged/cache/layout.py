"""Which of a model's caches are paged, in which pool, and ``make_paged_cache``."""

from __future__ import annotations

import copy
import os
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import CacheList

from ..attention import route_model
from ..blocks import LayerKind, check_block_size
from ..storage import KVPool, KVQuant, check_kv_dtype, check_kv_quant
from .disk_prefix import open_disk
from .families import (
    SINK_TOKENS,
    attention_reads_kv_directly,
    classify,
    default_caches,
    model_type,
    recurrent_state_takes_lengths,
)
from .paged import PagedKVCache
from .sinks import PagedSinkKVCache


def make_paged_cache(
    model: nn.Module,
    block_size: int = 16,
    num_blocks: int | None = None,
    kv_dtype: mx.Dtype | None = None,
    max_kv_size: int | None = None,
    kv_bits: int | None = None,
    kv_group_size: int = 64,
    hot_tokens: int = 256,
    kv_disk_dir: str | os.PathLike | None = None,
    kv_disk_bytes: int | None = None,
) -> list[Any]:
    """Build ``model``'s prompt cache with every attention layer paged.

    Transforms what ``model.make_cache()`` (or mlx-lm's default) returns:
    ``KVCache`` becomes a full-attention ``PagedKVCache``; ``RotatingKVCache``
    becomes a sliding-window one that gives back blocks outside the window
    (``PagedSinkKVCache`` where it keeps its first tokens); ``ArraysCache``
    (SSM / recurrent state) stays native; ``CacheList`` is converted item by
    item.

    Args:
        model: An mlx-lm model.
        block_size: Token slots per block.
        num_blocks: Blocks per pool (one pool per full/sliding layer group);
            ``None`` grows the pool on demand.
        kv_dtype: Storage dtype for K/V, e.g. ``mx.float16``; ``None`` keeps the
            model's.
        max_kv_size: As mlx-lm's ``make_prompt_cache``: for a model without its
            own ``make_cache``, every layer keeps its first 4 tokens and a window
            of ``max_kv_size`` tokens in all (``PagedSinkKVCache``); a model with
            one ignores it, as in mlx-lm. Such caches cannot be batched.
        kv_bits: 8 or 4 for a quantized cold tier: once a sequence has at least
            64 tokens' worth of full blocks behind its last ``hot_tokens``
            tokens, those blocks are quantized (``mx.quantize``, per block) and
            their full-precision blocks go back to the pool. Full-attention
            layers only: sliding windows stay full precision. ``num_blocks``
            then bounds the full-precision blocks; the cold tier grows on demand.
        kv_group_size: Quantization group size (32, 64 or 128; must divide the
            head dim).
        hot_tokens: The tokens at the end of every sequence that always stay in
            full precision.
        kv_disk_dir, kv_disk_bytes: A directory of prompt prefixes on disk, at most
            this many bytes of files (least recently used go first): ``save_prefix``
            writes the cache's blocks (and recurrent state, at a block boundary)
            there, and ``load_prefix`` fills a new cache from them
            (``cache/disk_prefix.py``). Shared with ``PagedEngine``'s disk tier for
            the same model and settings. Not with ``max_kv_size``; the directory is
            indexed when first opened here.

    Raises:
        ValueError: for a bad ``block_size``/``num_blocks``/``max_kv_size``/
            ``kv_dtype`` (not a floating dtype)/``kv_bits``/``kv_group_size``/
            ``hot_tokens``/``kv_disk_bytes``, a cache layout mlx_paged cannot page
            (the message names the model type), or a disk directory with a
            ``max_kv_size`` or for a model without attention layers.
    """
    quant = check_kv_quant(kv_bits, kv_group_size, hot_tokens)
    layout, pools = _pools(model, block_size, num_blocks, kv_dtype, max_kv_size, quant)
    if kv_disk_dir is not None or kv_disk_bytes is not None:
        _check_disk(layout, kv_disk_dir, kv_disk_bytes)
        open_disk(model, pools, kv_disk_dir, kv_disk_bytes, layout.entries)
    return layout.bind(pools, {kind: pool.new_table() for kind, pool in pools.items()})


def install_paged_cache(
    model: nn.Module,
    block_size: int = 16,
    num_blocks: int | None = None,
    kv_dtype: mx.Dtype | None = None,
    max_kv_size: int | None = None,
    kv_bits: int | None = None,
    kv_group_size: int = 64,
    hot_tokens: int = 256,
) -> None:
    """Make mlx-lm build paged caches for ``model``, all in one pool per layer group.

    Sets the model's ``make_cache`` hook, which mlx-lm's ``make_prompt_cache``,
    ``generate``, ``batch_generate``, ``BatchGenerator`` and ``mlx_lm.server``
    honour: every cache list they make is paged, and requests share blocks, so
    merging them into a batch copies no K/V. ``copy.deepcopy`` of such a cache
    (mlx_lm.server's prompt cache) shares blocks too. mlx-lm ignores
    ``max_kv_size`` for models with this hook. Installing again replaces the
    pools; ``uninstall_paged_cache`` restores the model's own caches.
    ``max_kv_size`` here is the window every cache the hook builds gets (the
    hook cannot see the argument mlx-lm's callers pass).

    Args and errors as ``make_paged_cache``.
    """
    quant = check_kv_quant(kv_bits, kv_group_size, hot_tokens)
    uninstall_paged_cache(model)
    layout, pools = _pools(model, block_size, num_blocks, kv_dtype, max_kv_size, quant)

    def make_cache() -> list[Any]:
        return layout.bind(pools, {kind: pool.new_table() for kind, pool in pools.items()})

    make_cache.pools = pools  # type: ignore[attr-defined]
    make_cache.paged_original = getattr(model, "make_cache", None)  # type: ignore[attr-defined]
    model.make_cache = make_cache


def uninstall_paged_cache(model: nn.Module) -> None:
    """Undo ``install_paged_cache``: mlx-lm builds the model's own caches again."""
    if hasattr(getattr(model, "make_cache", None), "pools"):
        del model.make_cache


def _check_disk(layout: PagedLayout, path: object, nbytes: object) -> None:
    """Refuse a disk directory ``make_paged_cache`` cannot keep prefixes in."""
    if path is None:
        raise ValueError("kv_disk_bytes needs kv_disk_dir, the directory to write to.")
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
        raise ValueError(f"kv_disk_bytes must be a positive int (bytes), got {nbytes!r}.")
    if not layout.counts:
        raise ValueError(
            f"{layout.family} has no attention layers to page, so no blocks to keep on "
            "disk; mlx-lm's save_prompt_cache keeps its recurrent state."
        )
    if any(kind.keep for kind in layout.counts):
        raise ValueError(
            f"{layout.family}: layers that keep their first tokens (max_kv_size) "
            "cannot keep prefixes on disk; leave max_kv_size unset."
        )


def _pools(
    model: nn.Module,
    block_size: int,
    num_blocks: int | None,
    kv_dtype: mx.Dtype | None,
    max_kv_size: int | None = None,
    quant: KVQuant | None = None,
) -> tuple[PagedLayout, dict[LayerKind, KVPool]]:
    check_block_size(block_size)
    check_kv_dtype(kv_dtype)
    if max_kv_size is not None and (
        isinstance(max_kv_size, bool)
        or not isinstance(max_kv_size, int)
        or max_kv_size <= SINK_TOKENS
    ):
        raise ValueError(
            f"max_kv_size must be an int above the {SINK_TOKENS} kept tokens, or None; "
            f"got {max_kv_size!r}."
        )
    layout = PagedLayout.of(model, max_kv_size)
    pools = make_pools(layout, block_size, num_blocks, kv_dtype, quant)
    route_model(model)
    return layout, pools


def make_pools(
    layout: PagedLayout,
    block_size: int,
    num_blocks: int | None,
    kv_dtype: mx.Dtype | None,
    quant: KVQuant | None = None,
    cold_blocks: int | None = None,
) -> dict[LayerKind, KVPool]:
    """One ``KVPool`` per layer group; ``quant`` (and ``cold_blocks``) for full attention only.

    The pools defer decode reads (``KVPool.defer_reads``) when the layout's model
    hands K/V straight to attention.
    """
    pools = {
        kind: KVPool(
            n,
            block_size,
            num_blocks,
            kv_dtype,
            quant if kind == LayerKind() else None,
            cold_blocks if kind == LayerKind() else None,
        )
        for kind, n in layout.counts.items()
    }
    for pool in pools.values():
        pool.defer_reads = layout.direct_kv
    return pools


@dataclass
class PagedLayout:
    """Which of a model's caches are paged, and in which pool.

    ``template`` is what ``model.make_cache()`` (or mlx-lm's default) returns;
    ``counts`` says how many paged layers each kind (full attention, or one
    sliding window) has; ``entries`` gives, per recurrent cache kept as it is
    (``ArraysCache``), in order, its number of state entries; ``direct_kv`` is
    ``attention_reads_kv_directly(model)``; ``padded_states`` is
    ``recurrent_state_takes_lengths(model)`` where the model has recurrent caches.
    """

    template: list
    family: str
    counts: Counter[LayerKind]
    entries: list[int]
    direct_kv: bool = False
    padded_states: bool = False

    @classmethod
    def of(cls, model: nn.Module, max_kv_size: int | None = None) -> PagedLayout:
        """Classify ``model``'s caches (``default_caches``); raises ValueError for layouts
        mlx_paged cannot page."""
        family = model_type(model)
        template = default_caches(model, max_kv_size)
        counts: Counter[LayerKind] = Counter()
        entries: list[int] = []

        def count(kind: LayerKind | None, cache: object) -> None:
            if kind is None:
                entries.append(len(cache.cache))
            else:
                counts[kind] += 1

        _walk(template, family, count)
        padded = bool(entries) and recurrent_state_takes_lengths(model)
        return cls(template, family, counts, entries, attention_reads_kv_directly(model), padded)

    def bind(
        self,
        pools: dict[LayerKind, KVPool],
        tables: dict[LayerKind, Any],
        factory: Callable[..., Any] = PagedKVCache,
        states: Callable[[int], Any] | None = None,
    ) -> list[Any]:
        """A cache list shaped like ``template``: paged layers made by
        ``factory(pool, table, layer, window)``; the ``i``-th recurrent cache is
        ``states(i)``, or a fresh copy of the template's without ``states``.

        Layers that keep their first tokens are ``PagedSinkKVCache``, and only a
        one-sequence ``PagedKVCache`` factory can make them.
        """
        next_layer: Counter[LayerKind] = Counter()
        next_state = iter(range(len(self.entries)))

        def paged(kind: LayerKind | None, cache: object) -> Any:
            if kind is None:
                i = next(next_state)
                return copy.deepcopy(cache) if states is None else states(i)
            layer = next_layer[kind]
            next_layer[kind] += 1
            if kind.keep:
                if factory is not PagedKVCache:
                    raise ValueError(
                        f"{self.family}: layers that keep their first {kind.keep} tokens "
                        "(RotatingKVCache keep, max_kv_size) cannot be batched by mlx_paged."
                    )
                return PagedSinkKVCache(pools[kind], tables[kind], layer, kind.window, kind.keep)
            return factory(pools[kind], tables[kind], layer, kind.window)

        return _walk(self.template, self.family, paged)


def _walk(caches: list, family: str, visit) -> list:
    """Replace each cache with ``visit(kind, cache)``, recursing into CacheList; ``kind``
    is ``None`` for a cache kept native (recurrent state)."""
    out = []
    for c in caches:
        if isinstance(c, CacheList):
            out.append(CacheList(*_walk(list(c.caches), family, visit)))
            continue
        out.append(visit(classify(c, family), c))
    return out
