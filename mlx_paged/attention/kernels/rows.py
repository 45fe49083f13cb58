"""Matmuls of a few rows on CUDA tensor cores, at a custom kernel's host cost.

A decode step of B sequences multiplies B rows by each linear layer's weight. MLX's CUDA
backend runs one row through its own ``gemv``, but two or more through cuBLASLt, whose
call MLX sets up and captures into the step's CUDA graph anew each time: on an H200 a
llama-1B step's 65 matmuls took 1.5-1.8 ms of host dispatch at 8-64 rows, against
0.6 ms for this kernel (BENCHMARKS.md, run 486), and at those sizes the step is host-bound.
``few_rows_matmul`` computes ``x @ w.T`` for up to ``MAX_ROWS`` rows of float16 or
bfloat16 (``few_rows.kernel``) in one launch. Metal does not use it: MLX's Metal
matmuls do not go through cuBLAS.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from functools import cache

import mlx.core as mx

from .cubin import CudaKernel
from .dispatch import backend_available
from .source import sections

#: Rows a call may have: three 16-row tiles. At 64 rows a llama-1B step on an H200 was
#: GPU-bound with this kernel and no faster than with cuBLAS (0.99x with its best 64-row
#: tilings, run 509); at 48 it was 1.37x (BENCHMARKS.md, run 506).
MAX_ROWS = 48
#: Rows the kernel computes (four 16-row tiles): a call that names its tiling may have
#: this many.
KERNEL_ROWS = 64
DTYPES = (mx.float16, mx.bfloat16)
#: A tiling: 8-column tiles a block owns, its warps (splitting K), and the 32-wide K chunks
#: a warp loads before it multiplies.
Tiling = tuple[int, int, int]
#: Weights of at most this many columns take a narrow tiling (more blocks, each with
#: more warps); wider ones a wide tiling (each block more columns, so fewer reads of x).
NARROW = 4096
#: ``(narrow, wide)`` tilings by 16-row tiles of x: the fastest of each llama-1B step
#: shape on an H200 under ``ncu`` (BENCHMARKS.md, run 495). A step's 65 matmuls took
#: 937 / 1,241 / 1,353 us at 16 / 32 / 48 rows, against 1,264 / 1,926 / 2,665 with the
#: 2 / 8 / 2 tiling every shape took before (runs 506 and 495).
TILINGS: dict[int, tuple[Tiling, Tiling]] = {
    1: ((2, 16, 1), (2, 8, 2)),
    2: ((4, 8, 2), (8, 4, 1)),
    3: ((4, 8, 1), (4, 4, 1)),
}


def tiling_for(m: int, n: int) -> Tiling:
    """The tiling for ``m`` rows (1 to ``MAX_ROWS``) of a weight of ``n`` columns."""
    return TILINGS[-(-m // 16)][n > NARROW]


@cache
def _kernel() -> CudaKernel:
    text = sections("few_rows.kernel")
    return CudaKernel("few_rows", ["x", "w"], ["out"], text["matmul"], header=text["header"])


def available() -> bool:
    """Whether the default device is a CUDA GPU (where the kernel runs)."""
    return backend_available("cuda")


def tiling_reason(t: Tiling, m: int) -> str | None:
    """Why the kernel cannot take tiling ``t`` for ``m`` rows, or ``None`` where it can.

    Up to 8 warps a block always launches (256 threads of at most 255 registers fit a
    multiprocessor's 64K). 16 warps may have 128 registers each, so there the tiling's
    accumulators and one round of loads (``4 * MT * NT + 4 * U * (NT + 2 * MT)`` 32-bit
    registers) must stay within 80, leaving the rest for addresses: compiled by NVRTC for
    sm_80 and sm_90, the 16-warp tilings this allows at 1-64 rows used at most 119.
    """
    if len(t) != 3 or not all(type(v) is int for v in t):
        return f"a tiling is three ints (column tiles, warps, K chunks), got {t!r}"
    nt, warps, unroll = t
    if not (1 <= nt <= 16 and warps in (1, 2, 4, 8, 16) and 1 <= unroll <= 4):
        return (
            f"a tiling needs 1-16 column tiles, 1-16 warps (a power of two), 1-4 K chunks, got {t}"
        )
    mt = -(-m // 16)
    if warps == 16 and 4 * mt * nt + 4 * unroll * (nt + 2 * mt) > 80:
        return f"tiling {t} at {m} rows needs too many registers for 16 warps: take 8 or fewer"
    return None


def rows_reason(x: mx.array, w: mx.array, tiling: Tiling | None = None) -> str | None:
    """Why ``few_rows_matmul(x, w, tiling)`` cannot run, or ``None`` where it can."""
    if x.ndim < 2 or w.ndim != 2:
        return f"x must have 2 or more dimensions and w 2, got {x.ndim} and {w.ndim}"
    if x.dtype not in DTYPES or w.dtype != x.dtype:
        return f"x and w must be both float16 or both bfloat16, got {x.dtype} and {w.dtype}"
    k = x.shape[-1]
    if k != w.shape[1] or k % 32 or not k:
        return f"K must match and be a positive multiple of 32, got {k} and {w.shape[1]}"
    most = MAX_ROWS if tiling is None else KERNEL_ROWS
    if not 1 <= x.size // k <= most:
        return f"x must have 1 to {most} rows, got {x.size // k}"
    return None if tiling is None else tiling_reason(tiling, x.size // k)


def few_rows_matmul(x: mx.array, w: mx.array, tiling: Tiling | None = None) -> mx.array:
    """``x @ w.T`` for ``x`` of ``(..., K)`` (its rows all but the last dimension) and a
    weight ``w`` of ``(N, K)``, on a CUDA GPU: ``(..., N)``.

    ``tiling`` (for tuning: ``benchmarks/matmul_shapes.py --tilings``) replaces the one
    ``TILINGS`` gives and allows up to ``KERNEL_ROWS`` rows.

    Raises:
        ValueError: where ``rows_reason`` gives a reason.
    """
    reason = rows_reason(x, w, tiling)
    if reason is not None:
        raise ValueError(f"few_rows_matmul: {reason}.")
    m, n = x.size // x.shape[-1], w.shape[0]
    tiling = tiling or tiling_for(m, n)
    nt, warps = tiling[:2]
    return _kernel()(
        inputs=[x, w],
        template=_template(x.dtype, x.ndim, m, tiling),
        grid=(-(-n // (8 * nt)) * warps * 32, 1, 1),
        threadgroup=(warps * 32, 1, 1),
        output_shapes=[(*x.shape[:-1], n)],
        output_dtypes=[x.dtype],
    )[0]


def prebuild(dtypes: Iterable[mx.Dtype], ndims: Sequence[int] = (2, 3)) -> int:
    """Build, or find on disk, the binary of every launch ``few_rows_matmul`` makes for an
    ``x`` of one of ``dtypes`` with one of ``ndims`` dimensions: each row-tile count with
    its narrow and its wide tiling. Return how many (0 where the kernel is not built here).

    Each is its own NVRTC build, 160-300 ms on an H200; one first met by a request, such
    as a forward's 42 rows as ``(1, 42, K)``, was paid on its path (BENCHMARKS.md, runs 657-658).

    Raises:
        ValueError: for a dtype the kernel does not take, or fewer than 2 dimensions.
    """
    dtypes, ndims = list(dtypes), list(ndims)
    for dtype in dtypes:
        if dtype not in DTYPES:
            raise ValueError(f"the few-row kernel takes float16 or bfloat16, not {dtype}.")
    for ndim in ndims:
        if isinstance(ndim, bool) or not isinstance(ndim, int) or ndim < 2:
            raise ValueError(f"x has 2 or more dimensions, got {ndim!r}.")
    if not available():
        return 0
    built = 0
    for dtype in dtypes:
        w = mx.zeros((8, 32), dtype)
        for ndim in ndims:
            x = mx.zeros((*(1,) * (ndim - 1), 32), dtype)
            for tiles, pair in TILINGS.items():
                for tiling in pair:
                    template = _template(dtype, ndim, 16 * tiles, tiling)
                    built += _kernel().build([x, w], template, [dtype])
    return built


def _template(dtype: mx.Dtype, ndim: int, m: int, tiling: Tiling) -> list[tuple]:
    """The kernel's template arguments for ``m`` rows of an ``ndim``-dimensional ``x``."""
    nt, warps, unroll = tiling
    template = [("T", dtype), ("BF16", dtype == mx.bfloat16), ("XD", ndim), ("MT", -(-m // 16))]
    return template + [("NT", nt), ("WARPS", warps), ("U", unroll)]
