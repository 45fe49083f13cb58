"""The head over the sampled positions alone: the same logits, on every family."""

from __future__ import annotations

import threading

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache
from tiny_models import CONFIGS, VOCAB, tiny_model

from mlx_paged import PagedEngine
from mlx_paged.engine.head import Head

PROMPT = [(7 * i + 3) % VOCAB for i in range(23)]


@pytest.mark.parametrize("family", list(CONFIGS))
def test_the_cut_head_gives_the_full_heads_logits(family):
    model = tiny_model(family)
    names = [k for k, _ in tree_flatten(model.parameters())]
    head = Head.of(model)
    assert head is not None, f"{family}: no lm_head or embed_tokens found"
    assert Head.of(model) is head  # made once per model
    assert [k for k, _ in tree_flatten(model.parameters())] == names  # weights keep their names

    x = mx.array([PROMPT, PROMPT[::-1]])
    full = model(x, cache=make_prompt_cache(model))
    with head.at():
        last = model(x, cache=make_prompt_cache(model))
    rows = mx.array([5, 22], dtype=mx.int32)
    with head.at(rows):
        picked = model(x, cache=make_prompt_cache(model))
    again = model(x, cache=make_prompt_cache(model))  # outside ``at``: every position

    assert full.shape == again.shape == (2, len(PROMPT), full.shape[-1])
    assert last.shape == picked.shape == (2, 1, full.shape[-1])
    assert mx.allclose(last[:, 0], full[:, -1], atol=1e-4, rtol=1e-4).item()
    want = mx.stack([full[0, 5], full[1, 22]])
    assert mx.allclose(picked[:, 0], want, atol=1e-4, rtol=1e-4).item()
    assert mx.array_equal(again, full).item()


def test_a_model_without_a_named_head_gets_none():
    import mlx.nn as nn

    class Bare(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(4, 4)

    assert Head.of(Bare()) is None


def test_the_cut_is_per_thread():
    model = tiny_model("llama")
    head = Head.of(model)
    x = mx.array([PROMPT])
    seen = []

    def other():
        seen.append(model(x).shape)

    with head.at():
        thread = threading.Thread(target=other)
        thread.start()
        thread.join()
        assert model(x).shape[1] == 1
    assert seen == [(1, len(PROMPT), VOCAB)]


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen3_5"])
def test_engine_prefills_run_the_head_over_one_position_per_row(family, monkeypatch):
    """Both prefill paths (one request alone, a batch of suffixes, padded) hand the head
    one position per row where they sample; tokens match a run with the head over every
    position."""
    model = tiny_model(family)
    system = [(5 * i + 1) % VOCAB for i in range(40)]
    prompts = [system + [(k * j) % VOCAB for j in range(k)] for k in (18, 20, 22)]

    def run(cut: bool) -> tuple[list[list[int]], list[tuple[int, ...]]]:
        engine = PagedEngine(model, block_size=8, max_batch_size=6, compile_decode=False)
        head = engine.runner.head
        shapes: list[tuple[int, ...]] = []
        cut_input = head.cut

        def spy(h: mx.array) -> mx.array:
            out = cut_input(h) if cut else h
            if getattr(head._local, "on", False):  # a forward that samples
                shapes.append((h.shape[1], *out.shape[:2]))
            return out

        monkeypatch.setattr(head, "cut", spy)
        first = engine.generate([PROMPT, system], max_tokens=5)  # alone; caches the prefix
        return first + engine.generate(prompts, max_tokens=5), shapes

    tokens, shapes = run(cut=True)
    full_tokens, full_shapes = run(cut=False)
    assert tokens == full_tokens
    assert shapes and all(s[2] == 1 for s in shapes), shapes  # (positions in, rows, 1)
    assert any(s[0] > 1 and s[1] > 1 for s in shapes), shapes  # a batched, padded prefill
    assert [s[0] for s in shapes] == [s[0] for s in full_shapes]
    assert all(s[2] == s[0] for s in full_shapes)
