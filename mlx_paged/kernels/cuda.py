"""Fused paged decode attention for MLX's CUDA backend (``mx.fast.cuda_kernel``).

One thread block serves one (sequence, KV head, split). All the query heads of
that KV head (up to ``heads_per_block``) are handled in the block, so each K/V
row is read from the pool once, with 16-byte loads straight through the block
table. The block walks its token range in chunks of ``PART`` rows: pass 1 puts
the chunk's logits in shared memory, a block-wide max updates the running
softmax max (online rescaling, float32), pass 2 accumulates ``p * v``.

With more than one split (flash-decoding, for long contexts at small batch) each
block writes a partial output with its max and sum, and a second kernel merges
the splits and the sinks.
"""

from __future__ import annotations

import math
import struct
from typing import TYPE_CHECKING

import mlx.core as mx

from .plan import DecodePlan, plan_decode

if TYPE_CHECKING:
    from ..attention import PagedView

NUM_WARPS = 4
PART = 512  # rows of logits kept in shared memory per chunk
# About two waves of thread blocks on an H100 (132 SMs x 4 resident blocks): fewer leave SMs
# idle, and with barely more than one wave the second wave runs nearly empty.
TARGET_BLOCKS = 1056
MIN_SPLIT_TOKENS = 256  # a split shorter than this costs more than it gains

HEADER = r"""
#define PD_NEG_INF __int_as_float(0xff800000)
__device__ __forceinline__ float pd_float(float x) { return x; }
__device__ __forceinline__ float pd_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float pd_float(__nv_bfloat16 x) { return __bfloat162float(x); }
"""

