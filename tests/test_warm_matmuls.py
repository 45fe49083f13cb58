"""The warm-up's matmuls: every linear layer's shape at every row count a forward can give it.

On CUDA each new row count costs a cuBLASLt algorithm search on the request path, so the
warm-up runs them all while starting. These tests run on the CPU with the CUDA check
forced, and record which layers were called with how many rows.
"""

from __future__ import annotations

from types import SimpleNamespace

import mlx.core as mx
import mlx.nn as nn
import pytest
from tiny_models import VOCAB, tiny_model

from mlx_paged import PagedEngine, few_row_matmuls
from mlx_paged.attention.kernels import rows
from mlx_paged.engine import warmup

BS = 8


@pytest.fixture
def calls(monkeypatch) -> list[tuple[str, tuple[int, ...], int]]:
    """(layer type, weight shape, rows) of every linear layer call; CUDA's path forced."""
    seen: list[tuple[str, tuple[int, ...], int]] = []
    for cls in (nn.Linear, nn.QuantizedLinear):
        inner = cls.__call__

        def spy(self, x, inner=inner):
            seen.append((type(self).__name__, tuple(self.weight.shape), x.shape[0]))
            return inner(self, x)

        monkeypatch.setattr(cls, "__call__", spy)
    monkeypatch.setattr(warmup, "on_cuda", lambda: True)
    return seen


def _shapes(model: nn.Module, vocab: int) -> set[tuple[int, ...]]:
    return {
        tuple(m.weight.shape)
        for _, m in model.named_modules()
        if type(m) in (nn.Linear, nn.QuantizedLinear) and m.weight.shape[0] != vocab
    }


@pytest.mark.parametrize("quantized", [False, True])
def test_the_warm_up_runs_each_layer_shape_at_every_row_count(calls, monkeypatch, quantized):
    model = tiny_model("llama", tie_word_embeddings=False)
    if quantized:
        nn.quantize(model, group_size=32, bits=4)
    held: list[int] = []
    monkeypatch.setattr(warmup, "_hold_heuristics", lambda n: held.append(n) or True)
    engine = PagedEngine(
        model, block_size=BS, max_batch_size=2, prefill_step_size=24, prefill_batch_tokens=16
    )
    assert "lm_head" in model, "an untied head, which the warm-up leaves to the decode"
    shapes = _shapes(model, VOCAB)
    assert len(shapes) == 4  # q and o, k and v, gate and up, down
    prebuilt: list[nn.Module] = []
    monkeypatch.setattr(warmup, "prebuild_few_rows", lambda m: prebuilt.append(m) or 0)
    warmup.warm_up(engine)
    assert prebuilt == [model]
    kind = "QuantizedLinear" if quantized else "Linear"
    warmed = {(s, rows) for k, s, rows in calls if k == kind and rows > 0}
    assert warmed >= {(s, rows) for s in shapes for rows in range(1, 25)}
    assert held == [24 * 4 + warmup.HEURISTICS_SPARE]
    engine.check_invariants()
    assert engine.stats().live_blocks == 0


def test_warm_matmuls_counts_and_leaves_out_the_head_and_sharded_layers(calls, monkeypatch):
    class Sharded(nn.Linear):  # as mlx-lm's sharded layers subclass nn.Linear
        pass

    model = nn.Module()
    model.a = nn.Linear(8, 16)
    model.b = nn.Linear(8, 16)  # the same shape: run once
    model.c = nn.Linear(16, 8, bias=False)
    model.head = nn.Linear(8, 40)
    model.peer = Sharded(8, 16)
    mx.eval(model.parameters())
    monkeypatch.setattr(warmup, "_hold_heuristics", lambda n: True)
    limits, set_limit = [], mx.set_cache_limit
    monkeypatch.setattr(mx, "set_cache_limit", lambda n: limits.append(n) or set_limit(n))
    before = set_limit(123_456_789)
    scheduler = SimpleNamespace(prefill_step_size=5, prefill_batch_tokens=3)
    assert warmup.warm_matmuls(model, scheduler, 40) == 5 * 2
    assert limits == [warmup.WARM_CACHE_BYTES, 123_456_789], "the buffer cache's limit restored"
    set_limit(before)
    assert sorted({(shape, rows) for _, shape, rows in calls}) == sorted(
        {((16, 8), r) for r in range(1, 6)} | {((8, 16), r) for r in range(1, 6)}
    )
    assert not any(kind == "Sharded" for kind, _, _ in calls)
    calls.clear()
    monkeypatch.setattr(warmup, "WARM_ROWS", 4)
    assert warmup.warm_matmuls(model, scheduler, 40) == 4 * 2, "rows up to WARM_ROWS only"
    assert max(rows for _, _, rows in calls) == 4


def test_warm_matmuls_runs_nothing_off_cuda(monkeypatch):
    model = tiny_model("llama")
    scheduler = SimpleNamespace(prefill_step_size=8, prefill_batch_tokens=8)
    assert warmup.warm_matmuls(model, scheduler, VOCAB) == 0
    if not mx.cuda.is_available():  # no cuBLASLt in this process: nothing to resize
        assert warmup._hold_heuristics(1) is False


def test_layers_routed_through_the_few_row_kernel_are_warmed_too(calls, monkeypatch):
    monkeypatch.setattr(rows, "available", lambda: True)
    monkeypatch.setattr(rows, "few_rows_matmul", lambda x, w: x @ w.T)
    monkeypatch.setattr(warmup, "_hold_heuristics", lambda n: True)
    model = nn.Module()
    model.a = nn.Linear(64, 32)
    model.set_dtype(mx.float16)
    assert few_row_matmuls(model) == 1
    most = rows.MAX_ROWS + 4
    scheduler = SimpleNamespace(prefill_step_size=most, prefill_batch_tokens=3)
    assert warmup.warm_matmuls(model, scheduler, None) == most
    # rows the kernel takes do not reach nn.Linear's call; the rest (cuBLAS's) are warmed there
    warmed = sorted(r for kind, _, r in calls if kind == "FewRowsLinear")
    assert warmed == [1, *range(rows.MAX_ROWS + 1, most + 1)]


def test_the_few_row_kernel_is_prebuilt_for_each_routed_dtype(monkeypatch):
    monkeypatch.setattr(rows, "available", lambda: True)
    monkeypatch.setattr(rows, "few_rows_matmul", lambda x, w: x @ w.T)
    model = nn.Module()
    model.a, model.b, model.c = nn.Linear(64, 32), nn.Linear(64, 32), nn.Linear(64, 32)
    model.a.set_dtype(mx.float16)
    model.b.set_dtype(mx.bfloat16)  # model.c stays float32: not routed
    assert few_row_matmuls(model) == 2
    asked: list[list] = []
    monkeypatch.setattr(rows, "prebuild", lambda dtypes: asked.append(dtypes) or 12 * len(dtypes))
    assert warmup.prebuild_few_rows(model) == 24
    assert asked == [[mx.bfloat16, mx.float16]]
    assert warmup.prebuild_few_rows(tiny_model("llama")) == 0, "float32: nothing routed"
    assert asked[-1] == []
