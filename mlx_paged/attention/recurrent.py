"""mlx-lm's GatedDeltaNet recurrence on CUDA, through one kernel instead of a loop of ops.

``mlx_lm.models.gated_delta.gated_delta_update`` calls ``gated_delta_ops`` (a
Python loop of MLX ops over the prompt's tokens) wherever Metal is not
available. ``route_gated_delta`` rebinds that name, in mlx-lm's module, to
``gated_delta_ops`` here, which sends calls on a CUDA GPU to
``kernels.gated_delta.cuda_gated_delta`` and everything else (the CPU, shapes
the kernel does not take) to mlx-lm's own function. It applies to every cache
in the process, mlx-lm's own ones included. Metal is unchanged: mlx-lm runs its
own kernel there.

Each combination of dtypes and head shapes is checked once, at its first call,
against mlx-lm's loop on a few random tokens; one that differs is logged and
keeps the loop. ``MLX_PAGED_GATED_DELTA=off`` leaves mlx-lm's function in place.

A one-token call (a decode step: every GatedDeltaNet layer, every token) launches
through ``mx.compile``, which replays the kernel it recorded for those shapes:
about 8 us of host time a call on an H200 against 25-29 us for a direct launch and
36-47 us for mlx-lm's loop (BENCHMARKS.md, run 625). Its checks are kept per
shapes and dtypes. A prompt's calls, whose lengths vary, launch directly.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from collections.abc import Callable

import mlx.core as mx
from mlx_lm.models import gated_delta

from .kernels.gated_delta import cuda_gated_delta, gated_delta_reason

logger = logging.getLogger("mlx_paged.attention")

_original_ops = gated_delta.gated_delta_ops

#: Calls served, by path: ``{"kernel": n, "ops": n}``.
gated_delta_counts: Counter[str] = Counter()

_checked: dict[tuple, bool] = {}

# The kernel's compiled replay (``mx.compile`` traces each new shape once) for one-token
# calls, and per shapes and dtypes whether the kernel takes them: ``None`` where it does not.
_one_token_launch = mx.compile(cuda_gated_delta)
_one_token: dict[tuple, Callable | None] = {}
_ONE_TOKEN_SHAPES = 512  # shapes kept at most (batch sizes times layer shapes)


def route_gated_delta() -> bool:
    """Send mlx-lm's GatedDeltaNet recurrence to ``gated_delta_ops``; idempotent. Returns
    whether it is routed (not with ``MLX_PAGED_GATED_DELTA=off``)."""
    if os.environ.get("MLX_PAGED_GATED_DELTA", "").strip().lower() == "off":
        return False
    gated_delta.gated_delta_ops = gated_delta_ops
    return True


def gated_delta_ops(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    g: mx.array,
    beta: mx.array,
    state: mx.array | None = None,
    mask: mx.array | None = None,
) -> tuple[mx.array, mx.array]:
    """Drop-in for mlx-lm's ``gated_delta_ops``: the CUDA kernel where it runs and passed
    its check, else mlx-lm's loop.

    Shapes: ``q, k`` ``(B, T, Hk, Dk)``; ``v`` ``(B, T, Hv, Dv)``; ``g`` ``(B, T, Hv)``
    or ``(B, T, Hv, Dk)``; ``beta`` ``(B, T, Hv)``; ``state`` ``(B, Hv, Dv, Dk)``;
    ``mask`` ``(B, T)``. Returns ``y`` ``(B, T, Hv, Dv)`` and the new state.
    """
    if state is None:
        b, _, _, dk = q.shape
        hv, dv = v.shape[2:]
        state = mx.zeros((b, hv, dv, dk), dtype=mx.float32)
    if _on_cuda():
        if q.ndim == 4 and q.shape[1] == 1:
            run = _one_token_run(q, k, v, g, beta, state, mask)
        else:
            run = cuda_gated_delta if _takes(q, k, v, g, beta, state, mask) else None
        if run is not None:
            gated_delta_counts["kernel"] += 1
            return run(q, k, v, g, beta, state, mask)
    gated_delta_counts["ops"] += 1
    return _original_ops(q, k, v, g, beta, state, mask)


def _takes(*arrays: mx.array | None) -> bool:
    """Whether the kernel takes these arrays' shapes and passed its check on them."""
    return gated_delta_reason(*arrays) is None and _trusted(*arrays)


