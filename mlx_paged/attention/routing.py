"""Paged attention dispatch, and the routing of mlx-lm's attention to it.

mlx-lm's model files bind ``mlx_lm.models.base.scaled_dot_product_attention``
by name at import. ``route_attention`` rebinds that name, in ``base`` and in
every loaded module, to a wrapper that sends calls whose cache is paged to
``paged_attention`` and everything else to mlx-lm's original function.

``paged_attention`` is where fused kernels plug in. A decode call (one query
per sequence) whose K/V and mask are exactly what the paged cache produced is
offered to each entry of ``KERNELS`` with a ``PagedView`` of the blocks; a
kernel returns the output or ``None`` to decline. The portable gather path runs
when none takes it: ``update_and_fetch`` already returned the layer's K/V
gathered from the blocks, and MLX's SDPA runs on them. Calls whose K/V the
model transformed (MLA) or whose mask it edited always take the gather path.

A decode step of a cache whose pool ``defer_reads`` (the model hands K/V
straight to attention) returns stand-ins instead of gathering K/V, while
``kernels_ready()`` says a kernel may take the call: building the gather costs
host time on every layer of every token, and the kernel never evaluates it. If
no kernel takes the call after all, attention reads the real K/V then
(``PagedLayerCache.deferred_read``). A batched decode step (``StepPagedKVCache``)
also leaves its K/V write to the kernel while ``kernels_write()``: the view
carries the new rows, and ``deferred_read`` writes them first where no kernel
took the call.

A one-sequence decode step or prefill chunk whose blocks are consecutive ids (a
sequence alone in its pool, as ``make_paged_cache`` builds it) needs neither:
the cache returns views of the pool arrays (``KVPool.run_view``) and MLX's own
attention reads them in place, as it reads mlx-lm's dense buffer, with no
custom kernel launch (``path_counts["in_place"]``). On CUDA, a decode step whose head
dim MLX's one-query attention would copy the views for (``views_read_in_place``) goes to
a fused kernel instead, which also stores the step's token where it can
(``one_token_read``). Tables that share or reuse blocks take the paths above and below.

Which path runs is chosen by ``set_attention_path`` or the environment variable
``MLX_PAGED_ATTENTION``: ``auto`` (default: in-place reads where the blocks
allow, else fused kernels where the device has one and it passed its
self-check), ``kernel`` (always offer eligible calls to the kernels, never read
in place; if no kernel runs on this device, warn once and gather) or ``gather``
(in-place reads or portable gathers, no kernel).

A batched prefill call (more than one query per sequence) whose K/V and mask
are its batch cache's own (``StepPagedKVCache``) is offered to
``PREFILL_KERNELS`` with a ``PrefillView`` (the CUDA kernel reads the blocks in
place with tensor cores and builds nothing per shape); a cache whose pool
``defer_reads`` returns stand-ins for it while ``prefill_kernels_ready()``, as
for decode. Other prefill calls read the blocks into contiguous K/V for SDPA;
on CUDA, small ones compute it in plain MLX ops instead (``prefill``), since
cuDNN's fused attention builds a graph for every new shape. ``fused_read``
offers the read to the device kernels of ``READERS`` (one 16-byte-wide copy of K
and V) unless the path is ``gather``, which keeps every read in portable MLX ops.
The CUDA and Metal kernels of ``mlx_paged.attention.kernels`` are registered at
import, and the CUDA migration kernel in ``mlx_paged.storage.STORERS``.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
from collections import Counter
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import base

from ..storage import STORERS
from .convolution import route_convolutions
from .kernels import DEVICE_KERNELS, DEVICE_PREFILL_KERNELS, DEVICE_READERS, DEVICE_STORERS
from .mamba import route_ssm_update
from .prefill import attention_by_ops, use_ops
from .records import PagedLayerCache, PagedView, PrefillView
from .recurrent import route_gated_delta

_original_sdpa = base.scaled_dot_product_attention
logger = logging.getLogger("mlx_paged.attention")

ATTENTION_PATHS = ("auto", "kernel", "gather")


#: Fused paged decode kernels, tried in order. Each is called as
#: ``kernel(queries, view, scale, sinks)`` with ``queries`` ``(B, n_heads, 1, D)``
#: and returns ``(B, n_heads, 1, v_head_dim)`` or ``None`` to decline. An entry whose
#: ``writes`` attribute is true also stores a view's new rows (``PagedView.new_keys``)
#: when it takes the call; the others are never offered such a view.
KERNELS: list[Callable[[mx.array, PagedView, float, mx.array | None], mx.array | None]] = []

#: Fused paged prefill kernels, tried in order. Each is called as
#: ``kernel(queries, view, scale, sinks)`` with ``queries`` ``(B, n_heads, L, D)`` and a
#: ``PrefillView``, and returns ``(B, n_heads, L, D)`` or ``None`` to decline.
PREFILL_KERNELS: list[
    Callable[[mx.array, PrefillView, float, mx.array | None], mx.array | None]
] = []

#: How many attention calls each path served, e.g. ``{"gather": 96}``; ``prefill_ops`` counts
#: the CUDA prefill calls among them that ran in plain MLX ops (``prefill.use_ops``).
path_counts: Counter[str] = Counter()

#: Fused block reads for prefill, tried in order by ``fused_read``. Each is called as
#: ``reader(keys, values, slots)`` with a layer's pool arrays and ``(B, T)`` int32
#: slots, and returns ``(B, H, T, D)`` K and V in the pool's dtype, or ``None``.
READERS: list[Callable[[mx.array, mx.array, mx.array], tuple[mx.array, mx.array] | None]] = []

#: How many prefill block reads each reader served, e.g. ``{"cuda_block_read": 16}``.
read_counts: Counter[str] = Counter()


def _initial_path() -> str:
    path = os.environ.get("MLX_PAGED_ATTENTION", "auto").strip().lower() or "auto"
    if path not in ATTENTION_PATHS:
        logger.warning(
            "mlx_paged: MLX_PAGED_ATTENTION=%r is not one of %s; using 'auto'.",
            path,
            "/".join(ATTENTION_PATHS),
        )
        return "auto"
    return path


_path = _initial_path()
_warned_no_kernel = False


def set_attention_path(path: str) -> None:
    """Choose the decode attention path: ``"auto"``, ``"kernel"`` or ``"gather"``.

    Overrides ``MLX_PAGED_ATTENTION``. ``"kernel"`` still falls back to the
    gather path (with one warning) where no kernel runs, e.g. on the CPU.
    """
    global _path, _warned_no_kernel
    if path not in ATTENTION_PATHS:
        raise ValueError(f"attention path must be one of {ATTENTION_PATHS}, got {path!r}.")
    _path = path
    _warned_no_kernel = False


def attention_path() -> str:
    """The decode attention path in force (see ``set_attention_path``)."""
    return _path


# Answers kept per device name, path and kernel entries. The keys hold the entries
# themselves, not their ids: an entry freed and replaced (a test's) may get its id again.
_ready: dict[tuple, bool | str] = {}


def kernels_ready() -> bool:
    """Whether a decode call may go to a fused kernel: the path is not ``"gather"`` and
    an entry of ``KERNELS`` runs on the default device (its ``available()``, if it has one)."""
    if _path == "gather" or not KERNELS:
        return False
    # By the device's name: an ``mx.Device`` hashes by identity, and each call makes a new one.
    key = (str(mx.default_device()), *KERNELS)
    ready = _ready.get(key)
    if ready is None:
        ready = _ready[key] = any(_available(k) for k in KERNELS)
    return ready


#: Head dims whose one-query attention MLX's CUDA backend runs in its vector kernel, which
#: reads a view of the pool where it lies. Others go through matrix products that copy the
#: view's K and V at every step (BENCHMARKS.md, runs 615-616).
CUDA_VIEW_HEAD_DIMS = frozenset({64, 96, 128})


def views_read_in_place(head_dim: int) -> bool:
    """Whether a one-query step should read views of the pool (``run_view``) rather than
    go to a fused kernel: on CUDA, only for ``CUDA_VIEW_HEAD_DIMS`` or where no kernel
    may take the call (``kernels_ready()``)."""
    return head_dim in CUDA_VIEW_HEAD_DIMS or not kernels_ready() or not on_cuda()


def one_token_read(dk: int, dv: int) -> str:
    """How a one-token step of one sequence's cache (``PagedKVCache``), whose pool defers its
    reads to a fused kernel (``defer_reads``), should read its K/V of head dims ``dk`` and ``dv``:

    - ``"views"``: views of the pool for MLX's attention where its blocks are consecutive
      (``views_read_in_place``);
    - ``"store"``: a fused kernel reads the blocks and stores the token (``kernels_write``);
    - ``"read"``: a fused kernel reads the blocks; the cache writes the token first;
    - ``"gather"``: path ``kernel`` where no kernel runs (it gathers, see ``paged_attention``).

    Kept per device, path, kernel list and head dims: every decode layer asks.
    """
    key = ("one_token", _path, str(mx.default_device()), dk, dv, *KERNELS)
    read = _ready.get(key)
    if read is None:
        if not kernels_ready():
            read = "gather" if _path == "kernel" else "views"
        elif _path != "kernel" and views_read_in_place(dk) and views_read_in_place(dv):
            read = "views"
        else:
            read = "store" if kernels_write() else "read"
        _ready[key] = read
    return read


@functools.cache
def _cuda_build() -> bool:
    return bool(getattr(mx, "cuda", None) and mx.cuda.is_available())


def on_cuda() -> bool:
    """Whether the default device is a CUDA GPU."""
    return _cuda_build() and mx.default_device() == mx.gpu


def kernels_write() -> bool:
    """Whether a decode call may leave its K/V write to the kernel (``PagedView.new_keys``):
    ``kernels_ready()``, and every entry of ``KERNELS`` that runs here stores new rows (its
    ``writes``). Entries that do not are never offered such a view."""
    if not kernels_ready():
        return False
    key = ("writes", str(mx.default_device()), *KERNELS)
    ready = _ready.get(key)
    if ready is None:
        ready = _ready[key] = all(getattr(k, "writes", False) for k in KERNELS if _available(k))
    return ready


def prefill_kernels_ready() -> bool:
    """Whether a batched prefill call may go to a fused kernel: the path is not ``"gather"``
    and an entry of ``PREFILL_KERNELS`` runs on the default device."""
    if _path == "gather" or not PREFILL_KERNELS:
        return False
    key = ("prefill", str(mx.default_device()), *PREFILL_KERNELS)
    ready = _ready.get(key)
    if ready is None:
        ready = _ready[key] = any(_available(k) for k in PREFILL_KERNELS)
    return ready


def _available(kernel: Callable) -> bool:
    available = getattr(kernel, "available", None)
    return available is None or bool(available())


def _warn_no_kernel() -> None:
    global _warned_no_kernel
    if not _warned_no_kernel:
        _warned_no_kernel = True
        logger.warning(
            "mlx_paged: attention path 'kernel' was requested but no fused kernel runs here "
            "(device %s); using the gather path.",
            mx.default_device(),
        )


def paged_attention(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    cache: Any,
    scale: float,
    mask: mx.array | str | None,
    sinks: mx.array | None = None,
) -> mx.array:
    """Attention for a layer whose cache is paged.

    Args:
        queries: ``(B, n_heads, L, D)``.
        keys, values: what the layer's ``update_and_fetch`` returned (or the
            model's own transform of it, as in MLA), ``(B, n_kv_heads, T, D)``.
        cache: the layer's paged cache; it says whether ``keys``, ``values``
            and ``mask`` are its own (``fetched``) and where its blocks lie
            (``paged_view``).
        scale, mask, sinks: as in ``mx.fast.scaled_dot_product_attention``.
    """
    own = cache.fetched(keys, values, mask) and _path != "gather"
    if own and queries.shape[2] == 1 and KERNELS:
        view = cache.paged_view()
        writes, ropes = view.new_keys is not None, view.rope is not None
        for kernel in KERNELS:
            if writes and not getattr(kernel, "writes", False):
                continue
            if ropes and not getattr(kernel, "ropes", False):
                continue
            out = kernel(queries, view, scale, sinks)
            if out is not None:
                path_counts[getattr(kernel, "__name__", "kernel")] += 1
                if writes:
                    cache.kernel_stored(out)
                return out
        if _path == "kernel":
            _warn_no_kernel()
    elif own and queries.shape[2] > 1 and PREFILL_KERNELS and (view := cache.prefill_view()):
        for kernel in PREFILL_KERNELS:
            out = kernel(queries, view, scale, sinks)
            if out is not None:
                path_counts[getattr(kernel, "__name__", "kernel")] += 1
                return out
    queries = cache.rotated_queries(queries)
    keys, values = cache.deferred_read(keys, values) or (keys, values)
    path_counts["in_place" if cache.reads_in_place() else "gather"] += 1
    if use_ops(queries, keys, sinks):  # a CUDA prefill: no fused-kernel graph to build
        path_counts["prefill_ops"] += 1
        return attention_by_ops(queries, keys, values, scale, mask)
    return mx.fast.scaled_dot_product_attention(
        queries, keys, values, scale=scale, mask=mask, sinks=sinks
    )


def fused_read(
    keys: mx.array, values: mx.array, slots: mx.array
) -> tuple[mx.array, mx.array] | None:
    """Tokens at pool ``slots`` ``(B, T)`` read by a device kernel, or ``None``.

    ``None`` (the caller reads with portable MLX ops) when the path is
    ``"gather"`` or no entry of ``READERS`` takes the call.
    """
    if _path == "gather":
        return None
    for reader in READERS:
        out = reader(keys, values, slots)
        if out is not None:
            read_counts[getattr(reader, "__name__", "reader")] += 1
            return out
    return None


def scaled_dot_product_attention(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    cache: Any,
    scale: float,
    mask: mx.array | str | None,
    sinks: mx.array | None = None,
) -> mx.array:
    """Drop-in for mlx-lm's function: paged caches go to ``paged_attention``."""
    if isinstance(cache, PagedLayerCache):
        return paged_attention(queries, keys, values, cache, scale, mask, sinks)
    return _original_sdpa(queries, keys, values, cache, scale=scale, mask=mask, sinks=sinks)


