"""The gated delta rule's recurrence over a prompt, as one CUDA kernel.

mlx-lm's GatedDeltaNet layers (qwen3_5, qwen3_next, kimi_linear, olmo_hybrid,
...) run their recurrence through a Metal kernel on Apple silicon and,
elsewhere, through ``gated_delta_ops``: a Python loop of MLX ops per token.
On MLX's CUDA backend a prompt's prefill is therefore one graph of several ops
per token per layer (BENCHMARKS.md, run 241: 43 s for a 32k-token prompt of a
1B Qwen3.5 shape on an H200). This kernel is the same recurrence in one launch
per layer and forward, after mlx-lm's Metal kernel: one warp per value row of
one (sequence, value head), each lane holding ``Dk / 32`` of the row's float32
state in registers while it walks the tokens; each step loads the next token's
inputs before it computes this one's.

Per token ``t`` (``S`` the ``(Dv, Dk)`` state, ``g`` a scalar or a ``Dk`` vector):
``S *= g``, ``delta = (v - S k) * beta``, ``S += delta k^T``, ``y = S q``. A masked
token (``mask[b, t]`` false: left padding) keeps the state and writes ``y = 0``.
"""

from __future__ import annotations

import mlx.core as mx

from .cubin import CudaKernel
from .plan import FLOAT_TYPES

WARPS = 4  # value rows (warps) per thread block

_SOURCE = """
  // q, k: [B, T, Hk, Dk]; v, y: [B, T, Hv, Dv]; g: [B, T, Hv] (or [B, T, Hv, Dk] with VEC);
  // beta: [B, T, Hv]; state_in, state_out: [B, Hv, Dv, Dk]; mask: [B, T] (with MASK).
  constexpr int NP = Dk / 32;
  const int T = q_shape[1];
  const int n = blockIdx.z, b = n / Hv, hv = n % Hv, hk = hv / (Hv / Hk);
  const int lane = threadIdx.x, dv = blockIdx.y * blockDim.y + threadIdx.y;
  if (dv >= Dv) return;  // the whole warp: one row each
  const size_t qk0 = (size_t)b * T * Hk * Dk + hk * Dk + lane * NP;
  const size_t v0 = (size_t)b * T * Hv * Dv + hv * Dv + dv;
  const size_t h0 = (size_t)b * T * Hv + hv;
  const size_t s0 = ((size_t)n * Dv + dv) * Dk + lane * NP;
  float s[NP], kc[NP], qc[NP], gc[NP], kn[NP], qn[NP], gn[NP];
  float vc, bc, vn = 0.f, bn = 0.f;
  bool mc, mn = true;
  for (int i = 0; i < NP; ++i) s[i] = static_cast<float>(state_in[s0 + i]);
  auto load = [&](int t) {
    const size_t qk = qk0 + (size_t)t * Hk * Dk, h = h0 + (size_t)t * Hv;
    for (int i = 0; i < NP; ++i) {
      kn[i] = static_cast<float>(k[qk + i]);
      qn[i] = static_cast<float>(q[qk + i]);
      gn[i] = static_cast<float>(VEC ? g[h * Dk + lane * NP + i] : g[h]);
    }
    vn = static_cast<float>(v[v0 + (size_t)t * Hv * Dv]);
    bn = static_cast<float>(beta[h]);
    if (MASK) mn = mask[(size_t)b * T + t] != 0;
  };
  if (T > 0) load(0);
  for (int t = 0; t < T; ++t) {
    for (int i = 0; i < NP; ++i) { kc[i] = kn[i]; qc[i] = qn[i]; gc[i] = gn[i]; }
    vc = vn; bc = bn; mc = mn;
    if (t + 1 < T) load(t + 1);
    float out = 0.f;
    if (mc) {
      float kv = 0.f;
      for (int i = 0; i < NP; ++i) { s[i] *= gc[i]; kv += s[i] * kc[i]; }
      for (int o = 16; o > 0; o >>= 1) kv += __shfl_xor_sync(0xffffffff, kv, o);
      const float delta = (vc - kv) * bc;
      for (int i = 0; i < NP; ++i) { s[i] += kc[i] * delta; out += s[i] * qc[i]; }
      for (int o = 16; o > 0; o >>= 1) out += __shfl_xor_sync(0xffffffff, out, o);
    }
    if (lane == 0) y[v0 + (size_t)t * Hv * Dv] = static_cast<InT>(out);
  }
  for (int i = 0; i < NP; ++i) state_out[s0 + i] = static_cast<StT>(s[i]);
"""

_kernel: CudaKernel | None = None


def gated_delta_reason(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    g: mx.array,
    beta: mx.array,
    state: mx.array,
    mask: mx.array | None,
) -> str | None:
    """Why ``cuda_gated_delta`` cannot take these arrays, or ``None`` if it can."""
    if q.ndim != 4 or k.shape != q.shape or v.ndim != 4 or v.shape[:2] != q.shape[:2]:
        return f"q/k/v shapes {q.shape} / {k.shape} / {v.shape}"
    b, t, hk, dk = q.shape
    hv, dv = v.shape[2:]
    if dk % 32 or dk > 256 or hv % hk or b * hv > 65535:
        return f"key dim {dk}, {hk} key heads, {hv} value heads, batch {b}"
    if g.shape not in ((b, t, hv), (b, t, hv, dk)) or beta.shape != (b, t, hv):
        return f"gate shapes {g.shape} / {beta.shape}"
    if state.shape != (b, hv, dv, dk):
        return f"state shape {state.shape}"
    if mask is not None and mask.shape != (b, t):
        return f"mask shape {mask.shape}"
    dtypes = (q.dtype, k.dtype, v.dtype, g.dtype, beta.dtype, state.dtype)
    if any(d not in FLOAT_TYPES for d in dtypes) or len({q.dtype, k.dtype, v.dtype}) > 1:
        return f"dtypes {dtypes}"
    return None


def cuda_gated_delta(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    g: mx.array,
    beta: mx.array,
    state: mx.array,
    mask: mx.array | None = None,
) -> tuple[mx.array, mx.array]:
    """``(y, state)`` as mlx-lm's ``gated_delta_ops`` returns them (``y`` in ``q``'s dtype,
    the state in its own). The caller checks ``gated_delta_reason`` first."""
    global _kernel
    if _kernel is None:
        _kernel = CudaKernel(
            "gated_delta",
            ["q", "k", "v", "g", "beta", "state_in", "mask"],
            ["y", "state_out"],
            _SOURCE,
            absent={"mask": mx.int32},
        )
    b, _, hk, dk = q.shape
    hv, dv = v.shape[2:]
    # The state's dtype as the ops' arithmetic would promote it.
    others = {state.dtype, g.dtype, beta.dtype, k.dtype, v.dtype}
    st = state.dtype if others == {state.dtype} else mx.float32
    template = [
        ("InT", q.dtype),
        ("StT", st),
        ("Dk", dk),
        ("Dv", dv),
        ("Hk", hk),
        ("Hv", hv),
        ("VEC", g.ndim == 4),
        ("MASK", mask is not None),
    ]
    y, out = _kernel(
        inputs=[q, k, v, g, beta, state, None if mask is None else mask.astype(mx.int32)],
        template=template,
        grid=(32, -(-dv // WARPS) * WARPS, b * hv),
        threadgroup=(32, WARPS, 1),
        output_shapes=[v.shape, state.shape],
        output_dtypes=[q.dtype, st],
    )
    return y, out
