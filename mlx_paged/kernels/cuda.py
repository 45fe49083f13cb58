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
    from ..attention import PagedView

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
PREFETCH = True  # load a warp's next step while it computes this one (measured 1.1-1.3x)
# Split a sequence when the batch alone gives fewer warps than this. Measured on an H100
# with prefetch: B=16 ran fastest unsplit; B=1 in sqrt(tokens / 64) splits (4 at 1k, 8 at
# 4k, 16 at 16k); more splits only added partial outputs to merge.
TARGET_WARPS = 1024
SPLIT_UNIT = 64
MAX_SPLITS = 32  # the merging block holds every split's weights (MAXS in the kernel)
LOG2E = 1.4426950408889634

HEADER = r"""
#define PD_NEG_INF __int_as_float(0xff800000)
#define PD_LOG2E 1.4426950408889634f
__device__ __forceinline__ float pd_float(float x) { return x; }
__device__ __forceinline__ float pd_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float pd_float(__nv_bfloat16 x) { return __bfloat162float(x); }
"""

# The generated signature supplies the inputs and outputs named in ``_INPUTS`` and
# ``_OUTPUTS``; template constants (SCALE_BITS: float32 bits of scale * log2(e)) come
# first. Logits live in the log2 domain (exp2f), so sinks are scaled by log2(e) too.
DECODE_SOURCE = r"""
  constexpr int VEC = 16 / sizeof(T);   // elements per 16-byte load
  constexpr int LK = (DK / VEC) < 32 ? (DK / VEC) : 32;  // lanes per key row
  constexpr int NK = (DK / VEC) / LK;   // 16-byte vectors per lane per key row
  constexpr int RK = 32 / LK;           // key rows per warp load
  constexpr int UK = RS / RK;           // key rows per lane per step
  constexpr int LV = (DV / VEC) < 32 ? (DV / VEC) : 32;
  constexpr int NV = (DV / VEC) / LV;
  constexpr int RV = 32 / LV;
  constexpr int UV = RS / RV;
  constexpr int NT = NW * 32;
  // Same row layout for K and V: a lane's logits are those of the rows its V loads
  // hold; otherwise probabilities go through shared memory.
  constexpr bool SAME = LK == LV;
  __shared__ float sacc[NW * HG * DV];  // each warp's partial output
  __shared__ float sml[2 * NW * HG];    // each warp's max, then its sum
  __shared__ float sp[SAME ? 1 : NW * HG * RS];
  __shared__ int s_last;
  constexpr int MAXS = 32;              // most splits (MAX_SPLITS)
  __shared__ float smm[WH * HG * MAXS], sml2[WH * HG * MAXS], swt[WH * HG * MAXS];
  __shared__ float sden[WH * HG];

  constexpr int WR = NW / WH;           // warps sharing one head group's rows
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  // Warp w serves head group blockIdx.x * WH + w % WH, row part w / WH.
  const int hgw = blockIdx.x * WH + warp % WH;
  const int kvh = hgw / (G / HG);
  const int hq0 = kvh * G + (hgw % (G / HG)) * HG;
  const int b = blockIdx.y;
  const int split = blockIdx.z;
  const int nsplit = gridDim.z;
  const int M = block_tables_shape[1];
  const int* table = block_tables + (size_t)b * M;

  const int len = lengths[b];
  const int start = starts[b];
  int first = start;
  if (WINDOW > 0) first = max(first, len - WINDOW);
  const int n = max(len - first, 0);
  const int per = (n + nsplit - 1) / nsplit;
  const int lo = min(first + split * per, len);
  const int hi = min(lo + per, len);
  // Each warp takes a contiguous run of whole steps of the split.
  const int pw = ((hi - lo + WR - 1) / WR + RS - 1) / RS * RS;
  const int wlo = min(lo + (warp / WH) * pw, hi);
  const int whi = min(wlo + pw, hi);

  // This lane's slice of each query head, pre-scaled (log2 domain).
  const int rgk = lane / LK, lik = lane % LK;
  const int rgv = lane / LV, liv = lane % LV;
  const float sc = __int_as_float(SCALE_BITS);
  float q[HG][NK * VEC];
#pragma unroll
  for (int g = 0; g < HG; ++g) {
#pragma unroll
    for (int j = 0; j < NK; ++j) {
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        int d = (j * LK + lik) * VEC + e;
        q[g][j * VEC + e] = pd_float(queries[(size_t)(b * HQ + hq0 + g) * DK + d]) * sc;
      }
    }
  }

  float m[HG], l[HG], acc[HG][NV * VEC];
#pragma unroll
  for (int g = 0; g < HG; ++g) {
    m[g] = PD_NEG_INF;
    l[g] = 0.f;
#pragma unroll
    for (int i = 0; i < NV * VEC; ++i) acc[g][i] = 0.f;
  }

  // Issue every load of a step at once: K rows, then V rows. Rows past the end read as zero,
  // not garbage: p = 0 times NaN would still be NaN.
  auto load = [&](int r0, uint4 (&kd)[UK][NK], uint4 (&vd)[UV][NV]) {
#pragma unroll
    for (int u = 0; u < UK; ++u) {
      const int pos = r0 + u * RK + rgk;
      if (pos < whi) {
        const int blk = table[(pos - start) / BS];
        const uint4* src = reinterpret_cast<const uint4*>(
            keys + (((size_t)blk * BS + pos % BS) * HKV + kvh) * DK);
#pragma unroll
        for (int j = 0; j < NK; ++j) kd[u][j] = src[j * LK + lik];
      } else {
#pragma unroll
        for (int j = 0; j < NK; ++j) kd[u][j] = make_uint4(0, 0, 0, 0);
      }
    }
#pragma unroll
    for (int u = 0; u < UV; ++u) {
      const int pos = r0 + u * RV + rgv;
      if (pos < whi) {
        const int blk = table[(pos - start) / BS];
        const uint4* src = reinterpret_cast<const uint4*>(
            values + (((size_t)blk * BS + pos % BS) * HKV + kvh) * DV);
#pragma unroll
        for (int j = 0; j < NV; ++j) vd[u][j] = src[j * LV + liv];
      } else {
#pragma unroll
        for (int j = 0; j < NV; ++j) vd[u][j] = make_uint4(0, 0, 0, 0);
      }
    }
  };

  // With PF, the next step's loads are in flight while this step computes (unused otherwise).
  uint4 kn[UK][NK], vn[UV][NV];
  if (PF && wlo < whi) load(wlo, kn, vn);
  for (int r0 = wlo; r0 < whi; r0 += RS) {
    uint4 kr[UK][NK];
    uint4 vr[UV][NV];
    if (PF) {
#pragma unroll
      for (int u = 0; u < UK; ++u)
#pragma unroll
        for (int j = 0; j < NK; ++j) kr[u][j] = kn[u][j];
#pragma unroll
      for (int u = 0; u < UV; ++u)
#pragma unroll
        for (int j = 0; j < NV; ++j) vr[u][j] = vn[u][j];
      if (r0 + RS < whi) load(r0 + RS, kn, vn);
    } else {
      load(r0, kr, vr);
    }

    // Logits of the step's rows; every lane of a row's lane group ends with the sum.
    float s[UK][HG];
#pragma unroll
    for (int u = 0; u < UK; ++u) {
#pragma unroll
      for (int g = 0; g < HG; ++g) s[u][g] = 0.f;
#pragma unroll
      for (int j = 0; j < NK; ++j) {
        const T* kv = reinterpret_cast<const T*>(&kr[u][j]);
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
          const float kf = pd_float(kv[e]);
#pragma unroll
          for (int g = 0; g < HG; ++g) s[u][g] += q[g][j * VEC + e] * kf;
        }
      }
#pragma unroll
      for (int g = 0; g < HG; ++g) {
#pragma unroll
        for (int off = LK / 2; off > 0; off >>= 1)
          s[u][g] += __shfl_xor_sync(0xffffffff, s[u][g], off);
      }
      if (r0 + u * RK + rgk >= whi) {
#pragma unroll
        for (int g = 0; g < HG; ++g) s[u][g] = PD_NEG_INF;
      }
    }

    // Warp-wide online softmax: row r0 is always valid, so the new max is finite.
#pragma unroll
    for (int g = 0; g < HG; ++g) {
      float cm = s[0][g];
#pragma unroll
      for (int u = 1; u < UK; ++u) cm = fmaxf(cm, s[u][g]);
#pragma unroll
      for (int off = LK; off < 32; off <<= 1)
        cm = fmaxf(cm, __shfl_xor_sync(0xffffffff, cm, off));
      const float mn = fmaxf(m[g], cm);
      const float alpha = exp2f(m[g] - mn);
      m[g] = mn;
      float ls = 0.f;
#pragma unroll
      for (int u = 0; u < UK; ++u) {
        s[u][g] = exp2f(s[u][g] - mn);
        ls += s[u][g];
      }
      l[g] = l[g] * alpha + ls;
#pragma unroll
      for (int i = 0; i < NV * VEC; ++i) acc[g][i] *= alpha;
    }

    if (!SAME) {
      if (lik == 0) {
#pragma unroll
        for (int u = 0; u < UK; ++u) {
#pragma unroll
          for (int g = 0; g < HG; ++g) sp[(warp * HG + g) * RS + u * RK + rgk] = s[u][g];
        }
      }
      __syncwarp();
    }

    // acc += p * v.
#pragma unroll
    for (int u = 0; u < UV; ++u) {
      float p[HG];
#pragma unroll
      for (int g = 0; g < HG; ++g)
        p[g] = SAME ? s[u < UK ? u : 0][g] : sp[(warp * HG + g) * RS + u * RV + rgv];
#pragma unroll
      for (int j = 0; j < NV; ++j) {
        const T* vv = reinterpret_cast<const T*>(&vr[u][j]);
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
          const float vf = pd_float(vv[e]);
#pragma unroll
          for (int g = 0; g < HG; ++g) acc[g][j * VEC + e] += p[g] * vf;
        }
      }
    }
    if (!SAME) __syncwarp();  // sp is rewritten next step
  }

  // Warp totals: l over K lane groups, acc over V lane groups (m is warp-uniform).
#pragma unroll
  for (int g = 0; g < HG; ++g) {
#pragma unroll
    for (int off = LK; off < 32; off <<= 1) l[g] += __shfl_xor_sync(0xffffffff, l[g], off);
#pragma unroll
    for (int i = 0; i < NV * VEC; ++i) {
#pragma unroll
      for (int off = LV; off < 32; off <<= 1)
        acc[g][i] += __shfl_xor_sync(0xffffffff, acc[g][i], off);
    }
    if (lane == 0) {
      sml[warp * HG + g] = m[g];
      sml[(NW + warp) * HG + g] = l[g];
    }
    if (rgv == 0) {
#pragma unroll
      for (int j = 0; j < NV; ++j) {
#pragma unroll
        for (int e = 0; e < VEC; ++e)
          sacc[(warp * HG + g) * DV + (j * LV + liv) * VEC + e] = acc[g][j * VEC + e];
      }
    }
  }
  __syncthreads();

  // Merge the row parts of each head group; with one split write the output, else this
  // split's partial.
  for (int idx = threadIdx.x; idx < WH * HG * DV; idx += NT) {
    const int h = idx / (HG * DV), g = (idx / DV) % HG, d = idx % DV;
    const int hg = blockIdx.x * WH + h;
    const int hq = (hg / (G / HG)) * G + (hg % (G / HG)) * HG + g;
    float mb = PD_NEG_INF;
#pragma unroll
    for (int w = h; w < NW; w += WH)
      if (sml[(NW + w) * HG + g] > 0.f) mb = fmaxf(mb, sml[w * HG + g]);
    float o = 0.f, lb = 0.f;
#pragma unroll
    for (int w = h; w < NW; w += WH) {
      const float lw = sml[(NW + w) * HG + g];
      if (lw > 0.f) {
        const float a = exp2f(sml[w * HG + g] - mb);
        o += a * sacc[(w * HG + g) * DV + d];
        lb += a * lw;
      }
    }
    const size_t row = (size_t)b * HQ + hq;
    if (nsplit == 1) {
      if (SINKS) {
        const float sk = sinks[hq] * PD_LOG2E;
        const float mx = fmaxf(mb, sk);
        const float a = exp2f(mb - mx);
        o *= a;
        lb = lb * a + exp2f(sk - mx);
      }
      out[row * DV + d] = static_cast<OT>(lb > 0.f ? o / lb : 0.f);
    } else {
      const size_t at = row * nsplit + split;
      part_out[at * DV + d] = o;
      if (d == 0) {
        part_max[at] = mb;
        part_sum[at] = lb;
      }
    }
  }
  if (nsplit == 1) return;

  // Publish this split's partial; the last split of the (sequence, head group) merges.
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    int* cnt = const_cast<int*>(counters) + (size_t)b * gridDim.x + blockIdx.x;
    const int done = atomicAdd(cnt, 1);
    s_last = done == nsplit - 1;
  }
  __syncthreads();
  if (!s_last) return;
  __threadfence();
  // Load every split's max and sum, weigh the splits per head, then sum the partial
  // outputs with all of a thread's loads in flight at once.
  for (int i = threadIdx.x; i < WH * HG * nsplit; i += NT) {
    const int hgi = i / nsplit, sidx = i % nsplit;
    const int hg = blockIdx.x * WH + hgi / HG;
    const int hq = (hg / (G / HG)) * G + (hg % (G / HG)) * HG + hgi % HG;
    const size_t at = ((size_t)b * HQ + hq) * nsplit + sidx;
    smm[hgi * MAXS + sidx] = __ldcg(part_max + at);
    sml2[hgi * MAXS + sidx] = __ldcg(part_sum + at);
  }
  __syncthreads();
  for (int i = threadIdx.x; i < WH * HG; i += NT) {
    const int hg = blockIdx.x * WH + i / HG;
    const int hq = (hg / (G / HG)) * G + (hg % (G / HG)) * HG + i % HG;
    float mt = PD_NEG_INF;
    for (int sx = 0; sx < nsplit; ++sx)
      if (sml2[i * MAXS + sx] > 0.f) mt = fmaxf(mt, smm[i * MAXS + sx]);
    float den = 0.f;
    if (SINKS) {
      const float sk = sinks[hq] * PD_LOG2E;
      mt = fmaxf(mt, sk);
      den = exp2f(sk - mt);
    }
    for (int sx = 0; sx < nsplit; ++sx) {
      const float ls = sml2[i * MAXS + sx];
      const float w = ls > 0.f ? exp2f(smm[i * MAXS + sx] - mt) : 0.f;
      swt[i * MAXS + sx] = w;
      den += w * ls;
    }
    sden[i] = den;
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < WH * HG * DV; idx += NT) {
    const int i = idx / DV, d = idx % DV;
    const int hg = blockIdx.x * WH + i / HG;
    const int hq = (hg / (G / HG)) * G + (hg % (G / HG)) * HG + i % HG;
    const size_t row = (size_t)b * HQ + hq;
    float num = 0.f;
#pragma unroll
    for (int sx = 0; sx < MAXS; ++sx) {
      if (sx < nsplit)
        num += swt[i * MAXS + sx] * __ldcg(part_out + (row * nsplit + sx) * DV + d);
    }
    const float den = sden[i];
    out[row * DV + d] = static_cast<OT>(den > 0.f ? num / den : 0.f);
  }
"""