def _one_token_run(*arrays: mx.array | None) -> Callable | None:
    """The compiled launch for a one-token call of these shapes and dtypes, or ``None``
    where the kernel does not take them (decided once per shapes and dtypes)."""
    key = tuple((x.shape, x.dtype) if x is not None else None for x in arrays)
    if key not in _one_token:
        if len(_one_token) >= _ONE_TOKEN_SHAPES:
            _one_token.clear()
        _one_token[key] = _one_token_launch if _takes(*arrays) else None
    return _one_token[key]


def _on_cuda() -> bool:
    return mx.default_device() == mx.gpu and mx.cuda.is_available()


def _trusted(*arrays: mx.array | None) -> bool:
    """Whether the kernel matched mlx-lm's loop on a few random tokens of these arrays'
    dtypes and head shapes (checked at the first call of each)."""
    q, k, v, g, beta, state, mask = arrays
    key = (q.dtype, g.dtype, beta.dtype, state.dtype, q.shape[2:], v.shape[2:], g.ndim)
    key += (mask is not None,)
    if key not in _checked:
        _checked[key] = _check(q, v, g, beta, state, mask is not None)
        if not _checked[key]:
            logger.warning(
                "mlx_paged: the CUDA gated delta kernel differs from mlx-lm's ops for %s; "
                "using the ops.",
                key,
            )
    return _checked[key]


def _check(
    q: mx.array, v: mx.array, g: mx.array, beta: mx.array, state: mx.array, masked: bool
) -> bool:
    """The kernel against mlx-lm's loop on 9 random tokens of two sequences shaped as these."""
    b, t, hk, dk = 2, 9, q.shape[2], q.shape[3]
    hv, dv = v.shape[2:]
    rnd = mx.random.key(0)
    r = mx.random.split(rnd, 6)
    qs = mx.random.normal((b, t, hk, dk), key=r[0])
    ks = mx.random.normal((b, t, hk, dk), key=r[1])
    qs = (qs / mx.linalg.norm(qs, axis=-1, keepdims=True) * dk**-0.5).astype(q.dtype)
    ks = (ks / mx.linalg.norm(ks, axis=-1, keepdims=True)).astype(q.dtype)
    vs = mx.random.normal((b, t, hv, dv), key=r[2]).astype(v.dtype)
    gs = mx.random.uniform(0.5, 1.0, (b, t, hv, *g.shape[3:]), key=r[3]).astype(g.dtype)
    bs = mx.random.uniform(0.0, 1.0, (b, t, hv), key=r[4]).astype(beta.dtype)
    s0 = mx.random.normal((b, hv, dv, dk), key=r[5]).astype(state.dtype)
    mask = mx.array([[True] * t, [False] * 3 + [True] * (t - 3)]) if masked else None
    got = cuda_gated_delta(qs, ks, vs, gs, bs, s0, mask)
    want = _original_ops(qs, ks, vs, gs, bs, s0, mask)
    if masked:  # the ops compute y at masked tokens too; the kernel writes 0 there
        keep = mask[..., None, None]
        got, want = (mx.where(keep, got[0], 0), got[1]), (mx.where(keep, want[0], 0), want[1])
    tol = 1e-4 if q.dtype == mx.float32 else 3e-2
    return all(
        a.dtype == b_.dtype and mx.allclose(a, b_, atol=tol, rtol=tol).item()
        for a, b_ in zip(got, want, strict=True)
    )
