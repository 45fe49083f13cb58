"""Fused paged decode attention for MLX's Metal backend (``mx.fast.metal_kernel``).

The kernel body is the one the CUDA kernel runs (``paged_decode.kernel``, built
by ``source.py`` with ``prelude_metal.h``): one threadgroup per sequence, KV
head group and split, 16-byte loads through the block table, quantized cold
blocks read directly. Split partials are merged by a second launch of the same
body's merge section instead of CUDA's last-block merge, which needs a
device-wide fence.

NOT RUN HERE: no Apple-silicon machine was available, so the Metal build has
never been compiled or executed; it differs from the CUDA build that the GPU
tests run only by its prelude. ``dispatch`` self-checks it against the
reference on random inputs at first use and, on a compile error or a mismatch,
logs a warning and keeps using the gather path.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import mlx.core as mx

from .cuda import COLD_SLOTS, LOG2E
from .plan import (
    DecodePlan,
    Launch,
    LaunchCache,
    base_template,
    call_key,
    cold_inputs,
    compiled_launch,
    kernel_templates,
    placeholder,
    plan_decode,
    rows_per_step,
)
from .source import decode_source, merge_source

if TYPE_CHECKING:
    from ..records import PagedView

NUM_SIMDGROUPS = 4
ROWS = 8  # rows a SIMD-group loads per step, for 256-byte rows (see plan.rows_per_step)
PREFETCH = False  # unmeasured on Apple GPUs: the simpler schedule until it is
TARGET_GROUPS = 256  # threadgroups worth splitting for (a guess for M-series GPUs)
MIN_SPLIT_TOKENS = 256
MAX_SPLITS = 32  # the merge holds every split's weights (MAXS in the body)

DECODE_HEADER, DECODE_SOURCE = decode_source("metal", merge_inline=False)
MERGE_HEADER, MERGE_SOURCE = merge_source("metal")

_INPUTS = [
    *("queries", "keys", "values", "block_tables", "starts", "lengths", "sinks"),
    *("cold", "cold_base"),
]
_kernels: dict[str, object] = {}


def _kernel(kind: str) -> object:
    """The decode (``"decode"``) or split-merge (``"merge"``) kernel object."""
    if kind not in _kernels:
        if kind == "decode":
            outs = ["out", "part_out", "part_max", "part_sum"]
            k = mx.fast.metal_kernel(
                "paged_decode", _INPUTS, outs, DECODE_SOURCE, header=DECODE_HEADER
            )
        else:
            ins = ["part_out", "part_max", "part_sum", "sinks"]
            k = mx.fast.metal_kernel(
                "paged_decode_merge", ins, ["out"], MERGE_SOURCE, header=MERGE_HEADER
            )
        _kernels[kind] = k
    return _kernels[kind]


def metal_plan(queries: mx.array, view: PagedView, num_splits: int | None = None) -> DecodePlan:
    """How the kernel would run this call, or a plan with ``reason`` set."""
    plan = plan_decode(queries, view, max_lanes_elems=32)
    if plan.reason:
        return plan
    if num_splits is None:
        base = plan.batch * plan.n_kv_heads * (plan.group // plan.heads_per_block)
        span = view.block_tables.shape[1] * view.block_size
        if view.window is not None:
            span = min(span, view.window)
        num_splits = 1
        if base < TARGET_GROUPS:
            num_splits = max(1, min(math.ceil(TARGET_GROUPS / base), span // MIN_SPLIT_TOKENS))
    plan.num_splits = max(1, min(num_splits, MAX_SPLITS))
    return plan


def _make_launch(
    queries: mx.array, view: PagedView, scale: float, has_sinks: bool, num_splits: int | None
) -> Launch | None:
    """The launch for this call's shapes, or ``None`` if the kernel cannot run them."""
    plan = metal_plan(queries, view, num_splits)
    if plan.reason:
        return None
    B, HQ, dv, S = plan.batch, plan.n_heads, plan.dv, plan.num_splits
    nw = NUM_SIMDGROUPS
    base = COLD_SLOTS if plan.cold_elems else ROWS
    rs = rows_per_step(plan.dk, dv, view.keys.dtype.size, base, plan.cold_elems)
    # Logits live in the log2 domain (exp2), so the scale carries log2(e).
    template = base_template(plan, queries, view, has_sinks, scale * LOG2E)
    template += [("NW", nw), ("WH", 1), ("RS", rs), ("PF", PREFETCH)]
    kernel_templates.add(("metal_paged_decode", *template))
    groups = plan.n_kv_heads * (plan.group // plan.heads_per_block)
    grid = (groups * nw * 32, B, S)
    threads = (nw * 32, 1, 1)
    dtype = queries.dtype
    parts = (B, HQ, S)
    if S == 1:
        shapes = [(B, HQ, 1, dv), (1,), (1,), (1,)]  # no partials
    else:
        shapes = [(1,), (*parts, dv), parts, parts]  # the merge launch writes the output

    def kernel_calls(q, keys, values, tables, starts, lengths, sinks, *cold):
        inputs = [q, keys, values, tables, starts, lengths, sinks, *cold]
        out, part_out, part_max, part_sum = _kernel("decode")(
            inputs=inputs,
            template=template,
            grid=grid,
            threadgroup=threads,
            output_shapes=shapes,
            output_dtypes=[dtype, mx.float32, mx.float32, mx.float32],
        )
        if S == 1:
            return out
        (out,) = _kernel("merge")(
            inputs=[part_out, part_max, part_sum, sinks],
            template=template,
            grid=grid[:2] + (1,),
            threadgroup=threads,
            output_shapes=[(B, HQ, 1, dv)],
            output_dtypes=[dtype],
        )
        return out

    replay = compiled_launch(kernel_calls)

    def launch(q: mx.array, view: PagedView, sinks: mx.array | None) -> mx.array:
        tables, starts, lengths = (
            x.astype(mx.int32) for x in (view.block_tables, view.starts, view.lengths)
        )
        sinks = placeholder(mx.float32) if sinks is None else sinks.astype(mx.float32)
        return replay(q, view.keys, view.values, tables, starts, lengths, sinks, *cold_inputs(view))

    return launch


_launches = LaunchCache()


def decode_launch(
    queries: mx.array,
    view: PagedView,
    scale: float,
    sinks: mx.array | None,
    num_splits: int | None = None,
) -> Launch | None:
    """The launch for calls shaped like this one (made once per shape), or ``None``."""
    key = call_key(queries, view, scale, sinks, num_splits)
    return _launches.get(
        key, lambda: _make_launch(queries, view, scale, sinks is not None, num_splits)
    )


def paged_decode_metal(
    queries: mx.array,
    view: PagedView,
    scale: float,
    sinks: mx.array | None,
    num_splits: int | None = None,
) -> mx.array | None:
    """Run the Metal kernel (never run here: see the module docstring); ``None`` to decline."""
    launch = decode_launch(queries, view, scale, sinks, num_splits)
    return None if launch is None else launch(queries, view, sinks)