# The generated signature supplies queries, keys, values, block_tables, starts,
# lengths, sinks and the outputs; template constants (SCALE_BITS too) come first.
DECODE_SOURCE = r"""
  constexpr int VEC = 16 / sizeof(T);   // elements per 16-byte load
  constexpr int LK = (DK / VEC) < 32 ? (DK / VEC) : 32;  // lanes per key row
  constexpr int NK = (DK / VEC) / LK;   // 16-byte vectors per lane per key row
  constexpr int RK = 32 / LK;           // key rows per warp step
  constexpr int LV = (DV / VEC) < 32 ? (DV / VEC) : 32;
  constexpr int NV = (DV / VEC) / LV;
  constexpr int RV = 32 / LV;
  constexpr int NT = NW * 32;
  constexpr int UK = 4;                 // rows in flight per lane, pass 1
  constexpr int UV = 4;                 // rows in flight per lane, pass 2
  constexpr int SMEM = (HG * PART > NW * HG * DV) ? HG * PART : NW * HG * DV;
  __shared__ float smem[SMEM];          // logits/probs [g][row]; later partial outputs
  __shared__ float sred[NW * HG];

  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int kvh = blockIdx.x / (G / HG);
  const int hq0 = kvh * G + (blockIdx.x % (G / HG)) * HG;
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
  const int lo = first + split * per;
  const int hi = min(lo + per, len);

  // This lane's slice of each query head, pre-scaled.
  const int rgk = lane / LK, lik = lane % LK;
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

  const int rgv = lane / LV, liv = lane % LV;
  float m[HG], lsum[HG], acc[HG][NV * VEC];
#pragma unroll
  for (int g = 0; g < HG; ++g) {
    m[g] = PD_NEG_INF;
    lsum[g] = 0.f;
#pragma unroll
    for (int i = 0; i < NV * VEC; ++i) acc[g][i] = 0.f;
  }

  for (int c0 = lo; c0 < hi; c0 += PART) {
    const int cn = min(PART, hi - c0);

    // Pass 1: logits of the chunk's rows into shared memory.
    float cmax[HG];
#pragma unroll
    for (int g = 0; g < HG; ++g) cmax[g] = PD_NEG_INF;
    for (int base = warp * RK; base < cn; base += NW * RK * UK) {
      uint4 kr[UK][NK];
#pragma unroll
      for (int u = 0; u < UK; ++u) {
        int r = base + rgk + u * NW * RK;
        if (r < cn) {
          int pos = c0 + r;
          int blk = table[(pos - start) / BS];
          const uint4* src = reinterpret_cast<const uint4*>(
              keys + (((size_t)blk * BS + pos % BS) * HKV + kvh) * DK);
#pragma unroll
          for (int j = 0; j < NK; ++j) kr[u][j] = src[j * LK + lik];
        } else {
#pragma unroll
          for (int j = 0; j < NK; ++j) kr[u][j] = make_uint4(0, 0, 0, 0);
        }
      }
#pragma unroll
      for (int u = 0; u < UK; ++u) {
        int r = base + rgk + u * NW * RK;
        float s[HG];
#pragma unroll
        for (int g = 0; g < HG; ++g) s[g] = 0.f;
#pragma unroll
        for (int j = 0; j < NK; ++j) {
          const T* kv = reinterpret_cast<const T*>(&kr[u][j]);
#pragma unroll
          for (int e = 0; e < VEC; ++e) {
            float kf = pd_float(kv[e]);
#pragma unroll
            for (int g = 0; g < HG; ++g) s[g] += q[g][j * VEC + e] * kf;
          }
        }
#pragma unroll
        for (int g = 0; g < HG; ++g) {
#pragma unroll
          for (int off = LK / 2; off > 0; off >>= 1)
            s[g] += __shfl_xor_sync(0xffffffff, s[g], off);
        }
        if (lik == 0 && r < cn) {
#pragma unroll
          for (int g = 0; g < HG; ++g) {
            smem[g * PART + r] = s[g];
            cmax[g] = fmaxf(cmax[g], s[g]);
          }
        }
      }
    }
#pragma unroll
    for (int g = 0; g < HG; ++g) {
#pragma unroll
      for (int off = 16; off > 0; off >>= 1)
        cmax[g] = fmaxf(cmax[g], __shfl_xor_sync(0xffffffff, cmax[g], off));
      if (lane == 0) sred[warp * HG + g] = cmax[g];
    }
    __syncthreads();

    // Block-wide running max; rescale what earlier chunks accumulated.
    float alpha[HG];
#pragma unroll
    for (int g = 0; g < HG; ++g) {
      float cm = sred[g];
#pragma unroll
      for (int w = 1; w < NW; ++w) cm = fmaxf(cm, sred[w * HG + g]);
      float mn = fmaxf(m[g], cm);
      alpha[g] = __expf(m[g] - mn);
      m[g] = mn;
      lsum[g] *= alpha[g];
    }
    for (int i = threadIdx.x; i < cn; i += NT) {
#pragma unroll
      for (int g = 0; g < HG; ++g) {
        float p = __expf(smem[g * PART + i] - m[g]);
        smem[g * PART + i] = p;
        lsum[g] += p;
      }
    }
    __syncthreads();

    // Pass 2: acc += p * v.
#pragma unroll
    for (int g = 0; g < HG; ++g) {
#pragma unroll
      for (int i = 0; i < NV * VEC; ++i) acc[g][i] *= alpha[g];
    }
    for (int base = warp * RV; base < cn; base += NW * RV * UV) {
      uint4 vr[UV][NV];
#pragma unroll
      for (int u = 0; u < UV; ++u) {
        int r = base + rgv + u * NW * RV;
        if (r < cn) {
          int pos = c0 + r;
          int blk = table[(pos - start) / BS];
          const uint4* src = reinterpret_cast<const uint4*>(
              values + (((size_t)blk * BS + pos % BS) * HKV + kvh) * DV);
#pragma unroll
          for (int j = 0; j < NV; ++j) vr[u][j] = src[j * LV + liv];
        }
      }
#pragma unroll
      for (int u = 0; u < UV; ++u) {
        int r = base + rgv + u * NW * RV;
        if (r < cn) {
          float p[HG];
#pragma unroll
          for (int g = 0; g < HG; ++g) p[g] = smem[g * PART + r];
#pragma unroll
          for (int j = 0; j < NV; ++j) {
            const T* vv = reinterpret_cast<const T*>(&vr[u][j]);
#pragma unroll
            for (int e = 0; e < VEC; ++e) {
              float vf = pd_float(vv[e]);
#pragma unroll
              for (int g = 0; g < HG; ++g) acc[g][j * VEC + e] += p[g] * vf;
            }
          }
        }
      }
    }
    __syncthreads();
  }

  // Sum lsum over the block, and acc over row groups and warps.
#pragma unroll
  for (int g = 0; g < HG; ++g) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1)
      lsum[g] += __shfl_xor_sync(0xffffffff, lsum[g], off);
    if (lane == 0) sred[warp * HG + g] = lsum[g];
#pragma unroll
    for (int i = 0; i < NV * VEC; ++i) {
#pragma unroll
      for (int off = LV; off < 32; off <<= 1)
        acc[g][i] += __shfl_xor_sync(0xffffffff, acc[g][i], off);
    }
    if (rgv == 0) {
#pragma unroll
      for (int j = 0; j < NV; ++j) {
#pragma unroll
        for (int e = 0; e < VEC; ++e)
          smem[(warp * HG + g) * DV + (j * LV + liv) * VEC + e] = acc[g][j * VEC + e];
      }
    }
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < HG * DV; idx += NT) {
    const int g = idx / DV, d = idx % DV;
    float o = 0.f, l = 0.f;
#pragma unroll
    for (int w = 0; w < NW; ++w) {
      o += smem[(w * HG + g) * DV + d];
      l += sred[w * HG + g];
    }
    const size_t row = (size_t)b * HQ + hq0 + g;
    WRITE_OUT
  }
"""

