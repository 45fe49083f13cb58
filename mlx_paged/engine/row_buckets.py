"""Prefill matmuls over a few row counts on CUDA, so cuBLAS plans each count once.

MLX's CUDA matmul asks cuBLASLt for an algorithm the first time it meets a shape:
about 4 ms for each new row count of a llama-1B projection on an H100 (BENCHMARKS.md,
run 146), paid once per distinct weight shape by every prefill forward whose token
count the process has not run. A served burst's forwards meet a new count in most of
them (rows times tokens per row), and a hybrid model has more weight shapes than a
llama: its prefill forwards took 15-110 ms with a new shape against 15-48 ms with one
seen (run 639).

``bucket_matmul_rows(model)`` gives each ``nn.Linear`` (and ``FewRowsLinear``) a call
that, for a prompt's forward of more than ``MIN_ROWS`` rows (never a decode step's
one token a row), pads the rows with zeros to ``row_bucket(rows)``, at most a quarter
more and four counts an octave, multiplies, and drops the padding's rows: the same
values, over a row count the process has likely run. ``warm_row_buckets`` runs each
weight shape once at every bucket up to a prompt's largest forward, so a server meets
them all while it starts (the server's warm-up does, with the flag). Elsewhere than on a
CUDA GPU nothing changes. Off unless asked for (``mlx_paged.server
--matmul-row-buckets``): on the H200 it shortened the server's warm-up but gave no
first-token time outside the runs' spread (BENCHMARKS.md, runs 643-646).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache

import mlx.core as mx
import mlx.nn as nn

from ..attention.prefill import on_cuda
from .linears import FewRowsLinear

#: Row counts up to this run unpadded (a burst's short forwards, the few-row kernel's).
MIN_ROWS = 64


def row_bucket(rows: int) -> int:
    """The row count a prompt's matmul of ``rows`` rows runs at: ``rows`` up to
    ``MIN_ROWS``, then the next multiple of a quarter of ``rows``' power of two (64, 80,
    96, 112, 128, 160, ...)."""
    if rows <= MIN_ROWS:
        return rows
    step = 1 << (rows.bit_length() - 3)
    return -(-rows // step) * step


def bucket_matmul_rows(model: nn.Module) -> int:
    """Give ``model``'s ``nn.Linear`` and ``FewRowsLinear`` layers a call that runs a
    prompt's rows at ``row_bucket`` counts on CUDA; return how many changed (0 elsewhere
    than on a CUDA GPU). Idempotent; run it after ``few_row_matmuls``.

    Raises:
        ValueError: for a ``model`` that is not an ``mlx.nn.Module``.
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"bucket_matmul_rows takes an mlx.nn.Module, got {type(model).__name__}.")
    if not on_cuda():
        return 0
    changed = 0
    for _, module in model.named_modules():
        if type(module) in (nn.Linear, FewRowsLinear):
            module.__class__ = _bucketed(type(module))
            changed += 1
    return changed


def bucket_counts(max_rows: int) -> list[int]:
    """Every ``row_bucket`` count above ``MIN_ROWS`` up to the one ``max_rows`` pads to."""
    out, rows = [], MIN_ROWS + 1
    while rows <= max_rows:
        out.append(row_bucket(rows))
        rows = out[-1] + 1
    return out


def warm_row_buckets(model: nn.Module, max_rows: int) -> int:
    """Multiply zeros by each distinct weight of ``model``'s bucketed layers at every row
    count of ``bucket_counts(max_rows)``, so that cuBLAS has planned them before a prompt
    comes; return the matmuls run."""
    layers = {}
    for _, module in model.named_modules():
        if type(module).__name__.startswith("RowBucket"):
            w = module.weight
            layers.setdefault((w.shape, w.dtype, "bias" in module), module)
    runs = 0
    for (shape, dtype, _), layer in layers.items():
        for rows in bucket_counts(max_rows):
            mx.eval(layer(mx.zeros((rows, shape[1]), dtype=dtype)))
            runs += 1
    return runs


@cache
def _bucketed(cls: type[nn.Linear]) -> type[nn.Linear]:
    """A subclass of ``cls`` whose prompt calls run at ``row_bucket`` rows."""
    call: Callable[[nn.Linear, mx.array], mx.array] = cls.__call__

    def __call__(self: nn.Linear, x: mx.array) -> mx.array:
        if x.ndim < 2 or x.shape[-2] == 1:  # a decode step's one token a row
            return call(self, x)
        rows = x.size // x.shape[-1]
        padded = row_bucket(rows)
        if padded == rows:
            return call(self, x)
        flat = mx.pad(x.reshape(rows, x.shape[-1]), [(0, padded - rows), (0, 0)])
        y = call(self, flat)[:rows]
        return y.reshape(*x.shape[:-1], y.shape[-1])

    return type(f"RowBucket{cls.__name__}", (cls,), {"__call__": __call__})
