"""Prefill attention in plain MLX ops (``attention.prefill``): the same numbers as MLX's SDPA,
and the calls that take it.

On the CPU the router never chooses it (``on_cuda`` is false), so the tests that run
models through it force the choice: the ops are portable, only the choice is CUDA's.
"""

from __future__ import annotations

import random

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache
from test_engine import run_all, solo
from test_parity import BLOCK, max_diff, prompt_tokens, run_generate_step
from tiny_models import VOCAB, model_of, tiny_model

from mlx_paged import PagedEngine, make_paged_cache
from mlx_paged.attention import path_counts, prefill
from mlx_paged.attention.prefill import MAX_SCORES, attention_by_ops, use_ops


def rand(*shape: int, seed: int) -> mx.array:
    return mx.random.normal(shape, key=mx.random.key(seed))


def masks(b: int, n: int, t: int) -> dict[str, object]:
    """Every mask form mlx-lm and the paged caches hand to attention, for ``n`` queries
    ending at key ``t``."""
    q = mx.arange(t - n, t)[:, None]
    k = mx.arange(t)[None]
    padded = (k <= q) & (k < t - 2)  # the last queries are padding: they see real keys only
    per_row = mx.stack([k <= q, (k <= q) & (k > q - 5)])[:, None]  # (2, 1, n, t): a window
    return {
        "none": None,
        "causal": "causal",
        "bool": padded,
        "per_row": per_row if b == 2 else padded[None, None],
        "additive": mx.where(k <= q, 0.0, -1e9)[None, None],
    }


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2)])
@pytest.mark.parametrize("mask", ["none", "causal", "bool", "per_row", "additive"])
def test_the_ops_match_mlx_attention(heads, kv_heads, mask):
    b, n, t, d = 2, 5, 13, 16
    q, k, v = (
        rand(b, heads, n, d, seed=1),
        rand(b, kv_heads, t, d, seed=2),
        rand(b, kv_heads, t, d, seed=3),
    )
    m = masks(b, n, t)[mask]
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask=m)
    got = attention_by_ops(q, k, v, 0.25, m)
    assert got.shape == want.shape == (b, heads, n, d)
    assert max_diff(got, want) < 1e-5


def test_an_unknown_mask_string_is_refused():
    q = rand(1, 2, 3, 8, seed=1)
    with pytest.raises(ValueError, match="unknown attention mask"):
        attention_by_ops(q, q, q, 1.0, "sliding")


def test_only_small_cuda_prefills_take_the_ops(monkeypatch):
    q, k = mx.zeros((2, 8, 16, 4)), mx.zeros((2, 2, 64, 4))
    assert not use_ops(q, k, None)  # this machine's default device is not a CUDA GPU
    monkeypatch.setattr(prefill, "on_cuda", lambda: True)
    assert use_ops(q, k, None)
    assert not use_ops(q[:, :, :1], k, None)  # decode: MLX's vector kernel builds nothing
    assert not use_ops(q, k, mx.zeros((8,)))  # sinks: MLX's SDPA
    big = MAX_SCORES // (2 * 8 * 16) + 1  # keys that put the scores past the limit
    assert use_ops(q, mx.zeros((2, 2, big - 1, 4)), None)
    assert not use_ops(q, mx.zeros((2, 2, big, 4)), None)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_a_paged_cache_through_the_ops_matches_dense(family, monkeypatch):
    monkeypatch.setattr(prefill, "on_cuda", lambda: True)
    model = tiny_model(family)
    prompt = prompt_tokens(45)
    dense_tokens, dense = run_generate_step(model, prompt, make_prompt_cache(model))
    before = path_counts["prefill_ops"]
    tokens, paged = run_generate_step(model, prompt, make_paged_cache(model, BLOCK))
    assert tokens == dense_tokens
    assert max_diff(dense, paged) < 1e-4
    assert path_counts["prefill_ops"] > before


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_batched_ragged_suffixes_through_the_ops_match_solo(family, monkeypatch):
    """Suffixes of different lengths over a cached prefix share a padded forward whose
    attention runs in the ops, and each request still generates what it would alone."""
    monkeypatch.setattr(prefill, "on_cuda", lambda: True)
    rng = random.Random(5)
    system = [rng.randrange(VOCAB) for _ in range(29)]
    prompts = [system + [rng.randrange(VOCAB) for _ in range(k)] for k in (18, 20, 22)]
    engine = PagedEngine(model_of(family), block_size=8, max_batch_size=6)
    engine.generate([system], max_tokens=1)
    before = path_counts["prefill_ops"]
    for prompt, got in zip(prompts, run_all(engine, prompts), strict=True):
        assert got == solo(family, tuple(prompt))
    assert path_counts["prefill_ops"] > before
    assert engine.stats().live_blocks == 0
