"""Residual sums made with the norms after them (``fuse_add_norms``): which models change, the
carried norm, the checks that keep a wrong kernel out, and the engine's tokens against
mlx-lm's dense cache. On the CPU a stand-in does what the CUDA kernel does with MLX ops; the
kernel itself runs against MLX's sum and ``mx.fast.rms_norm`` on the GPU."""

from __future__ import annotations

import logging

import mlx.core as mx
import mlx.nn as nn
import pytest
from test_engine import mixed_prompts, run_all, solo
from test_rope_kernel import cuda_only
from tiny_models import tiny_model

from mlx_paged import PagedEngine, fuse_add_norms
from mlx_paged.attention.kernels import add_norm
from mlx_paged.engine.norms import CarriedRMSNorm

LAYERS = 4  # tiny_model's layers
MAX_TOKENS = 8


@pytest.fixture
def kernel(monkeypatch):
    """A CUDA GPU as far as ``fuse_add_norms`` knows, and a kernel that records each call's
    shape and computes MLX's sum and norm (``wrong``: the sum or the norm one off)."""
    calls: list[tuple[int, ...]] = []
    state = {"wrong": None}

    def fake(a, b, weight, eps):
        assert add_norm.norm_reason(a, b, weight) is None
        calls.append(a.shape)
        total = a + b
        normed = mx.fast.rms_norm(total, weight, eps)
        if state["wrong"] == "sum":
            return total + 1, normed
        return total, normed + 1 if state["wrong"] == "norm" else normed

    monkeypatch.setattr(add_norm, "available", lambda: True)
    monkeypatch.setattr(add_norm, "add_rms_norm", fake)
    return calls, state


@pytest.fixture
def own_norms(monkeypatch):
    """The modules whose norms ``nn.RMSNorm`` computes itself, one entry a call."""
    seen: list[nn.Module] = []
    original = nn.RMSNorm.__call__

    def counted(self, x):
        seen.append(self)
        return original(self, x)

    monkeypatch.setattr(nn.RMSNorm, "__call__", counted)
    return seen


def layer_norms(model: nn.Module) -> list[nn.Module]:
    """The norms around the layers' sums (not the attention's own, as qwen3's q/k norms)."""
    inner = model.model
    names = ("input_layernorm", "post_attention_layernorm")
    return [layer[n] for layer in inner.layers for n in names] + [inner.norm]


def test_nothing_changes_without_a_cuda_gpu():
    model = tiny_model("llama")
    assert fuse_add_norms(model) == 0
    assert not any(isinstance(m, CarriedRMSNorm) for _, m in model.named_modules())
    assert type(model.model.layers[0]).__module__ == "mlx_lm.models.llama"


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen3_moe"])
def test_each_layer_makes_both_sums_with_their_norms_and_the_values_stay(kernel, own_norms, family):
    calls, _ = kernel
    model = tiny_model(family)
    tokens = mx.array([[3, 1, 4, 1, 5], [9, 2, 6, 5, 3]])
    want = model(tokens)
    assert fuse_add_norms(model) == LAYERS
    assert fuse_add_norms(model) == 0  # once
    calls.clear()
    own_norms.clear()
    got = model(tokens)
    assert mx.array_equal(got, want).item()
    assert calls == [(2, 5, model.args.hidden_size)] * (2 * LAYERS)
    # Only the first layer's input norm is computed by itself: every other norm came with
    # the sum before it (the carried norm, and the last one too).
    computed = [n for n in own_norms if any(n is m for m in layer_norms(model))]
    assert len(computed) == 1 and computed[0] is model.model.layers[0].input_layernorm
    inner = model.model
    assert all(type(layer.input_layernorm) is CarriedRMSNorm for layer in inner.layers[1:])
    assert type(inner.layers[0].input_layernorm) is nn.RMSNorm
    assert type(inner.norm) is CarriedRMSNorm
    # The layers keep their parameters (a model loaded later into them still fits).
    assert sorted(k for k, _ in nn.utils.tree_flatten(model.parameters())) == sorted(
        k for k, _ in nn.utils.tree_flatten(tiny_model(family).parameters())
    )


def test_a_carried_norm_called_with_another_array_normalizes_it(kernel, own_norms):
    model = tiny_model("llama")
    fuse_add_norms(model)
    model(mx.array([[1, 2, 3]]))
    norm = model.model.layers[2].input_layernorm
    x = mx.random.normal((1, 3, model.args.hidden_size), key=mx.random.key(3))
    own_norms.clear()
    assert mx.allclose(norm(x), mx.fast.rms_norm(x, norm.weight, norm.eps)).item()
    assert len(own_norms) == 1 and own_norms[0] is norm
    assert norm.carry.sum is None and norm.carry.normed is None  # nothing held after a take


