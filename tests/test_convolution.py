"""Depthwise convolutions as a sum of shifted views on CUDA (``mlx_paged.attention.convolution``),
against mlx-lm's ``nn.Conv1d`` on the same weights and tokens."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten, tree_map
from mlx_lm.models.cache import make_prompt_cache
from test_gated_delta import cuda_only
from tiny_models import HYBRIDS, tiny_model

from mlx_paged import PagedEngine, make_paged_cache
from mlx_paged.attention import DepthwiseConv1d, conv_counts, convolution, route_convolutions

#: Families whose recurrent layers hold a depthwise convolution (rwkv7's do not).
CONV_FAMILIES = [*HYBRIDS, "mamba2", "mamba"]


def depthwise(channels: int, taps: int, bias: bool, padding: int = 0) -> nn.Conv1d:
    conv = nn.Conv1d(channels, channels, taps, padding=padding, groups=channels, bias=bias)
    if bias:
        conv.bias = mx.random.normal((channels,), key=mx.random.key(1))
    return conv


def test_a_convolution_is_rebound_only_where_it_is_depthwise(monkeypatch):
    model = nn.Sequential(
        depthwise(8, 4, bias=False),
        nn.Conv1d(8, 8, 4),  # every output channel reads every input channel
        nn.Conv1d(8, 8, 3, groups=8, stride=2),  # depthwise, but strided
        depthwise(8, 3, bias=True, padding=2),
    )
    before = tree_flatten(model.parameters())
    monkeypatch.setenv("MLX_PAGED_CONV", "off")
    assert route_convolutions(model) == 0
    monkeypatch.delenv("MLX_PAGED_CONV")
    assert route_convolutions(model) == 2
    kinds = [type(layer) for layer in model.layers]
    assert kinds == [DepthwiseConv1d, nn.Conv1d, nn.Conv1d, DepthwiseConv1d]
    assert route_convolutions(model) == 0  # idempotent
    after = tree_flatten(model.parameters())  # the same parameters, under the same names
    assert [k for k, _ in after] == [k for k, _ in before]
    assert all(a is b for (_, a), (_, b) in zip(after, before, strict=True))


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("taps, bias, padding", [(4, False, 0), (3, True, 0), (4, True, 3)])
@pytest.mark.parametrize("rows, tokens", [(1, 2), (3, 17)])
def test_the_sum_of_taps_is_mlxs_convolution(dtype, taps, bias, padding, rows, tokens):
    conv = depthwise(24, taps, bias, padding)
    conv.update({k: v.astype(dtype) for k, v in conv.parameters().items()})
    x = mx.random.normal((rows, tokens + taps - 1, 24), key=mx.random.key(2)).astype(dtype)
    want = conv(x)
    padded = mx.pad(x, [(0, 0), (padding, padding), (0, 0)])
    got = convolution.depthwise_taps(padded, conv.weight, conv.get("bias"))
    assert got.shape == want.shape and got.dtype == want.dtype
    tol = 1e-6 if dtype == mx.float32 else 1e-2
    assert mx.allclose(got, want, atol=tol, rtol=tol).item()


def test_the_cpu_keeps_mlxs_convolution_bit_for_bit():
    plain = depthwise(16, 4, bias=True)
    routed = depthwise(16, 4, bias=True)
    routed.update(plain.parameters())
    route_convolutions(routed)
    before = dict(conv_counts)
    x = mx.random.normal((2, 9, 16), key=mx.random.key(3))
    assert mx.array_equal(routed(x), plain(x)).item()
    assert conv_counts["conv"] == before.get("conv", 0) + 1
    assert conv_counts["taps"] == before.get("taps", 0)


@pytest.mark.parametrize("family", CONV_FAMILIES)
def test_a_prompt_through_the_taps_gives_mlx_lms_logits(family, monkeypatch):
    """CUDA stood in: a prompt's convolutions take the taps and its decode steps keep
    ``nn.Conv1d``; prefill and decode logits are mlx-lm's on the unchanged model."""
    plain, routed = tiny_model(family), tiny_model(family)
    convs = [m for _, m in routed.named_modules() if isinstance(m, nn.Conv1d)]
    assert convs and route_convolutions(routed) == len(convs)
    monkeypatch.setattr(convolution, "on_cuda", lambda: True)
    prompt = mx.array([[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9]])
    caches = [make_prompt_cache(plain), make_prompt_cache(routed)]
    before = dict(conv_counts)
    want, got = plain(prompt, cache=caches[0]), routed(prompt, cache=caches[1])
    assert conv_counts["taps"] - before.get("taps", 0) == len(convs)
    assert mx.allclose(got, want, atol=1e-4, rtol=1e-4).item()
    token = mx.array([[7]])
    before = dict(conv_counts)
    want, got = plain(token, cache=caches[0]), routed(token, cache=caches[1])
    assert conv_counts["conv"] - before.get("conv", 0) == len(convs)
    assert mx.allclose(got, want, atol=1e-4, rtol=1e-4).item()


def test_the_engine_and_make_paged_cache_route_their_models_convolutions():
    model = tiny_model("qwen3_5")
    convs = [m for _, m in model.named_modules() if isinstance(m, nn.Conv1d)]
    PagedEngine(model, block_size=16)
    assert convs and all(type(m) is DepthwiseConv1d for m in convs)
    model = tiny_model("nemotron_h")
    make_paged_cache(model)
    assert all(type(m) is DepthwiseConv1d for m in model.modules() if isinstance(m, nn.Conv1d))


@cuda_only
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16, mx.float32])
@pytest.mark.parametrize("family", ["qwen3_5", "nemotron_h", "falcon_h1", "mamba"])
def test_on_cuda_a_prompt_through_the_taps_gives_cudnns_logits(family, dtype):
    plain, routed = tiny_model(family), tiny_model(family)
    for model in (plain, routed):
        model.update(tree_map(lambda p: p.astype(dtype), model.parameters()))
    route_convolutions(routed)
    prompt = mx.array([[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9]] * 3)
    before = dict(conv_counts)
    want = plain(prompt, cache=make_prompt_cache(plain)).astype(mx.float32)
    got = routed(prompt, cache=make_prompt_cache(routed)).astype(mx.float32)
    assert conv_counts["taps"] > before.get("taps", 0)
    scale = mx.abs(want).max().item()
    # float32: cuDNN's convolution may round its products to TF32 (run 634: 1.4e-5 of the
    # largest logit on falcon_h1); the taps keep float32.
    tol = 1e-4 if dtype == mx.float32 else 2e-2
    assert mx.abs(got - want).max().item() <= tol * scale
