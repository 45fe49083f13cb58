"""One token of a Mamba2 layer's selective state space update, as one CUDA kernel.

mlx-lm's Mamba2 layers (nemotron_h, granitemoehybrid, falcon_h1, mamba2, plamo2)
update their state through ``ssm.ssm_update``: a Metal kernel on Apple silicon and,
elsewhere, ``ssm_attn``, the chunked form written for prompts, which a decode step
runs as a few dozen small ops per layer. This kernel is the one-token update in
one launch: one warp per (sequence, head, head-dim row), each lane holding
``Ds / 32`` of the row's state.

Per row (``dt`` already through mlx-lm's ``compute_dt``, ``A = -exp(A_log)``):
``S = exp(A dt) S + (x dt) B``, ``y = S . C + x D``. A masked token (``mask[b]``
false) keeps the state and still reads it: ``y = S . C + x D``, as ``ssm_attn`` gives.
"""

from __future__ import annotations

import mlx.core as mx

from .cubin import CudaKernel
from .plan import FLOAT_TYPES

WARPS = 4  # head-dim rows (warps) per thread block

_SOURCE = """
  // x, y: [N, 1, H, Dh]; A_log, Dd: [H]; B, C: [N, 1, G, Ds]; dt: [N, 1, H] (float32);
  // state_in, state_out: [N, H, Dh, Ds]; mask: [N] (with MASK).
  constexpr int NP = Ds / 32;
  const int n = blockIdx.z, b = n / H, h = n % H, grp = h / (H / G);
  const int lane = threadIdx.x, d = blockIdx.y * blockDim.y + threadIdx.y;
  if (d >= Dh) return;  // the whole warp: one row each
  const size_t s0 = ((size_t)n * Dh + d) * Ds + lane * NP;
  const size_t bc0 = ((size_t)b * G + grp) * Ds + lane * NP;
  const float xv = static_cast<float>(x[(size_t)n * Dh + d]);
  const float dtv = dt[n];
  const bool keep = MASK ? mask[b] != 0 : true;
  const float decay = keep ? expf(-expf(static_cast<float>(A_log[h])) * dtv) : 1.f;
  const float dtx = keep ? xv * dtv : 0.f;
  float acc = 0.f;
  for (int i = 0; i < NP; ++i) {
    const float s = decay * static_cast<float>(state_in[s0 + i])
        + dtx * static_cast<float>(B[bc0 + i]);
    state_out[s0 + i] = static_cast<StT>(s);
    acc += s * static_cast<float>(C[bc0 + i]);
  }
  for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffff, acc, o);
  // As ssm_attn: the scan's output in x's dtype, plus x D in the output's.
  if (lane == 0) {
    const float scan = static_cast<float>(static_cast<InT>(acc));
    y[(size_t)n * Dh + d] = static_cast<OutT>(scan + xv * static_cast<float>(Dd[h]));
  }
"""

_kernel: CudaKernel | None = None


def ssm_step_reason(
    x: mx.array,
    A_log: mx.array,
    B: mx.array,
    C: mx.array,
    D: mx.array,
    dt: mx.array,
    state: mx.array,
    mask: mx.array | None,
) -> str | None:
    """Why ``cuda_ssm_step`` cannot take these arrays (``dt`` as mlx-lm's ``ssm_update``
    receives it), or ``None`` if it can."""
    if x.ndim != 4 or x.shape[1] != 1:
        return f"x shape {x.shape}: one token"
    n, _, h, dh = x.shape
    if B.ndim != 4 or B.shape != C.shape or B.shape[:2] != (n, 1):
        return f"B/C shapes {B.shape} / {C.shape}"
    g, ds = B.shape[2:]
    if ds % 32 or ds > 256 or h % g or n * h > 65535:
        return f"state dim {ds}, {h} heads in {g} groups, batch {n}"
    if A_log.shape != (h,) or D.shape != (h,) or dt.shape != (n, 1, h):
        return f"A_log / D / dt shapes {A_log.shape} / {D.shape} / {dt.shape}"
    if state.shape != (n, h, dh, ds):
        return f"state shape {state.shape}"
    if mask is not None and mask.shape != (n, 1):
        return f"mask shape {mask.shape}"
    dtypes = (x.dtype, B.dtype, C.dtype, D.dtype, A_log.dtype, dt.dtype, state.dtype)
    if any(d not in FLOAT_TYPES for d in dtypes) or len(set(dtypes[:3])) > 1:
        return f"dtypes {dtypes}"
    return None


def cuda_ssm_step(
    x: mx.array,
    A_log: mx.array,
    B: mx.array,
    C: mx.array,
    D: mx.array,
    dt: mx.array,
    state: mx.array,
    mask: mx.array | None = None,
) -> tuple[mx.array, mx.array]:
    """``(y, state)`` of one token as mlx-lm's ``ssm_attn`` returns them: ``y`` in the type
    ``x`` and ``D`` promote to, the state in float32; ``dt`` is ``compute_dt``'s (float32).
    The caller checks ``ssm_step_reason`` first."""
    global _kernel
    if _kernel is None:
        _kernel = CudaKernel(
            "ssm_step",
            ["x", "A_log", "B", "C", "Dd", "dt", "state_in", "mask"],
            ["y", "state_out"],
            _SOURCE,
            absent={"mask": mx.int32},
        )
    n, _, h, dh = x.shape
    g, ds = B.shape[2:]
    out_dtype = mx.result_type(x.dtype, D.dtype)
    template = [
        ("InT", x.dtype),
        ("OutT", out_dtype),
        ("StT", mx.float32),
        ("Dh", dh),
        ("Ds", ds),
        ("H", h),
        ("G", g),
        ("MASK", mask is not None),
    ]
    y, out = _kernel(
        inputs=[x, A_log, B, C, D, dt, state, None if mask is None else mask.astype(mx.int32)],
        template=template,
        grid=(32, -(-dh // WARPS) * WARPS, n * h),
        threadgroup=(32, WARPS, 1),
        output_shapes=[x.shape, state.shape],
        output_dtypes=[out_dtype, mx.float32],
    )
    return y, out
