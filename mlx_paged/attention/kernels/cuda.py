"""Fused paged decode attention for MLX's CUDA backend (``mx.fast.cuda_kernel``).

One thread block serves one (sequence, KV head, split) and all the query heads
of that KV head (up to ``heads_per_block``), so each K/V row is read from the
pool once, with 16-byte loads straight through the block table.

Each warp walks its own contiguous run of the block's rows, ``RS`` rows per
step, with no block-wide barrier in the loop: a step issues the K *and* V loads
of its rows together, and (``PF``) the next step's loads before it computes, so
load latency hides behind the dot products; it keeps the logits in registers
and updates the warp's own float32 online softmax. The
warps' partial results are merged through shared memory once, at the end.

With more than one split (flash-decoding: long contexts, small batches) each
block writes a partial output with its max and sum; the last block of a
(sequence, KV head) to finish, found with an atomic counter, merges the splits
and the sinks, so one launch does it all. Each launch zeroes its own counters
(a fill in the same compiled graph), so launches that MLX runs concurrently, as
independent nodes of one CUDA graph, never share them.

The kernel body is ``paged_decode.kernel``, shared with the Metal kernel
(``source.py``); with a cold tier (``PagedView.cold``) the same body reads
quantized blocks directly. Given the step's new K/V rows (``PagedView.new_keys``),
a launch stores them in their slots itself before it reads (``FW``): a decode
step then has no scatter per layer, whose host cost grows with the pool's size.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import mlx.core as mx

from .cubin import CudaKernel
from .plan import (
    DecodePlan,
    Launch,
    LaunchCache,
    base_template,
    call_key,
    compiled_launch,
    kernel_templates,
    plan_decode,
    rows_per_step,
)
from .source import decode_source

if TYPE_CHECKING:
    from ..records import PagedView

NUM_WARPS = 8
# Warps per block for unsplit launches with at least WIDE_BLOCKS blocks (B=64 x 8 KV heads):
# measured on an H100, 4 warps walking longer runs beat 8 by 2-6 % there.
NUM_WARPS_WIDE = 4
WIDE_BLOCKS = 512
# Warps of a block that serve different head groups (at most). Measured on an H100, whole
# blocks per head group (1) beat spreading a block over heads at every batch and length.
HEAD_WARPS = 1
# Rows one warp loads per step, for 256-byte rows (fp16 x 128): ROWS_PER_STEP when each
# warp walks at least LONG_RUN rows, else ROWS_PER_STEP_SHORT. Measured on an H100 with
# prefetch, in graphs of dependent calls (32 rows spilled registers and ran 3x slower).
ROWS_PER_STEP = 16
ROWS_PER_STEP_SHORT = 8
LONG_RUN = 128
# With a cold tier: loads per lane per step for K and again for V (a cold row's packed
# words each, COLD_LANE_BYTES of them, or 16 bytes of a full-precision row); query heads
# per warp times a lane's elements (16 at both 8 and 4 bits) at most COLD_HEAD_ELEMS; no
# prefetch. Measured on an H100 (BENCHMARKS.md, runs 206-207 and 213): 4 heads a warp
# dequantize each row once for all of them, and their registers leave no room for a
# second step's loads; at 4 bits, 8-byte loads keep 4 heads a warp.
COLD_SLOTS = 4
COLD_HEAD_ELEMS = 64
COLD_LANE_BYTES = {8: 16, 4: 8}
COLD_PREFETCH = False
PREFETCH = True  # load a warp's next step while it computes this one (measured 1.1-1.3x)
# Pool and cold arrays of at least NARROW_BYTES reach the kernel as views of their first
# row. The kernel reads every row through the view's pointer, the array's own, while MLX's
# dispatch spends host time on a kernel's input by its size (BENCHMARKS.md, runs 536-542).
NARROW_BYTES = 128 << 20
# Split a sequence when the batch alone gives fewer warps than this. Measured on an H100
# with prefetch: B=16 ran fastest unsplit; B=1 in sqrt(tokens / 64) splits (4 at 1k, 8 at
# 4k, 16 at 16k); more splits only added partial outputs to merge.
TARGET_WARPS = 1024
SPLIT_UNIT = 64
MAX_SPLITS = 32  # the merging block holds every split's weights (MAXS in the kernel)
LOG2E = 1.4426950408889634

# The kernel's source: a header (helpers) and the body MLX wraps in its generated signature.
HEADER, DECODE_SOURCE = decode_source("cuda", merge_inline=True)

_INPUTS = [
    *("queries", "keys", "values", "block_tables", "starts", "lengths", "sinks", "counters"),
    *("cold", "new_keys", "new_values", "rope_freqs"),
]
_OUTPUTS = ["out", "part_out", "part_max", "part_sum"]
# Inputs a launch leaves out (passes as None) when its template set does not read them:
# sinks without SINKS, counters without splits, the cold tier's records without QBITS, the
# new K/V rows without FW.
_ABSENT = {"sinks": mx.float32, "counters": mx.int32, "cold": mx.uint32}
_ABSENT |= {"new_keys": "T", "new_values": "T", "rope_freqs": mx.float32}
_kernel_obj: list[object] = []
#: Per decode variant launched (its base template and input signature), what ``prebuild``
#: needs to build that variant's other warp, row and split layouts.
_variants: dict[tuple, tuple] = {}


def _kernel() -> object:
    """The kernel object (one binary per template set, compiled once per machine)."""
    if not _kernel_obj:
        _kernel_obj.append(
            CudaKernel(
                "paged_decode", _INPUTS, _OUTPUTS, DECODE_SOURCE, HEADER, _ABSENT, ["cold_base"]
            )
        )
    return _kernel_obj[0]


def _narrow(x: mx.array) -> mx.array:
    """A whole, row-contiguous pool or cold array as the kernel takes it: itself, or from
    ``NARROW_BYTES`` on a view of its first row (the same pointer, a small input)."""
    return x[:1] if x.nbytes >= NARROW_BYTES else x


def _as(x: mx.array, dtype: mx.Dtype) -> mx.array:
    return x if x.dtype == dtype else x.astype(dtype)


def warp_layout(groups: int, num_warps: int, head_warps: int) -> tuple[int, int]:
    """Split a block's warps into (head groups per block, warps per head group's rows).

    Warps of one block that serve different KV heads of the same rows read
    neighbouring slices of each pool row (layout A keeps a token's heads together),
    so the block streams whole rows.
    """
    wh = math.gcd(groups, num_warps, head_warps)
    return wh, num_warps // wh


def _span(view: PagedView) -> int:
    """The most tokens one sequence's query reads: the table's width, or the window."""
    span = view.block_tables.shape[1] * view.block_size
    return span if view.window is None else min(span, view.window)


def cuda_plan(
    queries: mx.array,
    view: PagedView,
    num_splits: int | None = None,
    num_warps: int = NUM_WARPS,
    head_warps: int = HEAD_WARPS,
    lane_bytes: int | None = None,
) -> DecodePlan:
    """How the kernel would run this call, or a plan with ``reason`` set if it cannot.

    ``lane_bytes`` overrides ``COLD_LANE_BYTES`` (bytes of a cold row a lane loads).
    """
    if view.cold is None:
        plan = plan_decode(queries, view)
    else:
        lane_bytes = lane_bytes or COLD_LANE_BYTES.get(view.cold.bits, 16)
        plan = plan_decode(queries, view, COLD_HEAD_ELEMS, lane_bytes)
    if plan.reason:
        return plan
    if num_splits is None:
        groups = plan.n_kv_heads * (plan.group // plan.heads_per_block)
        _, wr = warp_layout(groups, num_warps, head_warps)
        warps = plan.batch * groups * wr  # warps with one split
        span = _span(view)
        want = math.ceil(TARGET_WARPS / warps)
        num_splits = max(1, min(want, math.isqrt(span // SPLIT_UNIT), MAX_SPLITS))
    plan.num_splits = max(1, min(num_splits, MAX_SPLITS))
    return plan


def _make_launch(
    queries: mx.array,
    view: PagedView,
    scale: float,
    has_sinks: bool,
    num_splits: int | None,
    num_warps: int | None,
    rows: int | None,
    head_warps: int | None,
    prefetch: bool | None,
    lane_bytes: int | None,
) -> Launch | None:
    """The launch for this call's shapes, or ``None`` if the kernel cannot run them."""
    nw = num_warps or NUM_WARPS
    hw = head_warps or HEAD_WARPS
    plan = cuda_plan(queries, view, num_splits, nw, hw, lane_bytes)
    if plan.reason:
        return None
    B, HQ, dv, S = plan.batch, plan.n_heads, plan.dv, plan.num_splits
    groups = plan.n_kv_heads * (plan.group // plan.heads_per_block)
    if num_warps is None and S == 1 and B * groups >= WIDE_BLOCKS:
        nw = NUM_WARPS_WIDE
    wh, wr = warp_layout(groups, nw, hw)
    run = math.ceil(_span(view) / (S * wr))  # rows each warp walks
    base = rows or (ROWS_PER_STEP if run >= LONG_RUN else ROWS_PER_STEP_SHORT)
    bits = 0 if view.cold is None else view.cold.bits
    if bits:  # ``rows`` overrides the cold tier's slots per lane
        base = rows or COLD_SLOTS
    rs = rows_per_step(plan.dk, dv, view.keys.dtype.size, base, plan.cold_elems)
    # Logits live in the log2 domain (exp2f), so the scale carries log2(e).
    template = base_template(plan, queries, view, has_sinks, scale * LOG2E)
    pf = (COLD_PREFETCH if bits else PREFETCH) if prefetch is None else prefetch
    fw = view.new_keys is not None
    rope = view.rope  # the launch rotates its queries (and with FW the keys it stores)
    trad = rope is not None and rope.traditional
    turned = 0 if rope is None else 2 * rope.freqs.shape[0]  # each head's dimensions rotated
    layouts = [("NW", nw), ("WH", wh), ("RS", rs), ("PF", pf), ("FW", fw)]
    layouts += [("ROPE", turned), ("ROPE_TRAD", trad)]
    kernel_templates.add(("cuda_paged_decode", *template, *layouts))
    if (num_warps, rows, head_warps, prefetch, lane_bytes) == (None,) * 5:
        main = [queries, view.keys, view.values, view.block_tables, view.starts, view.lengths]
        cold_parts = [view.cold.blob] if bits else []
        _variants.setdefault(
            (tuple(template), fw, turned, trad),
            (
                list(template),
                [_signature(x) for x in main],
                has_sinks,
                [_signature(x) for x in cold_parts],
                groups,
                plan,
                view.keys.dtype.size,
                pf,
                fw,
                (turned, trad),
            ),
        )
    template += layouts
    blocks = groups // wh
    parts = (B, HQ, S) if S > 1 else (1,)  # unused without splits
    grid = (blocks * nw * 32, B, S)
    threads = (nw * 32, 1, 1)
    output_shapes = [(B, HQ, 1, dv), (*parts, dv) if S > 1 else (1,), parts, parts]
    output_dtypes = [queries.dtype, mx.float32, mx.float32, mx.float32]
    slots = B * blocks if S > 1 else 0  # split counters: one per (sequence, block column)
    cold = view.cold is not None

    def kernel_call(base, q, keys, values, tables, starts, lengths, *rest):
        # rest: the sinks (with SINKS), the cold tier's records (with a cold tier), the new
        # K/V rows (with FW), then the rotation's angles (with ROPE)
        sinks = rest[0] if has_sinks else None
        freqs = rest[-1] if rope is not None else None
        new = list(rest[-2 - (freqs is not None) :][:2]) if fw else [None] * 2
        records = _narrow(rest[has_sinks]) if cold else None
        keys, values = _narrow(keys), _narrow(values)
        counters = mx.zeros((slots,), dtype=mx.int32) if slots else None
        inputs = [q, keys, values, tables, starts, lengths, sinks, counters, records, *new]
        return _kernel()(
            inputs=[*inputs, freqs],
            template=template,
            grid=grid,
            threadgroup=threads,
            output_shapes=output_shapes,
            output_dtypes=output_dtypes,
            scalars={"cold_base": base} if cold else None,
        )[0]

    # The cold records stack the blocks of several layers, and a layer's start in them
    # (cold_base) is a scalar of the launch: one replay per start, all in this one launch.
    replays: dict[int, Callable[..., mx.array]] = {}

    def launch(q: mx.array, view: PagedView, sinks: mx.array | None) -> mx.array:
        rest = [_as(sinks, mx.float32)] if has_sinks else []
        base = 0
        if cold:
            rest.append(view.cold.blob)
            base = view.cold.layer * view.cold.blob.shape[1]
        if fw:
            rest += [view.new_keys, view.new_values]
        if rope is not None:
            rest.append(view.rope.freqs)
        if base not in replays:
            replays[base] = compiled_launch(functools.partial(kernel_call, base))
        ids = (_as(x, mx.int32) for x in (view.block_tables, view.starts, view.lengths))
        return replays[base](q, view.keys, view.values, *ids, *rest)

    return launch


_launches = LaunchCache()


def _signature(x: mx.array) -> tuple[mx.Dtype, int]:
    """An input's dtype and rank: all a build reads of it."""
    return x.dtype, x.ndim


def _stand_in(signature: tuple[mx.Dtype, int]) -> mx.array:
    """A lazy array of a signature's dtype and rank (never evaluated)."""
    dtype, ndim = signature
    return mx.zeros((1,) * ndim, dtype=dtype)


def prebuild() -> int:
    """Build every default warp, row and split layout of each decode variant launched so far.

    A variant's launches pick their layout by batch size and context length (``NW``,
    ``RS``, split-K or not), each another binary: a warm-up that decoded short contexts
    only leaves the layouts of long ones for the first real requests, about a second of
    NVRTC each on a machine that has not built them. Returns how many layouts it built
    (or found on disk); 0 where binaries cannot be built ahead (MLX compiles them at
    their first launch there).
    """
    build = getattr(_kernel(), "build", None)
    if build is None:
        return 0
    built = 0
    for variant in list(_variants.values()):
        base, main, has_sinks, cold, groups, plan, itemsize, pf, fw, (rope, trad) = variant
        row_bases = (COLD_SLOTS,) if cold else (ROWS_PER_STEP, ROWS_PER_STEP_SHORT)
        rows = {rows_per_step(plan.dk, plan.dv, itemsize, r, plan.cold_elems) for r in row_bases}
        inputs = [_stand_in(x) for x in main]
        sinks = _stand_in((mx.float32, 1)) if has_sinks else None
        records = _stand_in(cold[0]) if cold else None
        new = [_stand_in((main[1][0], 4))] * 2 if fw else [None] * 2
        counters = _stand_in((mx.int32, 1))
        outputs = [main[0][0], mx.float32, mx.float32, mx.float32]
        # Wide blocks (NUM_WARPS_WIDE) only ever run unsplit.
        for nw, split in ((NUM_WARPS, False), (NUM_WARPS, True), (NUM_WARPS_WIDE, False)):
            wh, _ = warp_layout(groups, nw, HEAD_WARPS)
            for rs in sorted(rows):
                template = [*base, ("NW", nw), ("WH", wh), ("RS", rs), ("PF", pf), ("FW", fw)]
                template += [("ROPE", rope), ("ROPE_TRAD", trad)]
                freqs = _stand_in((mx.float32, 1)) if rope else None
                args = [*inputs, sinks, counters if split else None, records, *new, freqs]
                if build(args, template, outputs, ["cold_base"] if cold else []):
                    kernel_templates.add(("cuda_paged_decode", *template))
                    built += 1
    return built


def decode_launch(
    queries: mx.array,
    view: PagedView,
    scale: float,
    sinks: mx.array | None,
    num_splits: int | None = None,
    *,
    num_warps: int | None = None,
    rows: int | None = None,
    head_warps: int | None = None,
    prefetch: bool | None = None,
    lane_bytes: int | None = None,
) -> Launch | None:
    """The launch for calls shaped like this one (made once per shape), or ``None`` if the
    kernel does not support their shapes or dtypes.

    Args:
        queries: ``(B, n_heads, 1, k_head_dim)``.
        view: the batch's blocks.
        scale, sinks: as in ``mx.fast.scaled_dot_product_attention``.
        num_splits: force the number of splits per sequence (1 turns split-K off);
            ``None`` picks one from the batch size and the table width.
        num_warps, rows, head_warps, prefetch, lane_bytes: tuning overrides (warps
            per block; rows per warp step for 256-byte rows, or with a cold tier loads
            per lane per step; most head groups per block; load the next step during
            this one; bytes of a cold row a lane loads, 8 or 16); ``None`` takes
            ``NUM_WARPS`` (or ``NUM_WARPS_WIDE``) / ``ROWS_PER_STEP``,
            ``ROWS_PER_STEP_SHORT`` or ``COLD_SLOTS`` / ``HEAD_WARPS`` / ``PREFETCH``
            (``COLD_PREFETCH``) / ``COLD_LANE_BYTES``.

    Raises:
        ValueError: ``num_warps`` other than 1, 2, 4 or 8, or ``lane_bytes`` other
            than 8 or 16 with a cold tier.
    """
    if num_warps not in (None, 1, 2, 4, 8):  # 16 warps of 32 threads need too many registers
        raise ValueError(f"num_warps must be 1, 2, 4 or 8, not {num_warps}")
    tuning = (num_splits, num_warps, rows, head_warps, prefetch, lane_bytes)
    key = call_key(queries, view, scale, sinks, *tuning)
    has_sinks = sinks is not None
    return _launches.get(key, lambda: _make_launch(queries, view, scale, has_sinks, *tuning))


def paged_decode_cuda(
    queries: mx.array,
    view: PagedView,
    scale: float,
    sinks: mx.array | None,
    num_splits: int | None = None,
    **tuning: int | bool | None,
) -> mx.array | None:
    """Run the CUDA kernel; ``None`` if this call's shapes or dtypes are not supported.

    Arguments as in ``decode_launch``.
    """
    launch = decode_launch(queries, view, scale, sinks, num_splits, **tuning)
    return None if launch is None else launch(queries, view, sinks)
