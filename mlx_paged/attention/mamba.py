"""mlx-lm's Mamba2 state update on CUDA: a decode step's token through one kernel.

mlx-lm's Mamba2 layers call ``mlx_lm.models.ssm.ssm_update``, which runs its Metal
kernel for a one-token step on Apple silicon and ``ssm_attn`` (the chunked form
written for prompts) everywhere else: on MLX's CUDA backend, a few dozen small ops
per layer and token. ``route_ssm_update`` rebinds that name, in ``ssm`` and in every
mlx-lm module that imported it, to ``ssm_update`` here. It sends a one-token step
with a state on a CUDA GPU to ``kernels.ssm_step.cuda_ssm_step`` through
``mx.compile`` (which replays the launch it recorded for those shapes), and
everything else (prompts, the CPU, Metal, shapes the kernel does not take, calls with
``lengths``) to mlx-lm's own function. It applies to every cache in the process,
mlx-lm's own ones included.

Each combination of shapes and dtypes is checked once, at its first call, against
``ssm_attn`` on random inputs of those shapes; one that differs is logged and keeps
mlx-lm's path. ``MLX_PAGED_SSM=off`` leaves mlx-lm's function in place.
"""

from __future__ import annotations

import logging
import os
import sys
from collections import Counter
from collections.abc import Callable, Sequence

import mlx.core as mx
from mlx_lm.models import ssm

from .kernels.ssm_step import cuda_ssm_step, ssm_step_reason

logger = logging.getLogger("mlx_paged.attention")

_original_update = ssm.ssm_update

#: One-token steps served, by path: ``{"kernel": n, "ops": n}`` (calls on other paths,
#: prompts among them, are not counted).
ssm_counts: Counter[str] = Counter()

# Per shapes, dtypes and time-step limit: the compiled launch, or None where the kernel
# does not take them or failed its check.
_runs: dict[tuple, Callable | None] = {}
_RUN_SHAPES = 512  # shapes kept at most (batch sizes times layer shapes)


def _step(x, A_log, B, C, D, dt, dt_bias, state, mask, limit):
    dt = ssm.compute_dt(dt, dt_bias, limit)  # mlx-lm's: float32 softplus, clipped
    return cuda_ssm_step(x, A_log, B, C, D, dt, state, mask)


_launch = mx.compile(_step)


def route_ssm_update() -> int:
    """Send mlx-lm's Mamba2 state update to ``ssm_update``; idempotent. Returns how many
    names it rebound (0 with ``MLX_PAGED_SSM=off``)."""
    if os.environ.get("MLX_PAGED_SSM", "").strip().lower() == "off":
        return 0
    changed = 0
    for name, module in list(sys.modules.items()):
        if name.startswith("mlx_lm") and getattr(module, "ssm_update", None) is _original_update:
            module.ssm_update = ssm_update
            changed += 1
    return changed


def ssm_update(
    hidden_states: mx.array,
    A_log: mx.array,
    B: mx.array,
    C: mx.array,
    D: mx.array,
    dt: mx.array,
    dt_bias: mx.array,
    state: mx.array | None = None,
    time_step_limit: Sequence[float] = (0.001, 100.0),
    mask: mx.array | None = None,
    lengths: mx.array | None = None,
) -> tuple[mx.array, mx.array]:
    """Drop-in for mlx-lm's ``ssm_update``: a one-token step with a state through the CUDA
    kernel where it runs and passed its check, else mlx-lm's function.

    Shapes: ``hidden_states`` ``(B, T, H, Dh)``; ``B``, ``C`` ``(B, T, G, Ds)``; ``dt``
    ``(B, T, H)``; ``A_log``, ``D``, ``dt_bias`` ``(H,)``; ``state`` ``(B, H, Dh, Ds)``;
    ``mask`` ``(B, T)``. Returns ``y`` shaped as ``hidden_states`` and the new state.
    """
    one_token = state is not None and lengths is None and hidden_states.shape[1:2] == (1,)
    if one_token and _on_cuda():
        limit = tuple(float(v) for v in time_step_limit)
        arrays = (hidden_states, A_log, B, C, D, dt, dt_bias, state, mask)
        run = _run_for(arrays, limit)
        ssm_counts["ops" if run is None else "kernel"] += 1
        if run is not None:
            return run(*arrays, limit)
    return _original_update(
        hidden_states, A_log, B, C, D, dt, dt_bias, state, time_step_limit, mask, lengths
    )


def _on_cuda() -> bool:
    return mx.default_device() == mx.gpu and mx.cuda.is_available()


def _run_for(arrays: tuple, limit: tuple[float, ...]) -> Callable | None:
    """The compiled launch for these arrays' shapes and dtypes, or ``None`` where the
    kernel does not take them (decided once per shapes, dtypes and limit)."""
    key = tuple(None if x is None else (x.shape, x.dtype) for x in arrays) + limit
    if key not in _runs:
        if len(_runs) >= _RUN_SHAPES:
            _runs.clear()
        x, A_log, B, C, D, dt, dt_bias, state, mask = arrays
        why = ssm_step_reason(x, A_log, B, C, D, dt, state, mask)
        _runs[key] = _launch if why is None and _check(arrays, limit) else None
    return _runs[key]


def _check(arrays: tuple, limit: tuple[float, ...]) -> bool:
    """The kernel against mlx-lm's ``ssm_attn`` on random inputs shaped as ``arrays``, in
    two sequences (the second's token masked out where the call has a mask)."""
    x, A_log, B, C, D, dt, dt_bias, state, mask = arrays
    n, _, h, dh = x.shape
    g, ds = B.shape[2:]
    r = mx.random.split(mx.random.key(0), 7)
    xs = mx.random.normal((2, 1, h, dh), key=r[0]).astype(x.dtype)
    bs = mx.random.normal((2, 1, g, ds), key=r[1]).astype(B.dtype)
    cs = mx.random.normal((2, 1, g, ds), key=r[2]).astype(C.dtype)
    a_log = mx.random.uniform(-1.0, 1.0, (h,), key=r[3]).astype(A_log.dtype)
    ds_ = mx.random.normal((h,), key=r[4]).astype(D.dtype)
    dts = mx.random.normal((2, 1, h), key=r[5]).astype(dt.dtype)
    s0 = mx.random.normal((2, h, dh, ds), key=r[6]).astype(state.dtype)
    m = None if mask is None else mx.array([[True], [False]]).astype(mask.dtype)
    args = (xs, a_log, bs, cs, ds_, dts, dt_bias, s0, m)
    got = _step(*args, limit)
    want = _original_update(*args[:8], limit, m)
    tol = 1e-4 if x.dtype == mx.float32 else 3e-2
    ok = all(
        a.dtype == b.dtype and a.shape == b.shape and mx.allclose(a, b, atol=tol, rtol=tol).item()
        for a, b in zip(got, want, strict=True)
    )
    if not ok:
        logger.warning(
            "mlx_paged: the CUDA SSM step kernel differs from mlx-lm's ssm_attn for %s; "
            "using mlx-lm's path.",
            (x.shape, B.shape, x.dtype, state.dtype, mask is not None),
        )
    return ok
