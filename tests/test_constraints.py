"""Token constraints in the engine: a per-request mask inside the batched decode.

A constraint here is a plain allow-list (what a grammar's state is to the
engine), so the tests can say exactly which tokens were allowed when.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from tiny_models import VOCAB, model_of

from mlx_paged import PagedEngine
from mlx_paged.engine.runner import mask_logits


class AllowList:
    """Allows ``allowed`` tokens (a fixed set, or one per step); records what it saw."""

    def __init__(self, allowed, refuse: int | None = None):
        self.allowed = allowed
        self.refuse = refuse  # a token it pretends not to allow when accepting
        self.seen: list[int] = []

    def current(self) -> set[int]:
        a = self.allowed
        return set(a[len(self.seen)] if isinstance(a, list) else a)

    def fill(self, row: np.ndarray) -> None:
        row[:] = 0
        bits = row.view(np.uint32)
        for t in self.current():
            bits[t // 32] |= np.uint32(1 << (t % 32))

    def accept(self, token: int) -> bool:
        ok = token in self.current() and token != self.refuse
        self.seen.append(token)
        return ok


@pytest.mark.parametrize("vocab", [1, 31, 32, 33, 100, 128])
def test_mask_logits_keeps_exactly_the_set_bits(vocab):
    rng = np.random.default_rng(vocab)
    logits = rng.standard_normal((3, vocab)).astype(np.float32)
    allowed = rng.random((3, vocab)) < 0.3
    allowed[:, vocab - 1] = True  # the last bit of a partial word
    words = np.zeros((3, (vocab + 31) // 32), np.uint32)
    for b, t in zip(*np.nonzero(allowed), strict=True):
        words[b, t // 32] |= np.uint32(1 << (t % 32))
    out = np.array(mask_logits(mx.array(logits), mx.array(words.view(np.int32))))
    assert np.array_equal(out, np.where(allowed, logits, -np.inf))


def test_constrained_requests_sample_only_allowed_tokens_and_leave_the_rest_alone():
    prompts = [[1, 5, 9, 2], [7, 7, 3], [4, 8, 15, 16, 23, 42], [2, 4]]
    free = PagedEngine(model_of("llama"), block_size=4, max_batch_size=4).generate(prompts, 12)
    engine = PagedEngine(model_of("llama"), block_size=4, max_batch_size=4)
    few = AllowList({3, 17, 64, VOCAB - 1})
    script = AllowList([{t} for t in (100, 3, 99, 0, 127, 64, 5, 6, 7, 8, 9, 10)])
    uids = [
        engine.add_request(prompts[0], 12),
        engine.add_request(prompts[1], 12, constraint=few),
        engine.add_request(prompts[2], 12),
        engine.add_request(prompts[3], 12, constraint=script),
    ]
    out = {uid: [] for uid in uids}
    for event in engine.stream():
        out[event.uid].append(event.token)
    assert out[uids[0]] == free[0] and out[uids[2]] == free[2]  # unchanged by the masks
    assert set(out[uids[1]]) <= few.allowed and few.seen == out[uids[1]]
    assert out[uids[3]] == [100, 3, 99, 0, 127, 64, 5, 6, 7, 8, 9, 10] == script.seen
    engine.check_invariants()


def test_a_token_the_constraint_refuses_ends_that_request_only():
    # The refusal is found off the critical path: the request ends at its next step.
    engine = PagedEngine(model_of("llama"), block_size=4, max_batch_size=2)
    bad = AllowList({5}, refuse=5)
    a = engine.add_request([1, 2, 3], 4, constraint=bad)
    b = engine.add_request([3, 2, 1], 4)
    events = list(engine.stream())
    ended = [e for e in events if e.uid == a]
    assert [(e.token, e.finish_reason) for e in ended] == [(5, None), (-1, "error")]
    assert "breaks the request's constraint" in ended[1].error and bad.seen == [5]
    assert [e.finish_reason for e in events if e.uid == b][-1] == "length"
    assert engine.stats().live_blocks == 0
    engine.check_invariants()


def test_constraints_survive_preemption():
    # Three 3-token prompts grow to 17 tokens (5 blocks of 4) in 6 blocks: requests are
    # preempted and recomputed; each constraint sees each sampled token exactly once.
    engine = PagedEngine(model_of("llama"), block_size=4, max_batch_size=3, num_blocks=6)
    scripts = {}
    for k in range(3):
        steps = [{(7 * k + 11 * i) % VOCAB} for i in range(14)]
        script = AllowList(steps)
        scripts[engine.add_request([k + 1, k + 2, k + 3], 14, constraint=script)] = script
    out = {uid: [] for uid in scripts}
    for event in engine.stream():
        out[event.uid].append(event.token)
    assert engine.stats().preemptions > 0
    for uid, script in scripts.items():
        assert out[uid] == [min(s) for s in script.allowed] == script.seen
    engine.check_invariants()


class Broken(AllowList):
    def fill(self, row: np.ndarray) -> None:
        if len(self.seen) >= 2:
            raise RuntimeError("grammar state lost")
        super().fill(row)


def test_a_constraint_that_raises_ends_that_request_only():
    engine = PagedEngine(model_of("llama"), block_size=4, max_batch_size=2)
    a = engine.add_request([1, 2, 3], 6, constraint=Broken({7, 8}))
    b = engine.add_request([3, 2, 1], 6)
    events = list(engine.stream())
    ended = [e for e in events if e.uid == a]
    assert [e.finish_reason for e in ended] == [None, None, "error"]
    assert "grammar state lost" in ended[-1].error
    assert len([e for e in events if e.uid == b]) == 6
    engine.check_invariants()


class Batched(AllowList):
    calls: list[int] = []

    @staticmethod
    def fill_many(constraints: list[Batched], rows: np.ndarray) -> None:
        Batched.calls.append(len(constraints))
        for c, row in zip(constraints, rows, strict=True):
            c.fill(row)


def test_constraints_with_fill_many_fill_together():
    engine = PagedEngine(model_of("llama"), block_size=4, max_batch_size=3)
    scripts = [Batched([{(k + 5 * i) % VOCAB} for i in range(8)]) for k in range(3)]
    uids = [engine.add_request([k + 1, 7], 8, constraint=c) for k, c in enumerate(scripts)]
    out = {uid: [] for uid in uids}
    for event in engine.stream():
        out[event.uid].append(event.token)
    for uid, c in zip(uids, scripts, strict=True):
        assert out[uid] == [min(s) for s in c.allowed] == c.seen
    # The first masks come one by one (at prefill); the next 7 steps fill all three at once.
    assert Batched.calls == [3] * 7
