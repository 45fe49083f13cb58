"""MLX keeps freed buffers for reuse; a warmed-up engine and an idle server hand them back."""

from __future__ import annotations

import queue
import time
from types import SimpleNamespace

import mlx.core as mx
from test_engine import BS, mixed_prompts
from test_mid_step_admission import _Detok
from tiny_models import model_of

from mlx_paged import PagedEngine
from mlx_paged.server.worker import EngineWorker, Job


def test_warm_up_leaves_no_cached_buffers(monkeypatch):
    from mlx_paged.engine import warmup

    monkeypatch.setattr(warmup, "prebuild_kernels", lambda: 0)
    engine = PagedEngine(model_of("llama"), block_size=BS, max_batch_size=4)
    warmup.warm_up(engine)
    assert mx.get_cache_memory() == 0
    assert engine.generate(mixed_prompts(seed=2)[:2], 3)  # and it still serves


def test_an_idle_server_hands_its_cached_buffers_back_once(monkeypatch):
    """Not between steps, nor between jobs that follow each other: once the engine thread
    has waited out the inbox's timeout with nothing to run, and once only until it steps
    again."""
    engine = PagedEngine(model_of("llama"), block_size=BS, max_batch_size=4)
    tokenizer = SimpleNamespace(
        eos_token_ids=[], has_thinking=False, has_tool_calling=False, detokenizer=_Detok()
    )
    clear, cleared = mx.clear_cache, []

    def counted():
        cleared.append(len(engine.running) + len(engine.waiting))
        clear()

    monkeypatch.setattr(mx, "clear_cache", counted)
    worker = EngineWorker(lambda: (engine, tokenizer))
    worker.start(60)
    try:
        for rnd in range(2):
            outs = []
            for prompt in mixed_prompts(seed=rnd)[:3]:
                outs.append(queue.Queue())
                worker.submit(Job(list(prompt), 4, deliver=outs[-1].put))
            for out in outs:  # accepted, then its tokens to the end
                while out.get(timeout=30).finish_reason is None:
                    pass
            deadline = time.monotonic() + 10
            while len(cleared) <= rnd and time.monotonic() < deadline:
                time.sleep(0.05)
            assert cleared == [0] * (rnd + 1), "once per rest, with nothing running"
            assert mx.get_cache_memory() == 0
        time.sleep(1.2)  # two more of the inbox's timeouts, with no step between
        assert cleared == [0, 0]
    finally:
        worker.stop(30)


def test_the_server_bounds_mlxs_cache_by_the_warm_ups_peak_or_the_flag(monkeypatch):
    from mlx_paged.server import memory

    gib = 1 << 30
    held = {"peak": 5 * gib, "active": 2 * gib}
    monkeypatch.setattr(memory.mx, "get_peak_memory", lambda: held["peak"])
    monkeypatch.setattr(memory.mx, "get_active_memory", lambda: held["active"])
    before = mx.set_cache_limit(0)
    try:
        assert memory.bound_cache("auto") == 3 * gib  # the most held beyond the arrays
        assert mx.set_cache_limit(0) == 3 * gib, "and MLX was told"
        held["peak"] = held["active"] + 1000
        assert memory.bound_cache("auto") == memory.AUTO_FLOOR
        assert memory.bound_cache("512MB") == 512_000_000
        assert mx.set_cache_limit(0) == 512_000_000
    finally:
        mx.set_cache_limit(before)


def test_under_a_cache_limit_steps_keep_no_more_than_it():
    """MLX honours the limit the server sets: a busy engine's cache stays within a buffer
    of it, and without one the same work leaves several times more cached."""
    cached = {}
    for limit in (None, 64 << 10):
        mx.clear_cache()
        before = mx.set_cache_limit(limit) if limit is not None else None
        try:
            engine = PagedEngine(model_of("llama"), block_size=BS, max_batch_size=4)
            engine.generate(mixed_prompts(seed=4)[:4], 6)
            cached[limit] = mx.get_cache_memory()
        finally:
            if before is not None:
                mx.set_cache_limit(before)
    # MLX's CUDA allocator compares the cache with the limit before it keeps a freed buffer,
    # so there the cache may pass the limit by that buffer (69,408 bytes on an H200).
    assert cached[64 << 10] <= (64 << 10) + (16 << 10)
    assert cached[None] > 4 * (64 << 10)
