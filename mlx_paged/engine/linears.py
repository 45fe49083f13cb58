"""A model's linear layers through the few-row kernel at 2 to 48 rows, on CUDA.

A decode step of B sequences calls each linear layer with B rows, and on MLX's CUDA
backend every matmul of two or more rows goes through cuBLASLt, whose host cost per
call is about a third of a host-bound step's dispatch at 2 to 64 streams (BENCHMARKS.md,
runs 481 and 487). ``few_row_matmuls`` gives each plain float16 or bfloat16 ``nn.Linear``
(and the ``nn.Embedding`` a tied head multiplies by) a ``__call__`` that runs
``few_rows_matmul`` for 2 to ``MAX_ROWS`` (48) rows and the layer's own matmul
otherwise: one row goes to MLX's ``gemv``, which costs the host less, and more rows to
cuBLAS. The layers keep their parameters; only their class changes.

Each weight shape is checked first: the kernel's result for each row tile count must
match a float32 matmul, or that shape's layers are left as they are. Elsewhere than on
a CUDA GPU nothing changes.
"""

from __future__ import annotations

import logging

import mlx.core as mx
import mlx.nn as nn

from ..attention.kernels import rows

logger = logging.getLogger("mlx_paged.engine")

#: Largest error of a check against float32, as a share of the result's largest magnitude.
TOLERANCE = {mx.float16: 5e-3, mx.bfloat16: 3e-2}
#: Rows the checks multiply: one per 16-row tile count, ragged where a tile can be.
CHECK_ROWS = (2, 27, rows.MAX_ROWS)


def _matmul(x: mx.array, w: mx.array) -> mx.array | None:
    """``x @ w.T`` through the kernel where ``x`` has 2 to ``MAX_ROWS`` rows, else ``None``."""
    n = x.size // x.shape[-1]
    if not 2 <= n <= rows.MAX_ROWS or x.dtype != w.dtype:
        return None
    return rows.few_rows_matmul(x, w)  # (..., K) as it is: no reshapes in the step's graph


class FewRowsLinear(nn.Linear):
    """An ``nn.Linear`` whose calls with 2 to ``MAX_ROWS`` rows run the few-row kernel."""

    def __call__(self, x: mx.array) -> mx.array:
        y = _matmul(x, self.weight)
        if y is None:
            return super().__call__(x)
        return y + self.bias if "bias" in self else y


class FewRowsEmbedding(nn.Embedding):
    """An ``nn.Embedding`` whose ``as_linear`` (a tied head) runs the few-row kernel."""

    def as_linear(self, x: mx.array) -> mx.array:
        y = _matmul(x, self.weight)
        return super().as_linear(x) if y is None else y


_KINDS = {nn.Linear: FewRowsLinear, nn.Embedding: FewRowsEmbedding}


def few_row_matmuls(model: nn.Module) -> int:
    """Route ``model``'s float16/bfloat16 linear layers through the few-row kernel for
    2 to ``MAX_ROWS`` rows; return the layers routed (0 elsewhere than on a CUDA GPU).

    Raises:
        ValueError: for a ``model`` that is not an ``mlx.nn.Module``.
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"few_row_matmuls takes an mlx.nn.Module, got {type(model).__name__}.")
    if not rows.available():
        return 0
    checked: dict[tuple, bool] = {}
    routed = 0
    for _, module in model.named_modules():
        kind = _KINDS.get(type(module))
        if kind is None or "weight" not in module:
            continue
        w = module.weight
        if w.ndim != 2 or w.dtype not in rows.DTYPES or w.shape[1] % 32:
            continue
        key = (w.dtype, *w.shape)
        if key not in checked:
            checked[key] = _check(w)
        if checked[key]:
            module.__class__ = kind
            routed += 1
    return routed


def _check(w: mx.array) -> bool:
    """Whether the kernel matches a float32 matmul with weight ``w`` at every tile count."""
    for n in CHECK_ROWS:
        x = (mx.random.normal((n, w.shape[1])) * 0.5).astype(w.dtype)
        want = x.astype(mx.float32) @ w.astype(mx.float32).T
        try:
            got = rows.few_rows_matmul(x, w).astype(mx.float32)
            err = (mx.abs(got - want).max() / mx.maximum(mx.abs(want).max(), 1e-6)).item()
        except (RuntimeError, ValueError) as e:
            logger.warning("mlx_paged: the few-row kernel cannot run here (%s).", e)
            return False
        if not err <= TOLERANCE[w.dtype]:
            logger.warning(
                "mlx_paged: the few-row kernel differs from a matmul by %.3g for a %s weight "
                "of %s at %d rows; those layers keep MLX's matmul.",
                err,
                w.dtype,
                w.shape,
                n,
            )
            return False
    return True