def route_attention() -> int:
    """Rebind mlx-lm's attention function wherever it is bound; return how many names changed.

    Idempotent. Modules imported later pick the wrapper up from ``base``. Also routes
    mlx-lm's GatedDeltaNet recurrence (``recurrent.route_gated_delta``) and its Mamba2
    decode steps (``mamba.route_ssm_update``) to CUDA kernels.
    """
    route_gated_delta()
    route_ssm_update()
    changed = 0
    for name, module in list(sys.modules.items()):
        if not name.startswith("mlx_lm") or module is None:
            continue
        for attr, value in list(vars(module).items()):
            if value is _original_sdpa:
                setattr(module, attr, scaled_dot_product_attention)
                changed += 1
    return changed


def route_model(model: nn.Module) -> None:
    """``route_attention()``, and ``model``'s depthwise convolutions to
    ``convolution.DepthwiseConv1d`` (``route_convolutions``)."""
    route_attention()
    route_convolutions(model)


def _register_device_kernels() -> None:
    for kernel in DEVICE_KERNELS:
        if kernel not in KERNELS:
            KERNELS.append(kernel)
    for kernel in DEVICE_PREFILL_KERNELS:
        if kernel not in PREFILL_KERNELS:
            PREFILL_KERNELS.append(kernel)
    for reader in DEVICE_READERS:
        if reader not in READERS:
            READERS.append(reader)
    for storer in DEVICE_STORERS:
        if storer not in STORERS:
            STORERS.append(storer)


_register_device_kernels()