_INPUTS = ["queries", "keys", "values", "block_tables", "starts", "lengths", "sinks", "counters"]
_OUTPUTS = ["out", "part_out", "part_max", "part_sum"]
_kernel_obj: list[object] = []


def _kernel() -> object:
    """The kernel object (MLX compiles and caches one binary per template set)."""
    if not _kernel_obj:
        _kernel_obj.append(
            mx.fast.cuda_kernel("paged_decode", _INPUTS, _OUTPUTS, DECODE_SOURCE, header=HEADER)
        )
    return _kernel_obj[0]


def _as(x: mx.array, dtype: mx.Dtype) -> mx.array:
    return x if x.dtype == dtype else x.astype(dtype)


def rows_per_step(dk: int, dv: int, itemsize: int, base: int = ROWS_PER_STEP) -> int:
    """Rows a warp loads per step: ``base`` for 256-byte rows, fewer for wider rows.

    A power of two, and at least the rows one warp load covers for K and for V.
    """
    vec = 16 // itemsize
    per_load = max(32 // min(d // vec, 32) for d in (dk, dv))
    rows = max(1, base * 256 // (max(dk, dv) * itemsize))
    return max(per_load, 1 << (rows.bit_length() - 1))


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
) -> DecodePlan:
    """How the kernel would run this call, or a plan with ``reason`` set if it cannot."""
    plan = plan_decode(queries, view, max_lanes_elems=32)
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
) -> Launch | None:
    """The launch for this call's shapes, or ``None`` if the kernel cannot run them."""
    nw = num_warps or NUM_WARPS
    hw = head_warps or HEAD_WARPS
    plan = cuda_plan(queries, view, num_splits, nw, hw)
    if plan.reason:
        return None
    B, HQ, dv, S = plan.batch, plan.n_heads, plan.dv, plan.num_splits
    groups = plan.n_kv_heads * (plan.group // plan.heads_per_block)
    if num_warps is None and S == 1 and B * groups >= WIDE_BLOCKS:
        nw = NUM_WARPS_WIDE
    wh, wr = warp_layout(groups, nw, hw)
    run = math.ceil(_span(view) / (S * wr))  # rows each warp walks
    base = rows or (ROWS_PER_STEP if run >= LONG_RUN else ROWS_PER_STEP_SHORT)
    rs = rows_per_step(plan.dk, dv, view.keys.dtype.size, base)
    # Logits live in the log2 domain (exp2f), so the scale carries log2(e).
    template = base_template(plan, queries, view, has_sinks, scale * LOG2E)
    pf = PREFETCH if prefetch is None else prefetch
    template += [("NW", nw), ("WH", wh), ("RS", rs), ("PF", pf)]
    blocks = groups // wh
    parts = (B, HQ, S) if S > 1 else (1,)  # unused without splits
    grid = (blocks * nw * 32, B, S)
    threads = (nw * 32, 1, 1)
    output_shapes = [(B, HQ, 1, dv), (*parts, dv) if S > 1 else (1,), parts, parts]
    output_dtypes = [queries.dtype, mx.float32, mx.float32, mx.float32]
    slots = B * blocks if S > 1 else 0  # split counters: one per (sequence, block column)

    def kernel_call(q, keys, values, tables, starts, lengths, sinks, no_counters):
        counters = mx.zeros((slots,), dtype=mx.int32) if slots else no_counters
        return _kernel()(
            inputs=[q, keys, values, tables, starts, lengths, sinks, counters],
            template=template,
            grid=grid,
            threadgroup=threads,
            output_shapes=output_shapes,
            output_dtypes=output_dtypes,
        )[0]

    replay = compiled_launch(kernel_call)

    def launch(q: mx.array, view: PagedView, sinks: mx.array | None) -> mx.array:
        return replay(
            q,
            view.keys,
            view.values,
            _as(view.block_tables, mx.int32),
            _as(view.starts, mx.int32),
            _as(view.lengths, mx.int32),
            placeholder(mx.float32) if sinks is None else _as(sinks, mx.float32),
            placeholder(mx.int32),  # the counters, when the launch has no splits
        )

    return launch


_launches = LaunchCache()


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
) -> Launch | None:
    """The launch for calls shaped like this one (made once per shape), or ``None`` if the
    kernel does not support their shapes or dtypes.

    Args:
        queries: ``(B, n_heads, 1, k_head_dim)``.
        view: the batch's blocks.
        scale, sinks: as in ``mx.fast.scaled_dot_product_attention``.
        num_splits: force the number of splits per sequence (1 turns split-K off);
            ``None`` picks one from the batch size and the table width.
        num_warps, rows, head_warps, prefetch: tuning overrides (warps per block;
            rows per warp step for 256-byte rows; most head groups per block; load the
            next step during this one); ``None`` takes ``NUM_WARPS`` (or ``NUM_WARPS_WIDE``) /
            ``ROWS_PER_STEP`` or ``ROWS_PER_STEP_SHORT`` / ``HEAD_WARPS`` /
            ``PREFETCH``.
    """
    key = call_key(queries, view, scale, sinks, num_splits, num_warps, rows, head_warps, prefetch)
    return _launches.get(
        key,
        lambda: _make_launch(
            queries,
            view,
            scale,
            sinks is not None,
            num_splits,
            num_warps,
            rows,
            head_warps,
            prefetch,
        ),
    )


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
