"""mlx-lm's depthwise causal convolutions on CUDA, without a cuDNN plan per prompt shape.

The recurrent layers of mlx-lm's hybrids (qwen3_5, qwen3_next, nemotron_h,
granitemoehybrid, falcon_h1, mamba, mamba2, jamba, lfm2, plamo2, kimi_linear, ...)
run a short depthwise ``nn.Conv1d`` over each forward's tokens. On MLX's CUDA
backend that is a cuDNN convolution, and cuDNN builds a plan for every new
(rows, tokens) shape: about 230 ms on an H200 for a qwen3_5 layer's (BENCHMARKS.md,
run 633), paid by every prefill forward whose shape the process has not run before.
A burst of questions of different lengths meets a new shape in most of its forwards.

``route_convolutions`` gives a model's depthwise convolutions the class
``DepthwiseConv1d``: on a CUDA GPU, a call over more than one output token computes the
kernel's taps as ``kernel_size`` products of shifted views of the input, summed in
float32 in one fused elementwise kernel (``mx.compile(shapeless=True)``: built once per
dtype, never per shape). One-token calls (decode steps, whose shapes repeat), the CPU
and Metal keep ``mx.conv1d``. ``MLX_PAGED_CONV=off`` leaves the models as loaded.
"""

from __future__ import annotations

import os
from collections import Counter
from functools import cache

import mlx.core as mx
import mlx.nn as nn

from .prefill import on_cuda

#: Calls served, by path: ``{"taps": n, "conv": n}``.
conv_counts: Counter[str] = Counter()


class DepthwiseConv1d(nn.Conv1d):
    """An ``nn.Conv1d`` with one filter per channel (``groups`` = channels), stride and
    dilation 1, that runs a multi-token call on CUDA as ``depthwise_taps``; else as
    ``nn.Conv1d``. Same parameters, so weights load and save as before."""

    def __call__(self, x: mx.array) -> mx.array:
        taps = self.weight.shape[1]
        if x.shape[1] + 2 * self.padding - taps > 0 and on_cuda():
            conv_counts["taps"] += 1
            if self.padding:
                x = mx.pad(x, [(0, 0), (self.padding, self.padding), (0, 0)])
            return depthwise_taps(x, self.weight, self.get("bias"))
        conv_counts["conv"] += 1
        return super().__call__(x)


def depthwise_taps(x: mx.array, weight: mx.array, bias: mx.array | None = None) -> mx.array:
    """``mx.conv1d(x, weight, groups=channels)`` (no padding) plus ``bias``, as a sum of
    shifted views: ``y[b, t, c] = sum_k x[b, t + k, c] * weight[c, k, 0]``, accumulated
    in float32 and rounded once, then ``bias`` added in the output's dtype.

    Shapes: ``x`` ``(B, T, C)``, ``weight`` ``(C, K, 1)``, ``bias`` ``(C,)``; returns
    ``(B, T - K + 1, C)``.
    """
    k = weight.shape[1]
    n = x.shape[1] - k + 1
    dtype = mx.result_type(x, weight)
    views = [x[:, i : i + n] for i in range(k)]
    columns = [weight[:, i, 0] for i in range(k)]
    extra = [] if bias is None else [bias]
    return _sum_of_taps(k, dtype, bias is not None)(*views, *columns, *extra)


@cache
def _sum_of_taps(k: int, dtype: mx.Dtype, biased: bool):
    def run(*args: mx.array) -> mx.array:
        views, columns = args[:k], args[k : 2 * k]
        acc = views[0].astype(mx.float32) * columns[0].astype(mx.float32)
        for view, column in zip(views[1:], columns[1:], strict=True):
            acc = acc + view.astype(mx.float32) * column.astype(mx.float32)
        out = acc.astype(dtype)
        return out + args[2 * k] if biased else out

    return mx.compile(run, shapeless=True)


def route_convolutions(model: nn.Module) -> int:
    """Give each depthwise ``nn.Conv1d`` of ``model`` the class ``DepthwiseConv1d``;
    return how many changed (0 with ``MLX_PAGED_CONV=off``). Idempotent."""
    if os.environ.get("MLX_PAGED_CONV", "").strip().lower() == "off":
        return 0
    changed = 0
    for _, module in model.named_modules():
        if type(module) is nn.Conv1d and _depthwise(module):
            module.__class__ = DepthwiseConv1d
            changed += 1
    return changed


def _depthwise(conv: nn.Conv1d) -> bool:
    channels, _, per_group = conv.weight.shape
    return per_group == 1 and conv.groups == channels and conv.stride == conv.dilation == 1
