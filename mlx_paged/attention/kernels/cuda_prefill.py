"""Fused paged prefill attention for MLX's CUDA backend: tensor cores over the blocks in place.

A batched prefill forward's attention in plain MLX ops gathers every sequence's
K/V, materialises a ``(B, heads, L, T)`` score matrix and masks and softmaxes it
in separate passes; MLX's fused SDPA builds a cuDNN graph for every new shape
(about 50 ms; BENCHMARKS.md, runs 142 and 312). This kernel builds nothing per
shape and holds no scores: each thread block takes ``BQ`` queries of one
(sequence, query head), walks the visible keys in tiles (64, 32 or 16 rows by head
dim) read through the block table into shared memory, and keeps an online softmax per query in
registers (flash attention, with ``mma.sync`` m16n8k16 tiles in float16 or
bfloat16 and float32 accumulators). Queries see the keys ``PrefillView``
describes: causal from each sequence's offset, right padding, sliding window.

It needs sm_80 or later, queries in the pool's dtype (float16 or bfloat16),
one head dim for K and V that is a multiple of 16 up to 256, and no attention
sinks; ``prefill_reason`` says why a call is declined. Metal has no such kernel:
its prefill keeps MLX's attention.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import mlx.core as mx

from .cubin import CudaKernel, architecture
from .cuda import LOG2E
from .plan import LaunchCache, compiled_launch, float_bits, kernel_templates
from .source import prefill_source

if TYPE_CHECKING:
    from ..records import PrefillView

QUERIES_PER_BLOCK = 64  # 16 per warp
TENSOR_TYPES = (mx.float16, mx.bfloat16)
MAX_HEAD_DIM = 256  # two K and V tiles (64, 32 or 16 rows by head dim) stay under 48 KB

_INPUTS = ["queries", "keys", "values", "block_tables", "starts", "offsets", "lengths"]
_kernel_obj: list[CudaKernel] = []


def _kernel() -> CudaKernel:
    if not _kernel_obj:
        header, body = prefill_source()
        _kernel_obj.append(CudaKernel("paged_prefill", _INPUTS, ["out"], body, header))
    return _kernel_obj[0]


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


def _make_launch(queries: mx.array, view: PrefillView, scale: float, sinks: mx.array | None):
    if prefill_reason(queries, view, sinks):
        return None
    B, HQ, L, D = queries.shape
    template = [
        ("T", view.keys.dtype),
        ("D", D),
        ("HQ", HQ),
        ("HKV", view.keys.shape[2]),
        ("BS", view.block_size),
        ("WINDOW", view.window or 0),
        ("SCALE_BITS", float_bits(scale * LOG2E)),
        ("BQ", QUERIES_PER_BLOCK),
    ]
    kernel_templates.add(("cuda_paged_prefill", *template))
    tiles = -(-L // QUERIES_PER_BLOCK)

    def kernel_call(q, keys, values, tables, starts, offsets, lengths):
        return _kernel()(
            inputs=[q, keys, values, tables, starts, offsets, lengths],
            template=template,
            grid=(tiles * QUERIES_PER_BLOCK * 2, HQ, B),  # 2 threads a query: 4 warps a block
            threadgroup=(QUERIES_PER_BLOCK * 2, 1, 1),
            output_shapes=[(B, HQ, L, D)],
            output_dtypes=[queries.dtype],
        )[0]

    replay = compiled_launch(kernel_call)

    def launch(q: mx.array, view: PrefillView) -> mx.array:
        ints = (view.block_tables, view.starts, view.offsets, view.lengths)
        return replay(q, view.keys, view.values, *(_int32(x) for x in ints))

    return launch


_launches = LaunchCache()


def _int32(x: mx.array) -> mx.array:
    return x if x.dtype == mx.int32 else x.astype(mx.int32)


def _key(queries: mx.array, view: PrefillView, scale: float, sinks: mx.array | None) -> tuple:
    """What a launch, and whether the kernel takes the call, depend on."""
    return (
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
    queries: mx.array, view: PrefillView, scale: float, sinks: mx.array | None = None
) -> mx.array | None:
    """Run the kernel; ``None`` if this call's shapes or dtypes are not supported.

    Args:
        queries: ``(B, n_heads, L, head_dim)``.
        view: where the batch's K/V lie and where its queries sit.
        scale, sinks: as in ``mx.fast.scaled_dot_product_attention`` (sinks decline).
    """
    launch = _launches.get(
        _key(queries, view, scale, sinks), lambda: _make_launch(queries, view, scale, sinks)
    )
    return None if launch is None else launch(queries, view)
