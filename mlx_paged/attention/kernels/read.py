"""Block reads for prefill: copy a layer's tokens from the pool into contiguous K/V.

A prefill chunk's attention runs in MLX's SDPA on ``(B, H, T, D)`` K/V gathered
from the blocks. MLX's generic gather moves one element per thread through a
full index computation; measured on an H100 it read about 0.1 TB/s (0.08 ms per
layer for 4608 tokens of 8 heads x 64, where this kernel takes 0.017 ms). These
kernels copy the same bytes with 16-byte moves, K and V in one launch, each
thread issuing several loads before it stores. CUDA and Metal build the same
body (``block_read.kernel``, see ``source.py``).

``slots[b, t]`` is the pool slot (``block * block_size + offset``) of token
``t`` of sequence ``b``; the pool arrays are in layout A, ``(num_blocks,
block_size, H, D)``. The outputs keep the pool's dtype.

The Metal kernel is NOT RUN HERE: no Apple-silicon machine was available, so it
has never been compiled or executed; ``dispatch`` checks it against
``mx.take`` at first use and falls back to the portable read if it differs.
"""

from __future__ import annotations

import mlx.core as mx

from .cubin import CudaKernel
from .plan import FLOAT_TYPES, kernel_templates
from .source import block_read_source

THREADS = 256  # threads per block
UNROLL = 4  # 16-byte moves per thread, loads issued before stores

_kernels: dict[str, object] = {}


def _kernel(backend: str) -> object:
    if backend not in _kernels:
        make = CudaKernel if backend == "cuda" else mx.fast.metal_kernel
        header, source = block_read_source(backend)
        _kernels[backend] = make(
            "paged_block_read",
            ["keys", "values", "slots"],
            ["k_out", "v_out"],
            source,
            header=header,
        )
    return _kernels[backend]


def read_reason(keys: mx.array, values: mx.array, slots: mx.array) -> str | None:
    """Why the kernels cannot read these arrays, or ``None`` if they can."""
    if keys.ndim != 4 or values.ndim != 4 or keys.shape[:2] != values.shape[:2]:
        return f"pool shapes {keys.shape} / {values.shape}"
    if keys.dtype not in FLOAT_TYPES or values.dtype != keys.dtype:
        return f"pool dtypes {keys.dtype} / {values.dtype}"
    if slots.ndim != 2 or slots.dtype != mx.int32 or slots.size == 0:
        return f"slots {slots.shape} {slots.dtype}"
    if slots.shape[0] > 65535:
        return f"{slots.shape[0]} sequences (grid limit 65535)"
    for x in (keys, values):
        if (x.shape[3] * x.itemsize) % 16:
            return f"rows of {x.shape[3]} x {x.dtype} do not split into 16-byte moves"
    return None


def read_blocks(
    backend: str, keys: mx.array, values: mx.array, slots: mx.array
) -> tuple[mx.array, mx.array]:
    """Tokens at ``slots`` ``(B, T)`` as ``(B, H, T, D)`` K and V.

    The caller checks ``read_reason`` first.

    Args:
        backend: ``"cuda"`` or ``"metal"``.
        keys, values: a layer's pool arrays, ``(num_blocks, block_size, H, D)``.
        slots: ``(B, T)`` int32 pool slots.
    """
    B, T = slots.shape
    hk, dk, hv, dv = keys.shape[2], keys.shape[3], values.shape[2], values.shape[3]
    ck, cv = dk * keys.itemsize // 16, dv * values.itemsize // 16
    per_block = THREADS * UNROLL
    blocks = -(-T * max(hk * ck, hv * cv) // per_block)
    template = [("HK", hk), ("CK", ck), ("HV", hv), ("CV", cv), ("U", UNROLL)]
    kernel_templates.add((f"{backend}_block_read", keys.dtype, values.dtype, *template))
    k, v = _kernel(backend)(
        inputs=[keys, values, slots],
        template=template,
        grid=(blocks * THREADS, B, 2),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[(B, hk, T, dk), (B, hv, T, dv)],
        output_dtypes=[keys.dtype, values.dtype],
    )
    return k, v
