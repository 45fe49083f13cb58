"""Recurrent-state snapshots taken inside a prefill forward (``attention.capture``).

GatedDeltaNet families (qwen3_5, qwen3_5_moe, qwen3_next) record their state at one
position per row inside a forward, so a prompt's prefill no longer ends a forward at
each snapshot position. Every snapshot so taken is checked against mlx-lm's own
cache run over the same tokens; other families keep ending forwards there.
"""

from __future__ import annotations

import logging
import random

import mlx.core as mx
import pytest
from hypothesis import given
from hypothesis import strategies as st
from mlx_lm.models.cache import make_prompt_cache
from test_hybrid import BS, INTERVAL, engine_of, recurrent_caches, run, run_requests, solo, toks
from tiny_models import HYBRIDS, MORE_HYBRIDS, model_of, record_forwards

from mlx_paged.attention import capture
from mlx_paged.engine.prefills import prefill_steps
from mlx_paged.engine.recurrent import split_cuts

CAPTURED = ["qwen3_5", "qwen3_next", "qwen3_5_moe"]


def dense_state(family: str, tokens: list[int]) -> list[list[mx.array]]:
    """Every recurrent layer's state entries after ``tokens``, on mlx-lm's own caches."""
    model = model_of(family)
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array(tokens)[None], cache=cache))
    return [c.cache for c in recurrent_caches(cache)]


def assert_snapshot_is_dense(engine, family: str, prompt: list[int], at: int) -> None:
    match = engine.scheduler.index.match(prompt[:at] + [-1])
    assert (match.length, match.snapshot is not None) == (at, True), at
    saved = engine.runner.states.snapshot_state(match.snapshot)
    want = dense_state(family, prompt[:at])
    assert len(saved) == len(want)
    for layer, (got_layer, want_layer) in enumerate(zip(saved, want, strict=True)):
        for e, (g, w) in enumerate(zip(got_layer, want_layer, strict=True)):
            assert (g.shape, g.dtype) == (w.shape, w.dtype), (at, layer, e)
            assert mx.allclose(g, w, rtol=1e-4, atol=1e-5).item(), (at, layer, e)


@pytest.mark.parametrize("family", HYBRIDS + list(MORE_HYBRIDS))
def test_which_families_record_inside_a_forward(family):
    engine = engine_of(family)
    assert engine.runner.states.captures == (family in CAPTURED)


