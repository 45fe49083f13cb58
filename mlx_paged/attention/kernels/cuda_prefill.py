"""Fused paged prefill attention for MLX's CUDA backend: tensor cores over the blocks in place.

A batched prefill forward's attention in plain MLX ops gathers every sequence's
K/V, materialises a ``(B, heads, L, T)`` score matrix and masks and softmaxes it
in separate passes; MLX's fused SDPA builds a cuDNN graph for every new shape
(about 50 ms; BENCHMARKS.md, runs 142 and 312). This kernel builds nothing per
shape and holds no scores: each thread block takes ``BQ`` rows of one sequence and
KV head, (query, head) pairs over every query head that shares it (``PACK_HEADS``),
walks the visible keys in tiles (64, 32 or 16 rows by head dim) read through the
block table into shared memory once for all those heads, and keeps an online softmax
per row in registers (flash attention, with ``mma.sync`` m16n8k16 tiles in float16
or bfloat16 and float32 accumulators). Queries see the keys ``PrefillView``
describes: causal from each sequence's offset, right padding, sliding window. With
the heads in one block a 16-token suffix of a model with 4 query heads per KV head
fills a 64-row tile, where one head a block left three quarters of it padding and
read every key four times.

A call of few query tiles over long contexts (a short suffix after a long cached
prefix, alone or in a small batch) would leave most of the GPU idle while a few
blocks walk every key. Such a call splits each block's keys over ``num_splits``
blocks (``plan_splits``); each writes a float32 partial output and its rows'
log-sum-exp, and the launch merges them in a few fused MLX ops.

It needs sm_80 or later, queries in the pool's dtype (float16 or bfloat16),
one head dim for K and V that is a multiple of 16 up to 256, and no attention
sinks; ``prefill_reason`` says why a call is declined. Metal has no such kernel:
its prefill keeps MLX's attention.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import mlx.core as mx

from .cubin import CudaKernel, architecture
from .cuda import LOG2E
from .plan import LaunchCache, compiled_launch, float_bits, kernel_templates
from .source import prefill_source

if TYPE_CHECKING:
    from ..records import PrefillView

QUERIES_PER_BLOCK = 64  # rows (query, head) a thread block: 16 per warp
# Whether a block's rows interleave every query head of one KV head (``_heads_per_block``).
PACK_HEADS = True
TENSOR_TYPES = (mx.float16, mx.bfloat16)
MAX_HEAD_DIM = 256  # two K and V tiles (64, 32 or 16 rows by head dim) stay under 48 KB
# Split the keys when a call has fewer thread blocks than TARGET_BLOCKS and its rows may
# see SPLIT_FROM_KEYS keys or more, into at most MAX_SPLITS splits of at least
# MIN_SPLIT_KEYS keys each. Measured on an H200 with each layer's call waiting on the last
# (BENCHMARKS.md, runs 343-344): 16 queries after 8k-32k cached keys took a fifth to half
# the time in 8-32 splits.
TARGET_BLOCKS = 512
SPLIT_FROM_KEYS = 4096
MIN_SPLIT_KEYS = 1024
MAX_SPLITS = 32

_INPUTS = ["queries", "keys", "values", "block_tables", "starts", "offsets", "lengths"]
_kernel_obj: dict[bool, CudaKernel] = {}


def _kernel(split: bool) -> CudaKernel:
    if split not in _kernel_obj:
        header, body = prefill_source(split)
        name, outputs = (
            ("paged_prefill_split", ["part", "part_lse"]) if split else ("paged_prefill", ["out"])
        )
        _kernel_obj[split] = CudaKernel(name, _INPUTS, outputs, body, header)
    return _kernel_obj[split]


def _tensor_cores() -> bool:
    """Whether the GPU has ``mma.sync`` m16n8k16 for float16 and bfloat16 (sm_80+); true
    where the architecture cannot be read (a build error then fails the self-check)."""
    arch = architecture()
    if arch is None:
        return True
    digits = "".join(c for c in arch if c.isdigit())
    return not digits or int(digits[:2]) >= 80


def prefill_reason(queries: mx.array, view: PrefillView, sinks: mx.array | None) -> str | None:
    """Why the kernel cannot run this call, or ``None`` if it can."""
    if sinks is not None:
        return "attention sinks"
    if queries.ndim != 4:
        return f"queries {queries.shape}"
    B, n_heads, _, d = queries.shape
    _, _, n_kv, kdim = view.keys.shape
    if view.values.shape != view.keys.shape or kdim != d:
        return f"pools {view.keys.shape} / {view.values.shape} for queries {queries.shape}"
    if n_heads % n_kv:
        return f"{n_heads} query heads over {n_kv} KV heads"
    if d % 16 or d > MAX_HEAD_DIM:
        return f"head dim {d}"
    dtype = view.keys.dtype
    if dtype not in TENSOR_TYPES or view.values.dtype != dtype or queries.dtype != dtype:
        return f"dtypes {queries.dtype}/{dtype}/{view.values.dtype}"
    if view.block_tables.ndim != 2 or view.block_tables.shape[0] != B:
        return f"block_tables {view.block_tables.shape} for batch {B}"
    if B > 65535 or n_heads > 65535:
        return f"grid of {B} sequences x {n_heads} heads"
    if not _tensor_cores():
        return f"architecture {architecture()} (mma.sync m16n8k16 needs sm_80)"
    return None


def plan_splits(queries: mx.array, view: PrefillView) -> int:
    """How many splits each thread block's keys go into: 1 while the call's rows alone
    give ``TARGET_BLOCKS`` thread blocks or its longest visible span (the table's width,
    or the window) is under ``SPLIT_FROM_KEYS``, else enough to reach ``TARGET_BLOCKS``,
    each of at least ``MIN_SPLIT_KEYS`` of the span."""
    B, HQ, L, _ = queries.shape
    pg = _heads_per_block(queries, view)
    blocks = _tiles(L, pg) * (HQ // pg) * B
    span = view.block_tables.shape[1] * view.block_size
    if view.window:
        span = min(span, view.window + QUERIES_PER_BLOCK)
    if blocks >= TARGET_BLOCKS or span < SPLIT_FROM_KEYS:
        return 1
    return max(1, min(-(-TARGET_BLOCKS // blocks), span // MIN_SPLIT_KEYS, MAX_SPLITS))


def _heads_per_block(queries: mx.array, view: PrefillView) -> int:
    """Query heads a thread block's rows interleave: all of one KV head's (``PACK_HEADS``), so
    that they read its K/V tiles once, or 1."""
    return queries.shape[1] // view.keys.shape[2] if PACK_HEADS else 1


def _tiles(L: int, heads: int) -> int:
    """Thread blocks per head group and sequence: its ``L * heads`` rows in tiles."""
    return -(-L * heads // QUERIES_PER_BLOCK)


def merge_splits(part: mx.array, lse: mx.array, dtype: mx.Dtype) -> mx.array:
    """The output ``(B, HQ, L, D)`` from ``S`` splits' normalised partial outputs ``part``
    ``(S, B, HQ, L, D)`` and their rows' log2-sum-exp ``lse`` ``(S, B, HQ, L)`` (``-inf``
    where a split saw no key); rows no split saw are zeros."""
    top = lse.max(axis=0)
    top = mx.where(mx.isinf(top), 0.0, top)
    w = mx.exp((lse - top) * math.log(2.0))
    den = mx.maximum(w.sum(axis=0), 1e-30)
    return ((part * w[..., None]).sum(axis=0) / den[..., None]).astype(dtype)


def _make_launch(
    queries: mx.array,
    view: PrefillView,
    scale: float,
    sinks: mx.array | None,
    num_splits: int | None,
):
    if prefill_reason(queries, view, sinks):
        return None
    B, HQ, L, D = queries.shape
    S = plan_splits(queries, view) if num_splits is None else max(1, min(num_splits, MAX_SPLITS))
    pg = _heads_per_block(queries, view)
    template = [
        ("T", view.keys.dtype),
        ("D", D),
        ("HQ", HQ),
        ("HKV", view.keys.shape[2]),
        ("BS", view.block_size),
        ("WINDOW", view.window or 0),
        ("SCALE_BITS", float_bits(scale * LOG2E)),
        ("BQ", QUERIES_PER_BLOCK),
        ("PG", pg),
    ]
    kernel_templates.add(("cuda_paged_prefill" + ("_split" if S > 1 else ""), *template))
    # 2 threads a row: 4 warps a block.
    grid = (_tiles(L, pg) * QUERIES_PER_BLOCK * 2, HQ // pg, B * S)

    def kernel_call(q, keys, values, tables, starts, offsets, lengths):
        inputs = [q, keys, values, tables, starts, offsets, lengths]
        common = {"template": template, "grid": grid, "threadgroup": (QUERIES_PER_BLOCK * 2, 1, 1)}
        if S == 1:
            return _kernel(False)(
                inputs=inputs, output_shapes=[(B, HQ, L, D)], output_dtypes=[q.dtype], **common
            )[0]
        part, lse = _kernel(True)(
            inputs=inputs,
            output_shapes=[(S, B, HQ, L, D), (S, B, HQ, L)],
            output_dtypes=[mx.float32, mx.float32],
            **common,
        )
        return merge_splits(part, lse, q.dtype)

    replay = compiled_launch(kernel_call)

    def launch(q: mx.array, view: PrefillView) -> mx.array:
        ints = (view.block_tables, view.starts, view.offsets, view.lengths)
        return replay(q, view.keys, view.values, *(_int32(x) for x in ints))

    return launch


_launches = LaunchCache()


def _int32(x: mx.array) -> mx.array:
    return x if x.dtype == mx.int32 else x.astype(mx.int32)


def _key(
    queries: mx.array,
    view: PrefillView,
    scale: float,
    sinks: mx.array | None,
    num_splits: int | None,
) -> tuple:
    """What a launch, and whether the kernel takes the call, depend on."""
    return (
        num_splits,
        PACK_HEADS,
        queries.shape,
        queries.dtype,
        view.keys.shape,
        view.keys.dtype,
        view.values.shape,
        view.values.dtype,
        view.block_tables.shape,
        view.window,
        scale,
        sinks is None,
    )


def paged_prefill_cuda(
    queries: mx.array,
    view: PrefillView,
    scale: float,
    sinks: mx.array | None = None,
    num_splits: int | None = None,
) -> mx.array | None:
    """Run the kernel; ``None`` if this call's shapes or dtypes are not supported.

    Args:
        queries: ``(B, n_heads, L, head_dim)``.
        view: where the batch's K/V lie and where its queries sit.
        scale, sinks: as in ``mx.fast.scaled_dot_product_attention`` (sinks decline).
        num_splits: force the number of key splits (1: none); ``None``: ``plan_splits``.
    """
    launch = _launches.get(
        _key(queries, view, scale, sinks, num_splits),
        lambda: _make_launch(queries, view, scale, sinks, num_splits),
    )
    return None if launch is None else launch(queries, view)
