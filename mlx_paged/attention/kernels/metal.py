"""Fused paged decode attention for MLX's Metal backend (``mx.fast.metal_kernel``).

The same algorithm as ``cuda.py`` (one threadgroup per sequence, KV head and
split; all query heads of the KV head in the threadgroup; chunked online
softmax in float32; a second kernel merges splits and sinks), written with
Metal's SIMD-group functions and scalar loads.

NOT RUN HERE: no Apple-silicon machine was available while it was written, so
it has never been compiled or executed. ``dispatch`` therefore self-checks it
against the reference on random inputs at first use and, on a compile error or
a mismatch, logs a warning and keeps using the gather path.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import mlx.core as mx

from .plan import (
    DecodePlan,
    Launch,
    LaunchCache,
    base_template,
    call_key,
    compiled_launch,
    placeholder,
    plan_decode,
)

if TYPE_CHECKING:
    from ..records import PagedView

NUM_SIMDGROUPS = 4
PART = 512  # rows of logits kept in threadgroup memory per chunk
TARGET_GROUPS = 256  # threadgroups worth splitting for (a guess for M-series GPUs)
MIN_SPLIT_TOKENS = 256

DECODE_SOURCE = r"""
  constexpr int VEC = 16 / sizeof(T);   // elements one lane reads per step of a row
  constexpr int LK = (DK / VEC) < 32 ? (DK / VEC) : 32;  // lanes per key row
  constexpr int NK = (DK / VEC) / LK;
  constexpr int RK = 32 / LK;
  constexpr int LV = (DV / VEC) < 32 ? (DV / VEC) : 32;
  constexpr int NV = (DV / VEC) / LV;
  constexpr int RV = 32 / LV;
  constexpr int NT = NW * 32;
  constexpr int SMEM = (HG * PART > NW * HG * DV) ? HG * PART : NW * HG * DV;
  threadgroup float smem[SMEM];
  threadgroup float sred[NW * HG];
  const float NEG_INF = -metal::numeric_limits<float>::infinity();

  const int tid = int(thread_index_in_threadgroup);
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int kvh = int(threadgroup_position_in_grid.x) / (G / HG);
  const int hq0 = kvh * G + (int(threadgroup_position_in_grid.x) % (G / HG)) * HG;
  const int b = int(threadgroup_position_in_grid.y);
  const int split = int(threadgroup_position_in_grid.z);
  const int nsplit = int(threadgroups_per_grid.z);
  const int M = block_tables_shape[1];

  const int len = lengths[b];
  const int start = starts[b];
  int first = start;
  if (WINDOW > 0) first = max(first, len - WINDOW);
  const int n = max(len - first, 0);
  const int per = (n + nsplit - 1) / nsplit;
  const int lo = first + split * per;
  const int hi = min(lo + per, len);

  const int rgk = lane / LK, lik = lane % LK;
  const float sc = as_type<float>(SCALE_BITS);
  float q[HG][NK * VEC];
  for (int g = 0; g < HG; ++g)
    for (int j = 0; j < NK; ++j)
      for (int e = 0; e < VEC; ++e)
        q[g][j * VEC + e] =
            float(queries[ulong(b * HQ + hq0 + g) * DK + (j * LK + lik) * VEC + e]) * sc;

  const int rgv = lane / LV, liv = lane % LV;
  float m[HG], lsum[HG], acc[HG][NV * VEC];
  for (int g = 0; g < HG; ++g) {
    m[g] = NEG_INF;
    lsum[g] = 0.f;
    for (int i = 0; i < NV * VEC; ++i) acc[g][i] = 0.f;
  }

  for (int c0 = lo; c0 < hi; c0 += PART) {
    const int cn = min(PART, hi - c0);
    float cmax[HG];
    for (int g = 0; g < HG; ++g) cmax[g] = NEG_INF;
    // Pass 1: logits. The loop bound is uniform per SIMD-group (shuffles inside).
    for (int base = warp * RK; base < cn; base += NW * RK) {
      const int r = base + rgk;
      float s[HG];
      for (int g = 0; g < HG; ++g) s[g] = 0.f;
      if (r < cn) {
        const int pos = c0 + r;
        const int blk = block_tables[b * M + (pos - start) / BS];
        const ulong row = (ulong(blk) * BS + pos % BS) * HKV + kvh;
        for (int j = 0; j < NK; ++j)
          for (int e = 0; e < VEC; ++e) {
            float kf = float(keys[row * DK + (j * LK + lik) * VEC + e]);
            for (int g = 0; g < HG; ++g) s[g] += q[g][j * VEC + e] * kf;
          }
      }
      for (int g = 0; g < HG; ++g)
        for (ushort off = LK / 2; off > 0; off >>= 1)
          s[g] += simd_shuffle_xor(s[g], off);
      if (lik == 0 && r < cn)
        for (int g = 0; g < HG; ++g) {
          smem[g * PART + r] = s[g];
          cmax[g] = max(cmax[g], s[g]);
        }
    }
    for (int g = 0; g < HG; ++g) {
      cmax[g] = simd_max(cmax[g]);
      if (lane == 0) sred[warp * HG + g] = cmax[g];
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);

    float alpha[HG];
    for (int g = 0; g < HG; ++g) {
      float cm = sred[g];
      for (int w = 1; w < NW; ++w) cm = max(cm, sred[w * HG + g]);
      float mn = max(m[g], cm);
      alpha[g] = metal::exp(m[g] - mn);
      m[g] = mn;
      lsum[g] *= alpha[g];
    }
    for (int i = tid; i < cn; i += NT)
      for (int g = 0; g < HG; ++g) {
        float p = metal::exp(smem[g * PART + i] - m[g]);
        smem[g * PART + i] = p;
        lsum[g] += p;
      }
    threadgroup_barrier(mem_flags::mem_threadgroup);

    // Pass 2: acc += p * v.
    for (int g = 0; g < HG; ++g)
      for (int i = 0; i < NV * VEC; ++i) acc[g][i] *= alpha[g];
    for (int r = warp * RV + rgv; r < cn; r += NW * RV) {
      const int pos = c0 + r;
      const int blk = block_tables[b * M + (pos - start) / BS];
      const ulong row = (ulong(blk) * BS + pos % BS) * HKV + kvh;
      float p[HG];
      for (int g = 0; g < HG; ++g) p[g] = smem[g * PART + r];
      for (int j = 0; j < NV; ++j)
        for (int e = 0; e < VEC; ++e) {
          float vf = float(values[row * DV + (j * LV + liv) * VEC + e]);
          for (int g = 0; g < HG; ++g) acc[g][j * VEC + e] += p[g] * vf;
        }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }

  for (int g = 0; g < HG; ++g) {
    lsum[g] = simd_sum(lsum[g]);
    if (lane == 0) sred[warp * HG + g] = lsum[g];
    for (int i = 0; i < NV * VEC; ++i)
      for (ushort off = LV; off < 32; off <<= 1)
        acc[g][i] += simd_shuffle_xor(acc[g][i], off);
    if (rgv == 0)
      for (int j = 0; j < NV; ++j)
        for (int e = 0; e < VEC; ++e)
          smem[(warp * HG + g) * DV + (j * LV + liv) * VEC + e] = acc[g][j * VEC + e];
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (int idx = tid; idx < HG * DV; idx += NT) {
    const int g = idx / DV, d = idx % DV;
    float o = 0.f, l = 0.f;
    for (int w = 0; w < NW; ++w) {
      o += smem[(w * HG + g) * DV + d];
      l += sred[w * HG + g];
    }
    const ulong row = ulong(b) * HQ + hq0 + g;
    WRITE_OUT
  }
"""

WRITE_FINAL = r"""
    float mm = m[g];
    if (SINKS) {
      float sk = sinks[hq0 + g];
      float mx = max(mm, sk);
      float a = metal::exp(mm - mx);
      o *= a;
      l = l * a + metal::exp(sk - mx);
    }
    out[row * DV + d] = static_cast<OT>(l > 0.f ? o / l : 0.f);
"""

WRITE_PARTIAL = r"""
    const ulong at = row * ulong(nsplit) + split;
    part_out[at * DV + d] = l > 0.f ? o / l : 0.f;
    if (d == 0) {
      part_max[at] = m[g];
      part_sum[at] = l;
    }
"""

REDUCE_SOURCE = r"""
  const int hq = int(threadgroup_position_in_grid.x);
  const int b = int(threadgroup_position_in_grid.y);
  const int S = part_max_shape[2];
  const ulong row = ulong(b) * HQ + hq;
  float mt = -metal::numeric_limits<float>::infinity();
  for (int s = 0; s < S; ++s)
    if (part_sum[row * S + s] > 0.f) mt = max(mt, part_max[row * S + s]);
  if (SINKS) mt = max(mt, sinks[hq]);
  float den = SINKS ? metal::exp(sinks[hq] - mt) : 0.f;
  for (int s = 0; s < S; ++s) {
    float l = part_sum[row * S + s];
    if (l > 0.f) den += l * metal::exp(part_max[row * S + s] - mt);
  }
  for (int d = int(thread_index_in_threadgroup); d < DV; d += int(threads_per_threadgroup.x)) {
    float num = 0.f;
    for (int s = 0; s < S; ++s) {
      float l = part_sum[row * S + s];
      if (l > 0.f)
        num += l * metal::exp(part_max[row * S + s] - mt) * part_out[(row * S + s) * DV + d];
    }
    out[row * DV + d] = static_cast<OT>(den > 0.f ? num / den : 0.f);
  }
"""

_INPUTS = ["queries", "keys", "values", "block_tables", "starts", "lengths", "sinks"]
_kernels: dict[str, object] = {}


def _kernel(kind: str) -> object:
    if kind not in _kernels:
        if kind == "final":
            src = DECODE_SOURCE.replace("WRITE_OUT", WRITE_FINAL)
            k = mx.fast.metal_kernel("paged_decode", _INPUTS, ["out"], src)
        elif kind == "partial":
            src = DECODE_SOURCE.replace("WRITE_OUT", WRITE_PARTIAL)
            outs = ["part_out", "part_max", "part_sum"]
            k = mx.fast.metal_kernel("paged_decode_split", _INPUTS, outs, src)
        else:
            ins = ["part_out", "part_max", "part_sum", "sinks"]
            k = mx.fast.metal_kernel("paged_decode_reduce", ins, ["out"], REDUCE_SOURCE)
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
    plan.num_splits = max(1, num_splits)
    return plan


def _make_launch(
    queries: mx.array, view: PagedView, scale: float, has_sinks: bool, num_splits: int | None
) -> Launch | None:
    """The launch for this call's shapes, or ``None`` if the kernel cannot run them."""
    plan = metal_plan(queries, view, num_splits)
    if plan.reason:
        return None
    B, HQ, dv, S = plan.batch, plan.n_heads, plan.dv, plan.num_splits
    template = base_template(plan, queries, view, has_sinks, scale)
    template += [("NW", NUM_SIMDGROUPS), ("PART", PART)]
    groups = plan.n_kv_heads * (plan.group // plan.heads_per_block)
    grid = (groups * NUM_SIMDGROUPS * 32, B, S)
    threads = (NUM_SIMDGROUPS * 32, 1, 1)
    dtype = queries.dtype

    def kernel_calls(q, keys, values, tables, starts, lengths, sinks):
        inputs = [q, keys, values, tables, starts, lengths, sinks]
        if S == 1:
            (out,) = _kernel("final")(
                inputs=inputs,
                template=template,
                grid=grid,
                threadgroup=threads,
                output_shapes=[(B, HQ, 1, dv)],
                output_dtypes=[dtype],
            )
            return out
        part_out, part_max, part_sum = _kernel("partial")(
            inputs=inputs,
            template=template,
            grid=grid,
            threadgroup=threads,
            output_shapes=[(B, HQ, S, dv), (B, HQ, S), (B, HQ, S)],
            output_dtypes=[mx.float32] * 3,
        )
        (out,) = _kernel("reduce")(
            inputs=[part_out, part_max, part_sum, sinks],
            template=[("OT", dtype), ("DV", dv), ("HQ", HQ), ("SINKS", has_sinks)],
            grid=(HQ * 64, B, 1),
            threadgroup=(64, 1, 1),
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
        return replay(q, view.keys, view.values, tables, starts, lengths, sinks)

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
