"""A residual sum and the RMS norm of it in one CUDA launch.

A llama layer adds its attention's output to its input and normalizes the sum, then adds its
MLP's output and the next layer normalizes that: 32 additions and 33 norms, 65 launches of a
llama-1B decode step, where a step of few streams is bound by the host's dispatch.
``add_rms_norm`` returns ``a + b`` and ``mx.fast.rms_norm(a + b, weight, eps)`` from one
launch (``add_norm.kernel``): the sum rounded as MLX rounds it, the norm computed as MLX's
CUDA kernel computes it (squares summed in float32, the weight multiplied in the input's
dtype), so only the order of the sum of squares differs. Metal does not use it.
"""

from __future__ import annotations

import struct
from functools import cache

import mlx.core as mx

from .cubin import CudaKernel
from .dispatch import backend_available
from .source import sections

DTYPES = (mx.float16, mx.bfloat16, mx.float32)
#: A block's threads at most; a row's 16-byte words beyond them are held by the same threads.
THREADS = 256
#: 16-byte words a thread may hold (registers): rows of up to 32,768 float16 values.
MOST_WORDS = 16


@cache
def _kernel() -> CudaKernel:
    text = sections("add_norm.kernel")
    return CudaKernel(
        "add_norm", ["a", "b", "w"], ["sum", "normed"], text["add_norm"], header=text["header"]
    )


def available() -> bool:
    """Whether the default device is a CUDA GPU (where the kernel runs)."""
    return backend_available("cuda")


def norm_reason(a: mx.array, b: mx.array, weight: mx.array) -> str | None:
    """Why ``add_rms_norm(a, b, weight, eps)`` cannot run, or ``None`` where it can."""
    if a.dtype not in DTYPES or b.dtype != a.dtype or weight.dtype != a.dtype:
        return (
            f"a, b and the weight must share one of float16, bfloat16 and float32, got "
            f"{a.dtype}, {b.dtype} and {weight.dtype}"
        )
    if a.shape != b.shape or a.ndim < 1 or weight.shape != a.shape[-1:]:
        return (
            f"a and b must have one shape ending in the weight's, got {a.shape}, {b.shape} "
            f"and {weight.shape}"
        )
    width = 16 // a.dtype.size
    d = a.shape[-1]
    if d % width or not 0 < d // width <= THREADS * MOST_WORDS:
        most = width * THREADS * MOST_WORDS
        return f"the row's width must be a positive multiple of {width} up to {most}, got {d}"
    if a.size == 0:
        return "a has no rows"
    return None


def add_rms_norm(
    a: mx.array, b: mx.array, weight: mx.array, eps: float
) -> tuple[mx.array, mx.array]:
    """``(a + b, mx.fast.rms_norm(a + b, weight, eps))`` in one launch, on a CUDA GPU.

    Raises:
        ValueError: where ``norm_reason`` gives a reason.
    """
    reason = norm_reason(a, b, weight)
    if reason is not None:
        raise ValueError(f"add_rms_norm: {reason}.")
    d = a.shape[-1]
    words = d // (16 // a.dtype.size)
    threads = min(THREADS, 32 * -(-words // 32))
    eps_bits = struct.unpack("<i", struct.pack("<f", eps))[0]
    template = [("T", a.dtype), ("D", d), ("THREADS", threads)]
    template += [("PER", -(-words // threads)), ("EPS", eps_bits)]
    rows = a.size // d
    return _kernel()(
        inputs=[a, b, weight],
        template=template,
        grid=(rows * threads, 1, 1),
        threadgroup=(threads, 1, 1),
        output_shapes=[a.shape, a.shape],
        output_dtypes=[a.dtype, a.dtype],
    )