@pytest.mark.parametrize("family", CAPTURED)
def test_a_burst_snapshots_its_last_full_blocks_inside_one_forward(family, monkeypatch):
    """Five requests behind a cached 32-token prefix, with suffixes of 7-17 tokens: one
    padded forward (not one to each last full block and one for the tails). Their last
    full blocks end at 32 (cached), 40, 40, 48 (the forward's end) and 48 (8 and 16
    tokens into the rows), and hold snapshots equal to the dense state there."""
    rng = random.Random(4)
    system = toks(rng, 2 * INTERVAL)
    prompts = [system + toks(rng, k) for k in (7, 12, 14, 16, 17)]
    engine = engine_of(family)
    run(engine, [system], max_tokens=1)
    calls = record_forwards(engine, monkeypatch)
    reqs, got = run_requests(engine, prompts)
    assert calls == [(17, (7, 12, 14, 16, 17))]
    assert [r.prefix_hit for r in reqs] == [2 * INTERVAL] * 5
    assert got == [solo(family, tuple(p)) for p in prompts]
    for prompt in prompts:
        assert_snapshot_is_dense(engine, family, prompt, len(prompt) // BS * BS)
    # A later prompt that leaves the second one after its block at 40 starts there.
    later = prompts[1][:40] + toks(rng, 5)
    reqs, got = run_requests(engine, [later])
    assert reqs[0].prefix_hit == 40
    assert got == [solo(family, tuple(later))]


@pytest.mark.parametrize("family", CAPTURED)
def test_a_long_prompt_snapshots_every_interval_in_half_the_forwards(family, monkeypatch):
    """A 53-token prompt in 64-token chunks snapshots at 16, 32 and 48 (every interval and
    its last full block) in two forwards, 16 and 48 taken inside them."""
    rng = random.Random(7)
    prompt = toks(rng, 3 * INTERVAL + 5)
    engine = engine_of(family, prefill_step_size=64, prefill_batch_tokens=16)
    steps = []
    prefill = engine.runner.prefill
    monkeypatch.setattr(
        engine.runner,
        "prefill",
        lambda req, n, logits=False: steps.append(n) or prefill(req, n, logits),
    )
    (req,), got = run_requests(engine, [prompt], max_tokens=2)
    assert steps == [32, 21]
    assert got == [solo(family, tuple(prompt), 2)]
    for at in (16, 32, 48):
        assert_snapshot_is_dense(engine, family, prompt, at)


def test_capture_off_ends_forwards_at_snapshots(monkeypatch):
    monkeypatch.setenv("MLX_PAGED_CAPTURE", "off")
    rng = random.Random(4)
    system = toks(rng, 2 * INTERVAL)
    prompts = [system + toks(rng, k) for k in (11, 12, 13, 14)]
    engine = engine_of("qwen3_5")
    assert not engine.runner.states.captures
    run(engine, [system], max_tokens=1)
    calls = record_forwards(engine, monkeypatch)
    _, got = run_requests(engine, prompts)
    assert calls == [(8, (8, 8, 8, 8)), (6, (3, 4, 5, 6))]
    assert got == [solo("qwen3_5", tuple(p)) for p in prompts]


def test_layers_that_do_not_record_turn_capture_off(monkeypatch, caplog):
    """A forward whose layers recorded nothing: a warning, no snapshot there, the tokens
    unchanged, and the next burst ends its forwards at snapshots again."""
    rng = random.Random(5)
    system = toks(rng, 2 * INTERVAL)
    prompts = [system + toks(rng, k) for k in (11, 12, 13, 14)]
    engine = engine_of("qwen3_5")
    run(engine, [system], max_tokens=1)
    monkeypatch.setattr(capture.Capture, "conv", lambda self, x, keep: None)
    calls = record_forwards(engine, monkeypatch)
    with caplog.at_level(logging.WARNING, logger="mlx_paged.engine"):
        _, got = run_requests(engine, prompts[:2])
    assert calls == [(12, (11, 12))]
    assert "did not record" in caplog.text
    assert not engine.runner.states.captures
    assert got == [solo("qwen3_5", tuple(p)) for p in prompts[:2]]
    assert engine.scheduler.index.match(prompts[0][:40] + [-1]).length == 2 * INTERVAL
    calls.clear()
    _, got = run_requests(engine, prompts[2:])
    assert calls == [(8, (8, 8)), (6, (5, 6))]
    assert got == [solo("qwen3_5", tuple(p)) for p in prompts[2:]]


def test_a_capture_out_of_order_is_refused():
    cap = capture.Capture([2, 0])
    x = mx.arange(2 * 5 * 3, dtype=mx.float32).reshape(2, 5, 3)
    cap.conv(x, 3)  # rows' windows after 2 and 0 tokens: inputs 2..4 and 0..2
    assert mx.array_equal(cap.layers[0][0][0], x[0, 2:5]).item()
    assert mx.array_equal(cap.layers[0][0][1], x[1, 0:3]).item()
    assert cap.states(1) is None  # no delta state yet
    cap.delta(mx.zeros((2, 4)))
    assert cap.states(1) is not None and cap.states(2) is None
    cap.delta(mx.zeros((2, 4)))  # a second delta state for one convolution
    assert cap.states(1) is None
    with pytest.raises(ValueError, match="non-negative"):
        capture.Capture([1, -1])


@given(
    start=st.integers(0, 6).map(lambda b: b * BS),
    length=st.integers(1, 120),
    chunk=st.sampled_from([0, 8, 16, 24, 64]),
    extra=st.sets(st.integers(1, 15)),
)
def test_split_cuts_leave_at_most_one_snapshot_inside_each_forward(start, length, chunk, extra):
    end = start + length
    due = sorted({start + BS * k for k in extra if start + BS * k <= end})
    cuts, captures = split_cuts(start, end, chunk, due)
    assert cuts | captures == set(due) and not cuts & captures
    if not chunk:
        assert not captures
        return
    steps = prefill_steps(start, end, chunk, cuts)
    assert sum(steps) == length and max(steps) <= chunk
    pos = start
    for n in steps:
        assert len([c for c in captures if pos < c < pos + n]) <= 1
        pos += n
