"""``few_row_matmuls``: which layers take few rows in the kernel, and when; the kernel itself
against a float32 matmul on a CUDA GPU."""

from __future__ import annotations

import logging

import mlx.core as mx
import mlx.nn as nn
import pytest
from test_kernels import cuda_only
from tiny_models import tiny_model

from mlx_paged import PagedEngine, few_row_matmuls, fuse_projections
from mlx_paged.attention.kernels import cubin, rows
from mlx_paged.engine import linears
from mlx_paged.engine.linears import FewRowsEmbedding, FewRowsLinear

LAYERS = 4  # tiny_model's llama: 7 linear layers a layer, and a tied head


def half_llama() -> nn.Module:
    model = tiny_model("llama")
    model.set_dtype(mx.float16)
    return model


@pytest.fixture
def kernel(monkeypatch):
    """A CUDA GPU as far as the routing knows, and a kernel that records each call's rows
    and computes what the layer's own matmul does (``wrong``: one value off)."""
    calls: list[int] = []
    state = {"wrong": False}

    def fake(x, w):
        assert rows.rows_reason(x, w) is None
        calls.append(x.size // x.shape[-1])
        out = x @ w.T
        return out + 1 if state["wrong"] else out

    monkeypatch.setattr(rows, "available", lambda: True)
    monkeypatch.setattr(rows, "few_rows_matmul", fake)
    return calls, state


def forward(model: nn.Module, tokens: mx.array) -> mx.array:
    return model(tokens).astype(mx.float32)


def test_nothing_changes_without_a_cuda_gpu():
    model = half_llama()
    assert few_row_matmuls(model) == 0
    assert not any(
        isinstance(m, (FewRowsLinear, FewRowsEmbedding)) for _, m in model.named_modules()
    )


def test_every_half_linear_layer_and_the_tied_head_is_routed(kernel):
    calls, _ = kernel
    model = half_llama()
    assert few_row_matmuls(model) == 7 * LAYERS + 1
    assert sorted(calls) == sorted(list(linears.CHECK_ROWS) * 5)  # five weight shapes checked
    layer = model.model.layers[0]
    assert type(layer.self_attn.q_proj) is FewRowsLinear
    assert type(layer.mlp.down_proj) is FewRowsLinear
    assert type(model.model.embed_tokens) is FewRowsEmbedding


@pytest.mark.parametrize("batch, length, expected", [(4, 1, 4), (2, 3, 6), (1, 1, None)])
def test_the_kernel_takes_two_to_max_rows_with_the_layers_values(kernel, batch, length, expected):
    calls, _ = kernel
    model = half_llama()
    tokens = mx.array([[(7 * b + t) % 100 for t in range(length)] for b in range(batch)])
    want = forward(model, tokens)
    few_row_matmuls(model)
    calls.clear()
    got = forward(model, tokens)
    assert calls == ([] if expected is None else [expected] * (7 * LAYERS + 1))
    assert mx.array_equal(got, want).item()


def test_more_rows_than_the_kernel_takes_go_to_the_layers_own_matmul(kernel):
    calls, _ = kernel
    model = half_llama()
    few_row_matmuls(model)
    calls.clear()
    forward(model, mx.zeros((1, rows.MAX_ROWS + 1), dtype=mx.int32))
    assert calls == []
    forward(model, mx.zeros((1, rows.MAX_ROWS), dtype=mx.int32))
    assert calls == [rows.MAX_ROWS] * (7 * LAYERS + 1)


def test_biases_are_added_and_fused_layers_are_routed(kernel):
    calls, _ = kernel
    model = half_llama()
    fuse_projections(model)
    layer = model.model.layers[0].self_attn.o_proj
    layer.bias = mx.arange(layer.weight.shape[0], dtype=mx.float16)
    tokens = mx.array([[3], [9], [27]])
    want = forward(model, tokens)
    assert few_row_matmuls(model) == 4 * LAYERS + 1  # fused q|k|v and gate|up, o, down
    assert type(model.model.layers[0].self_attn.fused_qkv) is FewRowsLinear
    # addmm rounds once where the routed layer rounds its product, then adds: float16's step
    assert mx.allclose(forward(model, tokens), want, atol=3e-2, rtol=1e-2).item()


def test_float32_quantized_and_ragged_layers_are_left_as_they_are(kernel):
    model = tiny_model("llama")  # float32
    assert few_row_matmuls(model) == 0
    model = half_llama()
    nn.quantize(
        model, group_size=32, bits=8, class_predicate=lambda p, m: p.endswith("mlp.up_proj")
    )
    odd = nn.Linear(48, 16)  # K = 48: not a multiple of 32
    odd.set_dtype(mx.float16)
    model.model.layers[0].mlp.extra = odd
    assert few_row_matmuls(model) == 6 * LAYERS + 1
    assert type(model.model.layers[1].mlp.up_proj) is nn.QuantizedLinear
    assert type(odd) is nn.Linear


def test_a_shape_whose_check_fails_keeps_mlxs_matmul(kernel, caplog):
    _, state = kernel
    state["wrong"] = True
    model = half_llama()
    with caplog.at_level(logging.WARNING, logger="mlx_paged.engine"):
        assert few_row_matmuls(model) == 0
    assert "few-row kernel differs from a matmul" in caplog.text
    assert type(model.model.layers[0].self_attn.q_proj) is nn.Linear


def test_bad_inputs_are_value_errors():
    with pytest.raises(ValueError, match="takes an mlx.nn.Module"):
        few_row_matmuls("a model")
    w = mx.zeros((16, 64), dtype=mx.float16)
    cases = [
        (mx.zeros((2, 64), dtype=mx.float32), w, "both float16 or both bfloat16"),
        (mx.zeros((2, 32), dtype=mx.float16), w, "K must match"),
        (
            mx.zeros((2, 48), dtype=mx.float16),
            mx.zeros((16, 48), dtype=mx.float16),
            "multiple of 32",
        ),
        (mx.zeros((rows.MAX_ROWS + 1, 64), dtype=mx.float16), w, f"1 to {rows.MAX_ROWS} rows"),
        (mx.zeros((7, 7, 64), dtype=mx.float16), w, f"1 to {rows.MAX_ROWS} rows"),
        (mx.zeros((64,), dtype=mx.float16), w, "2 or more dimensions"),
        (mx.zeros((2, 64), dtype=mx.float16), w[None], "2 or more dimensions and w 2"),
        (mx.zeros((2, 0), dtype=mx.float16), w[:, :0], "positive multiple of 32"),
    ]
    for x, weight, message in cases:
        with pytest.raises(ValueError, match=message):
            rows.few_rows_matmul(x, weight)
    x = mx.zeros((rows.KERNEL_ROWS, 64), dtype=mx.float16)
    for tiling, message in [
        ((2, 6, 1), "a power of two"),
        ((2, 32, 1), "a power of two"),
        ((4, 16, 1), "too many registers for 16 warps"),
        ((0, 8, 1), "1-16 column tiles"),
        ((2, 8, 5), "1-4 K chunks"),
        ((2, 8), "three ints"),
        ((2.0, 8, 1), "three ints"),
    ]:
        with pytest.raises(ValueError, match=message):
            rows.few_rows_matmul(x, w, tiling)
    assert rows.rows_reason(x, w, (4, 8, 1)) is None  # a named tiling may take 64 rows
    assert rows.rows_reason(x, w, (2, 16, 1)) is None  # 16 warps, 72 registers
    too_many = mx.zeros((rows.KERNEL_ROWS + 1, 64), dtype=mx.float16)
    with pytest.raises(ValueError, match=f"1 to {rows.KERNEL_ROWS} rows"):
        rows.few_rows_matmul(too_many, w, (4, 8, 1))


def test_the_kernel_reads_both_shapes_and_takes_its_tiles_as_constants():
    body = rows.sections("few_rows.kernel")
    src, shaped = cubin.render(
        "k",
        body["header"],
        body["matmul"],
        ["x", "w"],
        [mx.float16, mx.float16],
        [3, 2],
        ["out"],
        [mx.float16],
        [("T", mx.float16), ("BF16", False), ("XD", 3), ("MT", 3), ("NT", 2), ("WARPS", 8)]
        + [("U", 2)],
    )
    assert shaped == [0, 1]
    signature = " ".join(src.split())
    shapes = "int x_shape_0, int x_shape_1, int x_shape_2, int w_shape_0, int w_shape_1)"
    assert f"__half* out, {shapes}" in signature
    assert "constexpr int MT = 3;" in src and "constexpr bool BF16 = false;" in src


def test_each_row_tile_count_takes_a_narrow_or_a_wide_tiling():
    assert rows.tiling_for(2, 2048) == (2, 16, 1) and rows.tiling_for(16, 49152) == (2, 8, 2)
    assert rows.tiling_for(17, rows.NARROW) == (4, 8, 2)
    assert rows.tiling_for(32, rows.NARROW + 1) == (8, 4, 1)
    assert rows.tiling_for(rows.MAX_ROWS, 3072) == (4, 8, 1)
    assert rows.tiling_for(33, 16384) == (4, 4, 1)
    for tiles, pair in rows.TILINGS.items():
        for tiling in pair:  # each launches with its block's registers (tiling_reason)
            assert rows.tiling_reason(tiling, 16 * tiles) is None, (tiles, tiling)


def test_prebuild_builds_exactly_the_binaries_the_calls_launch(monkeypatch):
    """Every template a call of 1 to MAX_ROWS rows launches, for 2- and 3-dimensional x of
    narrow and wide weights, is one ``prebuild`` builds, and it builds no other."""
    launched, built = set(), []

    def key(inputs, template, output_dtypes):
        return (
            tuple(template),
            *(x.dtype for x in inputs),
            *(x.ndim for x in inputs),
            *output_dtypes,
        )

    class Recorder:
        def __call__(self, *, inputs, template, output_shapes, output_dtypes, **_):
            launched.add(key(inputs, template, output_dtypes))
            return [mx.zeros(output_shapes[0], output_dtypes[0])]

        def build(self, inputs, template, output_dtypes, scalars=()):
            built.append(key(inputs, template, output_dtypes))
            return True

    monkeypatch.setattr(rows, "_kernel", Recorder)
    for dtype in rows.DTYPES:
        for n in (8, rows.NARROW, rows.NARROW + 8):
            w = mx.zeros((n, 64), dtype)
            for m in range(1, rows.MAX_ROWS + 1):
                rows.few_rows_matmul(mx.zeros((m, 64), dtype), w)
                rows.few_rows_matmul(mx.zeros((1, m, 64), dtype), w)
    assert rows.prebuild(rows.DTYPES) == 0, "no CUDA GPU: nothing built"
    assert built == []
    monkeypatch.setattr(rows, "available", lambda: True)
    assert rows.prebuild(rows.DTYPES) == len(rows.DTYPES) * 2 * 2 * len(rows.TILINGS) == 24
    assert len(set(built)) == len(built) == 24
    assert set(built) == launched


def test_prebuild_refuses_what_the_kernel_does_not_take():
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        rows.prebuild([mx.float32])
    with pytest.raises(ValueError, match="2 or more dimensions"):
        rows.prebuild([mx.float16], ndims=[1])
    with pytest.raises(ValueError, match="2 or more dimensions"):
        rows.prebuild([mx.float16], ndims=[True])


# ---- on a CUDA GPU


@cuda_only
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
@pytest.mark.parametrize(
    "n, k", [(40, 64), (3072, 2048), (100, 8192), (5000, 256), (9000, 160), (9000, 192)]
)
def test_the_kernel_matches_a_float32_matmul(dtype, n, k):
    # Ragged column blocks, K of a few chunks: (9000, 192) is a shape a tiling tried for
    # 64 rows got wrong in its last block (BENCHMARKS.md, runs 498-505).
    mx.random.seed(1)
    w = (mx.random.normal((n, k)) * 0.05).astype(dtype)
    for m in (1, 2, 15, 16, 17, 31, 32, 33, 47, 48):
        x = mx.random.normal((m, k)).astype(dtype)
        want = x.astype(mx.float32) @ w.astype(mx.float32).T
        got = rows.few_rows_matmul(x, w).astype(mx.float32)
        err = (mx.abs(got - want).max() / mx.abs(want).max()).item()
        assert err <= linears.TOLERANCE[dtype], (m, n, k, err)


@cuda_only
@pytest.mark.parametrize(
    "tiling", [(1, 1, 1), (2, 8, 2), (4, 8, 1), (8, 4, 1), (16, 8, 1), (1, 16, 1)]
)
def test_a_named_tiling_matches_a_float32_matmul_up_to_the_kernels_rows(tiling):
    mx.random.seed(3)
    w = (mx.random.normal((5000, 256)) * 0.05).astype(mx.float16)
    for m in (1, 33, 49, rows.KERNEL_ROWS):
        x = mx.random.normal((m, 256)).astype(mx.float16)
        want = x.astype(mx.float32) @ w.astype(mx.float32).T
        got = rows.few_rows_matmul(x, w, tiling).astype(mx.float32)
        err = (mx.abs(got - want).max() / mx.abs(want).max()).item()
        assert err <= linears.TOLERANCE[mx.float16], (m, tiling, err)


@cuda_only
def test_the_kernel_takes_rows_in_every_leading_dimension():
    mx.random.seed(2)
    w = (mx.random.normal((3072, 2048)) * 0.05).astype(mx.float16)
    for lead in [(4, 1), (2, 3), (3, 2, 5)]:
        x = mx.random.normal((*lead, 2048)).astype(mx.float16)
        got = rows.few_rows_matmul(x, w)
        assert got.shape == (*lead, 3072)
        flat = rows.few_rows_matmul(x.reshape(-1, 2048), w)
        assert mx.array_equal(got.reshape(-1, 3072), flat).item(), lead


@cuda_only
def test_a_routed_model_gives_mlxs_logits_and_an_engine_on_it_the_same_tokens():
    # The float16 engine is checked against mlx-lm's dense caches elsewhere; here the routed
    # model against the model as loaded. (mlx-lm's own float16 single-sequence decode left
    # this engine at a near tie of prompt 0, where the float32 model agreed with the engine.)
    prompts = [[5 + i, 17, 3, 99, 42, 8, 61][: 3 + i] for i in range(4)]
    tokens = mx.array([[p[-1]] for p in prompts])
    model = half_llama()
    want = forward(model, tokens)
    as_loaded = PagedEngine(model, max_batch_size=4).generate(prompts, max_tokens=8)
    routed = half_llama()
    assert few_row_matmuls(routed) == 7 * LAYERS + 1
    assert mx.allclose(forward(routed, tokens), want, atol=5e-2, rtol=1e-2).item()
    assert PagedEngine(routed, max_batch_size=4).generate(prompts, max_tokens=8) == as_loaded
