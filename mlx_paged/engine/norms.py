"""Each layer's residual sums and the RMS norms that follow them, one launch each, on CUDA.

A llama layer adds its attention's output to its input and normalizes the sum for its MLP,
then adds the MLP's output, which the next layer (or the model's last norm) normalizes: two
additions and two norms a layer, 65 of a llama-1B decode step's launches where the host's
dispatch bounds a step of few streams. ``fuse_add_norms(model)`` gives each layer of a
supported model a ``__call__`` that makes each sum and the norm after it in one launch
(``add_rms_norm``, ``attention/kernels/add_norm.kernel``), and gives the norm that takes the
sum next a ``CarriedRMSNorm``, which returns the norm already made when it is called with
that sum (and normalizes as before when it is not). Every forward takes the change:
prefills and decode steps, the engine's and mlx-lm's.

Supported: the decoder layers of mlx-lm's llama, qwen2, qwen3 and qwen3_moe modules, whose
norms are ``nn.RMSNorm``. Each (dtype, width, eps) is checked first: the kernel's sum must
equal MLX's and its norm match ``mx.fast.rms_norm`` within ``TOLERANCE``, or the model is
left as it is. Elsewhere than on a CUDA GPU nothing changes.
"""

from __future__ import annotations

import logging
from functools import cache
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from ..attention.kernels import add_norm

logger = logging.getLogger("mlx_paged.engine")

#: Modules whose decoder layers compute ``h = x + attn(norm1(x)); out = h + mlp(norm2(h))``.
MODULES = tuple(f"mlx_lm.models.{name}" for name in ("llama", "qwen2", "qwen3", "qwen3_moe"))
#: Largest difference of a check's norm from ``mx.fast.rms_norm``, as a share of its largest
#: magnitude: about two units in the last place of each dtype.
TOLERANCE = {mx.float16: 2e-3, mx.bfloat16: 1.6e-2, mx.float32: 1e-5}
#: Rows the checks normalize: one, a ragged few, and a prefill's many.
CHECK_ROWS = (1, 7, 300)


class Carry:
    """A sum made with the norm of it, until the norm that takes it next is called."""

    def __init__(self) -> None:
        self.sum: mx.array | None = None
        self.normed: mx.array | None = None

    def put(self, total: mx.array, normed: mx.array) -> None:
        self.sum, self.normed = total, normed

    def take(self, x: mx.array) -> mx.array | None:
        """The norm made with ``x``, if ``x`` is the sum put last (then forgotten)."""
        normed = self.normed if x is self.sum else None
        self.sum = self.normed = None
        return normed


class CarriedRMSNorm(nn.RMSNorm):
    """An ``nn.RMSNorm`` that returns the norm the layer before it made with its sum."""

    carry: Carry

    def __call__(self, x: mx.array) -> mx.array:
        normed = self.carry.take(x)
        return super().__call__(x) if normed is None else normed


def add_rms_norm(a: mx.array, b: mx.array, norm: nn.RMSNorm) -> tuple[mx.array, mx.array]:
    """``(a + b, norm(a + b))``: one launch where the kernel takes the arrays."""
    if add_norm.norm_reason(a, b, norm.weight) is None:
        return add_norm.add_rms_norm(a, b, norm.weight, norm.eps)
    total = a + b
    return total, mx.fast.rms_norm(total, norm.weight, norm.eps)


def _layer_call(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
    """A supported decoder layer's forward, its sums made with the norms after them."""
    r = self.self_attn(self.input_layernorm(x), mask, cache)
    h, normed = add_rms_norm(x, r, self.post_attention_layernorm)
    out, following = add_rms_norm(h, self.mlp(normed), self.next_norm)
    self.next_norm.carry.put(out, following)
    return out


@cache
def _fused_class(kind: type) -> type:
    """``kind`` with ``_layer_call`` for its ``__call__``."""
    return type(kind.__name__, (kind,), {"__call__": _layer_call, "__module__": __name__})


def _supported(layer: nn.Module) -> bool:
    kind = type(layer)
    kind = kind.__bases__[0] if kind.__module__ == __name__ else kind
    norms = [getattr(layer, n, None) for n in ("input_layernorm", "post_attention_layernorm")]
    return kind.__module__ in MODULES and all(isinstance(n, nn.RMSNorm) for n in norms)


def fuse_add_norms(model: nn.Module) -> int:
    """Make each supported layer's residual sums with the norms after them, one launch each;
    return the layers changed (0 elsewhere than on a CUDA GPU, for a model whose layers are
    not all supported, or when called again).

    Raises:
        ValueError: for a ``model`` that is not an ``mlx.nn.Module``.
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"fuse_add_norms takes an mlx.nn.Module, got {type(model).__name__}.")
    inner = getattr(model, "model", None)
    layers = list(getattr(inner, "layers", None) or ())
    last = getattr(inner, "norm", None)
    if not add_norm.available() or not layers or type(last) is not nn.RMSNorm:
        return 0
    if not all(_supported(layer) for layer in layers):
        return 0
    if any(type(layer).__module__ == __name__ for layer in layers):
        return 0  # changed before
    norms = [layer.post_attention_layernorm for layer in layers]
    norms += [layer.input_layernorm for layer in layers[1:]] + [last]
    kinds = {(n.weight.dtype, n.weight.shape, float(n.eps)) for n in norms}
    if not all(_check(*kind) for kind in kinds):
        return 0
    following = [layer.input_layernorm for layer in layers[1:]] + [last]
    for layer, norm in zip(layers, following, strict=True):
        norm.__class__ = CarriedRMSNorm
        object.__setattr__(norm, "carry", Carry())  # not a child module: no parameters
        object.__setattr__(layer, "next_norm", norm)
        layer.__class__ = _fused_class(type(layer))
    return len(layers)


def _check(dtype: mx.Dtype, shape: tuple[int, ...], eps: float) -> bool:
    """Whether the kernel's sum equals MLX's and its norm matches ``mx.fast.rms_norm`` for
    norms of this weight dtype and shape."""
    if len(shape) != 1 or dtype not in TOLERANCE:
        return False
    keys = mx.random.split(mx.random.key(0), 3)
    weight = (1 + mx.random.normal(shape, key=keys[0]) * 0.1).astype(dtype)
    for n in CHECK_ROWS:
        a = mx.random.normal((n, *shape), key=keys[1]).astype(dtype)
        b = mx.random.normal((n, *shape), key=keys[2]).astype(dtype)
        want_sum = a + b
        want = mx.fast.rms_norm(want_sum, weight, eps).astype(mx.float32)
        try:
            total, normed = add_norm.add_rms_norm(a, b, weight, eps)
            same = mx.array_equal(total, want_sum).item()
            err = (mx.abs(normed.astype(mx.float32) - want).max() / mx.abs(want).max()).item()
        except (RuntimeError, ValueError) as e:
            logger.warning("mlx_paged: the add-norm kernel cannot run here (%s).", e)
            return False
        if not (same and err <= TOLERANCE[dtype]):
            logger.warning(
                "mlx_paged: the add-norm kernel differs from MLX (sums %s, norms by %.3g) for "
                "%s rows of %d at %d rows; the model keeps MLX's sums and norms.",
                "equal" if same else "differ",
                err,
                dtype,
                shape[0],
                n,
            )
            return False
    return True