WRITE_FINAL = r"""
    float mm = m[g];
    if (SINKS) {
      float sk = sinks[hq0 + g];
      float mx = fmaxf(mm, sk);
      float a = __expf(mm - mx);
      o *= a;
      l = l * a + __expf(sk - mx);
    }
    out[row * DV + d] = static_cast<OT>(l > 0.f ? o / l : 0.f);
"""

WRITE_PARTIAL = r"""
    const size_t at = row * gridDim.z + split;
    part_out[at * DV + d] = l > 0.f ? o / l : 0.f;
    if (d == 0) {
      part_max[at] = m[g];
      part_sum[at] = l;
    }
"""

# One block per (query head, sequence): merge the splits' partial softmaxes.
REDUCE_SOURCE = r"""
  const int hq = blockIdx.x;
  const int b = blockIdx.y;
  const int S = part_max_shape[2];
  const size_t row = (size_t)b * HQ + hq;
  const float* pm = part_max + row * S;
  const float* pl = part_sum + row * S;
  float mt = PD_NEG_INF;
  for (int s = 0; s < S; ++s)
    if (pl[s] > 0.f) mt = fmaxf(mt, pm[s]);
  if (SINKS) mt = fmaxf(mt, sinks[hq]);
  float den = SINKS ? __expf(sinks[hq] - mt) : 0.f;
  for (int s = 0; s < S; ++s)
    if (pl[s] > 0.f) den += pl[s] * __expf(pm[s] - mt);
  for (int d = threadIdx.x; d < DV; d += blockDim.x) {
    float num = 0.f;
    for (int s = 0; s < S; ++s)
      if (pl[s] > 0.f) num += pl[s] * __expf(pm[s] - mt) * part_out[(row * S + s) * DV + d];
    out[row * DV + d] = static_cast<OT>(den > 0.f ? num / den : 0.f);
  }
"""

_INPUTS = ["queries", "keys", "values", "block_tables", "starts", "lengths", "sinks"]
_kernels: dict[str, object] = {}


def _kernel(kind: str) -> object:
    """The compiled-on-demand kernel objects (MLX caches one binary per template set)."""
    if kind not in _kernels:
        if kind == "final":
            src = DECODE_SOURCE.replace("WRITE_OUT", WRITE_FINAL)
            k = mx.fast.cuda_kernel("paged_decode", _INPUTS, ["out"], src, header=HEADER)
        elif kind == "partial":
            src = DECODE_SOURCE.replace("WRITE_OUT", WRITE_PARTIAL)
            outs = ["part_out", "part_max", "part_sum"]
            k = mx.fast.cuda_kernel("paged_decode_split", _INPUTS, outs, src, header=HEADER)
        else:
            ins = ["part_out", "part_max", "part_sum", "sinks"]
            k = mx.fast.cuda_kernel(
                "paged_decode_reduce", ins, ["out"], REDUCE_SOURCE, header=HEADER
            )
        _kernels[kind] = k
    return _kernels[kind]


