"""A prompt's matmuls over a few row counts (``bucket_matmul_rows``), with CUDA stood in.

On a CUDA GPU, linear layers pad a prompt's rows to ``row_bucket`` counts so cuBLAS
plans few of them. Here the CPU stands in for CUDA: the padded call must give the
values the layer gives unpadded, decode steps must not pad, and the engine's tokens
must equal mlx-lm's own caches'.
"""

from __future__ import annotations

import logging
import random
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from hypothesis import given
from hypothesis import strategies as st
from tiny_models import VOCAB, solo, tiny_model

from mlx_paged import PagedEngine, bucket_matmul_rows, fuse_projections
from mlx_paged.engine import row_buckets
from mlx_paged.engine.linears import FewRowsLinear
from mlx_paged.engine.row_buckets import MIN_ROWS, bucket_counts, row_bucket, warm_row_buckets


@pytest.fixture
def cuda(monkeypatch):
    """CUDA stood in for ``bucket_matmul_rows``' check."""
    monkeypatch.setattr(row_buckets, "on_cuda", lambda: True)


@given(st.integers(1, 1 << 16))
def test_row_buckets_pad_by_at_most_a_quarter(rows):
    padded = row_bucket(rows)
    if rows <= MIN_ROWS:
        assert padded == rows
        return
    assert rows <= padded < 1.25 * rows + 1
    assert row_bucket(padded) == padded
    # Four counts an octave: the octave of ``rows`` holds four buckets.
    low = 1 << (rows.bit_length() - 1)
    assert len({row_bucket(n) for n in range(low + 1, 2 * low + 1)}) == 4


def test_the_buckets_from_64_up():
    assert [row_bucket(n) for n in (64, 65, 80, 81, 100, 128, 129, 1500, 2048)] == [
        64,
        80,
        80,
        96,
        112,
        128,
        160,
        1536,
        2048,
    ]


def test_nothing_changes_off_cuda():
    model = tiny_model("llama")
    before = [type(m) for _, m in model.named_modules()]
    assert nn.Linear in before
    assert bucket_matmul_rows(model) == 0
    assert [type(m) for _, m in model.named_modules()] == before
    with pytest.raises(ValueError, match="mlx.nn.Module"):
        bucket_matmul_rows(object())


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_a_prompts_rows_padded_give_the_same_values(family, cuda, monkeypatch):
    model = tiny_model(family)  # its own: the class swap must not reach other tests
    x = mx.random.randint(0, VOCAB, (3, 37), key=mx.random.key(1))  # 111 rows: 112
    want = model(x)
    linears = sum(type(m) is nn.Linear for _, m in model.named_modules())
    assert bucket_matmul_rows(model) == linears > 0
    assert bucket_matmul_rows(model) == 0  # idempotent
    pads = []
    real_pad = row_buckets.mx.pad
    monkeypatch.setattr(
        row_buckets.mx, "pad", lambda *a, **k: pads.append(a[0].shape) or real_pad(*a, **k)
    )
    got = model(x)
    assert mx.allclose(got, want, rtol=1e-5, atol=1e-5).item()
    assert pads and all(shape[0] == 111 for shape in pads)
    pads.clear()
    model(x[:, :1])  # one token a row: a decode step's shape, never padded
    model(x[:1, :50])  # 50 rows: at most MIN_ROWS
    assert pads == []


def test_few_row_layers_are_bucketed_too(cuda):
    layer = nn.Linear(32, 16)
    layer.__class__ = FewRowsLinear  # as few_row_matmuls leaves a layer
    model = nn.Sequential(layer)
    x = mx.random.normal((2, 45, 32))  # 90 rows: 96
    want = nn.Linear.__call__(layer, x)
    assert bucket_matmul_rows(model) == 1
    assert type(layer).__name__ == "RowBucketFewRowsLinear"
    assert isinstance(layer, FewRowsLinear)
    assert mx.allclose(layer(x), want, rtol=1e-5, atol=1e-6).item()


@pytest.mark.parametrize("family, fused", [("llama", False), ("llama", True), ("qwen3_5", False)])
def test_the_engine_with_buckets_generates_what_mlx_lm_does(family, fused, cuda):
    rng = random.Random(3)
    system = [rng.randrange(VOCAB) for _ in range(40)]
    prompts = [system + [rng.randrange(VOCAB) for _ in range(n)] for n in (30, 35, 41)]
    model = tiny_model(family)  # its own: the class swap must not reach other tests
    if fused:  # as the server runs them: the fused q/k/v and gate/up layers are bucketed
        assert fuse_projections(model) > 0
    assert bucket_matmul_rows(model) > 0
    engine = PagedEngine(model, block_size=8, max_batch_size=4)
    uids = [engine.add_request(p, 6) for p in prompts]
    out = {u: [] for u in uids}
    while engine.waiting or engine.running:
        for e in engine.step():
            out[e.uid].append(e.token)
    assert [out[u] for u in uids] == [solo(family, tuple(p), 6) for p in prompts]


@pytest.mark.parametrize("flag, bucketed", [([], False), (["--matmul-row-buckets"], True)])
def test_the_servers_flag(flag, bucketed, cuda, tmp_path, caplog):
    from tiny_models import save_tiny_model

    from mlx_paged.embedded import embedded_model_path
    from mlx_paged.server import build_parser
    from mlx_paged.server.transforms import load_transformed

    tokenizer = Path(embedded_model_path(progress=False))
    path = save_tiny_model("llama", tmp_path / "llama", tokenizer, vocab_size=49152)
    args = build_parser().parse_args(["--model", str(path), *flag])
    assert args.matmul_row_buckets is bucketed
    with caplog.at_level(logging.INFO, logger="mlx_paged.server"):
        model, _ = load_transformed(args, warm=True)
    names = {type(m).__name__ for _, m in model.named_modules()}
    assert ("RowBucketLinear" in names) is bucketed
    assert ("row-bucket matmuls" in caplog.text) is bucketed


def test_the_warm_up_plans_every_bucket_of_each_weight_shape_once(cuda, monkeypatch):
    assert bucket_counts(200) == [80, 96, 112, 128, 160, 192, 224]
    assert {row_bucket(n) for n in range(MIN_ROWS + 1, 201)} == set(bucket_counts(200))
    assert bucket_counts(MIN_ROWS) == []
    model = tiny_model("llama")
    assert bucket_matmul_rows(model) > 0
    shapes = {
        (m.weight.shape, "bias" in m)
        for _, m in model.named_modules()
        if hasattr(m, "weight") and type(m).__name__.startswith("RowBucket")
    }
    calls = []
    real = row_buckets.mx.eval
    monkeypatch.setattr(row_buckets.mx, "eval", lambda *a: calls.append(a[0].shape) or real(*a))
    assert warm_row_buckets(model, 200) == len(shapes) * 7 == len(calls)
    assert sorted({s[0] for s in calls}) == bucket_counts(200)
