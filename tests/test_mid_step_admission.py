"""Requests that arrive while a step runs join its prefill (``PagedEngine.step``'s
``admit_more``), in the engine and through the server's engine thread."""

from __future__ import annotations

import queue
import random
import threading
from types import SimpleNamespace

import pytest
from test_engine import BS, mixed_prompts, solo
from tiny_models import VOCAB, model_of

from mlx_paged import PagedEngine
from mlx_paged.server.ranks import RankWorker
from mlx_paged.server.worker import EngineWorker, Job


def _finish(engine: PagedEngine, out: dict[int, list[int]]) -> None:
    while engine.waiting or engine.running:
        for e in engine.step():
            out.setdefault(e.uid, []).append(e.token)
    engine.check_invariants()


def test_a_request_added_during_a_step_gets_its_first_token_in_it():
    engine = PagedEngine(model_of("llama"), block_size=BS, max_batch_size=4)
    a, b, c = mixed_prompts(seed=3)[:3]
    first = engine.add_request(a, 5)
    added: list[int] = []

    def more() -> None:
        added.append(engine.add_request(b, 5))
        added.append(engine.add_request(c, 5))

    out: dict[int, list[int]] = {}
    for e in engine.step(admit_more=more):
        out.setdefault(e.uid, []).append(e.token)
    assert set(out) == {first, *added}, "each one's first token came in the step it joined"
    _finish(engine, out)
    for uid, prompt in zip([first, *added], [a, b, c], strict=True):
        assert out[uid] == solo("llama", tuple(prompt), 5)


def test_admit_more_is_asked_once_a_step_and_may_add_nothing():
    engine = PagedEngine(model_of("llama"), block_size=BS, max_batch_size=2)
    a, b, c = mixed_prompts(seed=4)[:3]
    uids = [engine.add_request(a, 4), engine.add_request(b, 4)]
    calls: list[int] = []
    engine.step(admit_more=lambda: calls.append(1))
    assert calls == [1] and not engine.waiting
    # A full batch: what it adds waits for a free slot, as any waiting request does.
    late = []
    engine.step(admit_more=lambda: late.append(engine.add_request(c, 4)))
    assert [r.uid for r in engine.waiting] == late
    out: dict[int, list[int]] = {}
    _finish(engine, out)
    assert out[late[0]] == solo("llama", tuple(c), 4)
    assert len(out[uids[0]]) <= 4


def test_the_first_admissions_tokens_are_out_before_more_are_asked_for():
    """A batched prefill's first tokens are read once the next work is dispatched; the
    requests added mid-step would be that work, so those tokens are read first."""
    rng = random.Random(11)
    a, b, c = ([rng.randrange(VOCAB) for _ in range(40)] for _ in range(3))
    engine = PagedEngine(model_of("llama"), block_size=BS, max_batch_size=4)
    assert engine.prefiller.overlap, "the case at stake: overlapped batched prefills"
    firsts = [engine.add_request(a, 3), engine.add_request(b, 3)]
    told: list[int] = []
    told_when_asked: list[list[int]] = []

    def more() -> None:
        told_when_asked.append(list(told))
        engine.add_request(c, 3)

    engine.step(on_event=lambda e: told.append(e.uid), admit_more=more)
    assert told_when_asked == [firsts], "both first tokens were out when more were asked for"
    assert len(told) == 3


def test_admit_more_must_be_callable_and_a_refusal_admits_nothing():
    engine = PagedEngine(model_of("llama"), block_size=BS, max_batch_size=2)
    engine.add_request(mixed_prompts(seed=7)[0], 2)
    with pytest.raises(ValueError, match="admit_more must be a callable"):
        engine.step(admit_more=3)
    assert len(engine.waiting) == 1 and not engine.running
    engine.check_invariants()


def test_a_prefill_budget_leaves_arrivals_for_the_next_step():
    """The budget bounds a step's prompt tokens: no second admission is asked for."""
    engine = PagedEngine(model_of("llama"), block_size=BS, max_batch_size=4, prefill_budget=64)
    engine.add_request(mixed_prompts(seed=6)[0], 2)
    calls: list[int] = []
    engine.step(admit_more=lambda: calls.append(1))
    assert calls == []


class _Engine:
    """What ``EngineWorker`` asks of an engine while it drains: aborts, counted."""

    def __init__(self) -> None:
        self.aborted: list[int] = []

    def abort(self, uid: int) -> bool:
        self.aborted.append(uid)
        return True


def test_the_worker_adds_jobs_mid_step_and_holds_other_commands_for_after_it(monkeypatch):
    worker = EngineWorker(lambda: None)
    worker.engine = _Engine()
    added: list[Job] = []
    monkeypatch.setattr(worker, "_add", added.append)
    monkeypatch.setattr(worker, "_finish", lambda job, reason: None)
    jobs = [Job([1], 1, deliver=lambda out: None) for _ in range(3)]
    jobs[1].uid = 7
    worker._jobs[7] = jobs[1]
    worker.submit(jobs[0])
    worker.abort(jobs[1])
    worker.submit(jobs[2])
    worker._inbox.put(("stop", None))
    worker._admit_more()
    assert added == [jobs[0], jobs[2]] and worker.engine.aborted == []
    assert worker._inbox.empty() and [k for k, _ in worker._held] == ["abort", "stop"]
    assert worker._drain(block=False) is False, "the held stop ends the loop"
    assert worker.engine.aborted == [7] and worker._held == []


def test_a_job_submitted_during_a_step_is_prefilled_in_it():
    """Through the engine thread: the second job is submitted while the first one's prefill
    runs, and both first tokens come out of that step."""
    engine = PagedEngine(model_of("llama"), block_size=BS, max_batch_size=4)
    entered, go = threading.Event(), threading.Event()
    prefill = engine.prefiller.prefill

    def held(work, *args, **kwargs):
        if not entered.is_set():
            entered.set()
            assert go.wait(30)
        return prefill(work, *args, **kwargs)

    engine.prefiller.prefill = held
    steps, firsts = [0], {}
    step = engine.step

    def counted(*args, **kwargs):
        steps[0] += 1
        return step(*args, **kwargs)

    engine.step = counted
    tokenizer = SimpleNamespace(
        eos_token_ids=[], has_thinking=False, has_tool_calling=False, detokenizer=_Detok()
    )
    worker = EngineWorker(lambda: (engine, tokenizer))
    worker.start(60)
    outs: dict[int, queue.Queue] = {}
    try:
        on_event = worker._on_event

        def first_step(event):
            firsts.setdefault(event.uid, steps[0])
            on_event(event)

        worker._on_event = first_step
        a, b = mixed_prompts(seed=5)[:2]
        jobs = []
        for i, prompt in enumerate((a, b)):
            outs[i] = queue.Queue()
            jobs.append(Job(list(prompt), 3, deliver=outs[i].put))
            worker.submit(jobs[-1])
            if i == 0:
                assert entered.wait(30), "the first job's prefill began"
        go.set()
        for i in outs:  # accepted, then its tokens to the end
            while outs[i].get(timeout=30).finish_reason is None:
                pass
        assert firsts == {jobs[0].uid: 1, jobs[1].uid: 1}
    finally:
        go.set()
        worker.stop(30)


def test_a_sharded_models_ranks_add_jobs_between_steps_only():
    assert EngineWorker.admits_mid_step and not RankWorker.admits_mid_step


class _Detok:
    """A detokenizer that spells each token as its id."""

    def reset(self) -> None:
        self.last_segment = ""

    def add_token(self, token: int) -> None:
        self.last_segment = f" {token}"

    def finalize(self) -> None:
        self.last_segment = ""