def _as(x: mx.array, dtype: mx.Dtype) -> mx.array:
    return x if x.dtype == dtype else x.astype(dtype)


_placeholder: list[mx.array] = []


def _no_sinks() -> mx.array:
    """A one-element stand-in for absent sinks (the kernel never reads it)."""
    if not _placeholder:
        _placeholder.append(mx.zeros((1,), dtype=mx.float32))
    return _placeholder[0]


def cuda_plan(queries: mx.array, view: PagedView, num_splits: int | None = None) -> DecodePlan:
    """How the kernel would run this call, or a plan with ``reason`` set if it cannot."""
    plan = plan_decode(queries, view, max_lanes_elems=32)
    if plan.reason:
        return plan
    if num_splits is None:
        base = plan.batch * plan.n_kv_heads * (plan.group // plan.heads_per_block)
        span = view.block_tables.shape[1] * view.block_size
        if view.window is not None:
            span = min(span, view.window)
        num_splits = 1
        if base < TARGET_BLOCKS:
            num_splits = max(1, min(math.ceil(TARGET_BLOCKS / base), span // MIN_SPLIT_TOKENS))
    plan.num_splits = max(1, num_splits)
    return plan


def paged_decode_cuda(
    queries: mx.array,
    view: PagedView,
    scale: float,
    sinks: mx.array | None,
    num_splits: int | None = None,
) -> mx.array | None:
    """Run the CUDA kernel; ``None`` if this call's shapes or dtypes are not supported.

    Args:
        queries: ``(B, n_heads, 1, k_head_dim)``.
        view: the batch's blocks.
        scale, sinks: as in ``mx.fast.scaled_dot_product_attention``.
        num_splits: force the number of splits per sequence (1 turns split-K off);
            ``None`` picks one from the batch size and the table width.
    """
    plan = cuda_plan(queries, view, num_splits)
    if plan.reason:
        return None
    B, HQ, dv, S = plan.batch, plan.n_heads, plan.dv, plan.num_splits
    has_sinks = sinks is not None
    sinks_arr = _as(sinks, mx.float32) if has_sinks else _no_sinks()
    tables = (view.block_tables, view.starts, view.lengths)
    inputs = [queries, view.keys, view.values, *(_as(x, mx.int32) for x in tables), sinks_arr]
    template = [
        ("T", view.keys.dtype),
        ("OT", queries.dtype),
        ("DK", plan.dk),
        ("DV", dv),
        ("HQ", HQ),
        ("HKV", plan.n_kv_heads),
        ("G", plan.group),
        ("HG", plan.heads_per_block),
        ("BS", view.block_size),
        ("WINDOW", view.window or 0),
        ("SINKS", has_sinks),
        ("NW", NUM_WARPS),
        ("PART", PART),
        # The scale is fixed per model: bake its float32 bits in rather than pass an array.
        ("SCALE_BITS", struct.unpack("<i", struct.pack("<f", scale))[0]),
    ]
    groups = plan.n_kv_heads * (plan.group // plan.heads_per_block)
    grid = (groups * NUM_WARPS * 32, B, S)
    threads = (NUM_WARPS * 32, 1, 1)
    if S == 1:
        (out,) = _kernel("final")(
            inputs=inputs,
            template=template,
            grid=grid,
            threadgroup=threads,
            output_shapes=[(B, HQ, 1, dv)],
            output_dtypes=[queries.dtype],
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
        inputs=[part_out, part_max, part_sum, sinks_arr],
        template=[("OT", queries.dtype), ("DV", dv), ("HQ", HQ), ("SINKS", has_sinks)],
        grid=(HQ * 128, B, 1),
        threadgroup=(128, 1, 1),
        output_shapes=[(B, HQ, 1, dv)],
        output_dtypes=[queries.dtype],
    )
    return out