@pytest.mark.parametrize("wrong", ["sum", "norm"])
def test_a_kernel_that_differs_from_mlx_is_kept_out(kernel, wrong, caplog):
    _, state = kernel
    state["wrong"] = wrong
    model = tiny_model("llama")
    with caplog.at_level(logging.WARNING, logger="mlx_paged.engine"):
        assert fuse_add_norms(model) == 0
    assert "differs from MLX" in caplog.text
    assert not any(isinstance(m, CarriedRMSNorm) for _, m in model.named_modules())


@pytest.mark.parametrize("family", ["gemma3_text", "qwen3_next"])
def test_models_of_other_layers_are_left_as_they_are(kernel, family):
    model = tiny_model(family)
    assert fuse_add_norms(model) == 0
    assert not any(isinstance(m, CarriedRMSNorm) for _, m in model.named_modules())


def test_a_model_that_is_not_a_module_is_refused():
    with pytest.raises(ValueError, match="mlx.nn.Module"):
        fuse_add_norms("llama")


@pytest.mark.parametrize("compiled", [True, False])
def test_engine_tokens_with_sums_and_norms_together_match_solo_dense(kernel, compiled):
    calls, _ = kernel
    model = tiny_model("llama")
    assert fuse_add_norms(model) == LAYERS
    prompts = mixed_prompts(seed=5)
    calls.clear()
    engine = PagedEngine(model, block_size=8, max_batch_size=4, compile_decode=compiled)
    got = run_all(engine, prompts, max_tokens=MAX_TOKENS)
    assert got == [solo("llama", tuple(p), MAX_TOKENS) for p in prompts]
    assert any(shape[1] == 1 for shape in calls)  # decode steps took it
    assert any(shape[1] > 1 for shape in calls)  # and prefills


@pytest.mark.parametrize(
    "a, b, weight, reason",
    [
        ((2, 64), (2, 64), (64,), None),
        ((2, 64), (2, 64), (32,), "one shape ending in the weight's"),
        ((2, 64), (3, 64), (64,), "one shape ending in the weight's"),
        ((2, 60), (2, 60), (60,), "multiple of 8"),
        ((0, 64), (0, 64), (64,), "no rows"),
    ],
)
def test_arrays_the_kernel_cannot_take_are_named(a, b, weight, reason):
    arrays = [mx.zeros(s, dtype=mx.float16) for s in (a, b, weight)]
    got = add_norm.norm_reason(*arrays)
    assert got is None if reason is None else reason in got
    if reason is not None:
        with pytest.raises(ValueError, match="add_rms_norm"):
            add_norm.add_rms_norm(*arrays, 1e-5)


def test_mixed_dtypes_are_named():
    a = mx.zeros((2, 64), dtype=mx.float16)
    reason = add_norm.norm_reason(a, a.astype(mx.float32), mx.zeros((64,), dtype=mx.float16))
    assert reason is not None and "share one of" in reason


@cuda_only
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
@pytest.mark.parametrize("width", [576, 2048, 5120, 8192])
@pytest.mark.parametrize("rows", [1, 3, 48, 300])
def test_the_cuda_kernel_makes_mlxs_sum_and_norm(dtype, width, rows):
    keys = mx.random.split(mx.random.key(width + rows), 3)
    a = (mx.random.normal((rows, width), key=keys[0]) * 3).astype(dtype)
    b = mx.random.normal((rows, width), key=keys[1]).astype(dtype)
    weight = (1 + 0.1 * mx.random.normal((width,), key=keys[2])).astype(dtype)
    total, normed = add_norm.add_rms_norm(a, b, weight, 1e-5)
    want = mx.fast.rms_norm(a + b, weight, 1e-5)
    assert mx.array_equal(total, a + b).item()
    diff = mx.abs(normed.astype(mx.float32) - want.astype(mx.float32))
    tolerance = {mx.float32: 1e-5, mx.float16: 2e-3, mx.bfloat16: 1.6e-2}[dtype]
    assert diff.max().item() <= tolerance * mx.abs(want).max().item()
    if dtype != mx.float32:  # the sum of squares' order moves float32 values by an ulp
        assert (diff == 0).mean().item() > 0.9  # almost every rounded value is MLX's


@cuda_only
def test_engine_tokens_with_the_cuda_kernel_match_the_model_as_loaded():
    prompts = [list(range(1 + s, 60 + 9 * s)) for s in range(3)]
    results = []
    for fused in (False, True):  # float32: greedy tokens do not drift apart
        model = tiny_model("llama", head_dim=64)
        if fused:
            assert fuse_add_norms(model) == LAYERS
        engine = PagedEngine(model, block_size=8, max_batch_size=3)
        results.append(run_all(engine, prompts, max_tokens=12))
    assert results[0] == results[1]
