"""PagedEngine against solo mlx-lm generation on the dense cache."""

from __future__ import annotations

import random

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule
from mlx_lm.generate import generate_step
from tiny_models import VOCAB, model_of, record_forwards
from tiny_models import solo as dense_solo

from mlx_paged import PagedEngine, attention
from mlx_paged.attention import routing
from mlx_paged.attention.kernels.reference import reference_paged_decode, reference_paged_prefill
from mlx_paged.engine import Event

BS = 8
MAX_TOKENS = 10
FAMILIES = ["llama", "qwen3", "gemma3_text"]  # gemma3_text: sliding-window layers


def solo(family: str, prompt: tuple[int, ...], max_tokens: int = MAX_TOKENS) -> list[int]:
    """Greedy tokens of one request alone, on mlx-lm's own caches."""
    return dense_solo(family, prompt, max_tokens)


def mixed_prompts(seed: int = 0) -> list[list[int]]:
    """Shared prefixes ending mid-block, an exact block-aligned one, and unshared prompts."""
    rng = random.Random(seed)

    def toks(n):
        return [rng.randrange(VOCAB) for _ in range(n)]

    system = toks(29)  # ends mid-block (29 = 3 * 8 + 5)
    other = toks(16)  # block-aligned shared prefix
    return [
        system + toks(7),
        system + toks(1),
        system + toks(20),
        other + toks(3),
        other + toks(11),
        toks(5),
        toks(33),
        system,  # the whole shared prefix, nothing after it
    ]


def run_all(engine: PagedEngine, prompts, late=(), late_after=3, max_tokens=MAX_TOKENS):
    """Add ``prompts``, step; add ``late`` prompts after ``late_after`` steps; collect tokens."""
    uids = [engine.add_request(p, max_tokens) for p in prompts]
    out: dict[int, list[int]] = {u: [] for u in uids}
    reasons: dict[int, str] = {}
    steps = 0
    while engine.waiting or engine.running:
        for e in engine.step():
            out.setdefault(e.uid, []).append(e.token)
            if e.finish_reason:
                reasons[e.uid] = e.finish_reason
        engine.check_invariants()
        steps += 1
        if steps == late_after:
            uids += [engine.add_request(p, max_tokens) for p in late]
    assert set(reasons) == set(uids), "a request never finished"
    return [out[u] for u in uids]


@pytest.mark.parametrize("family", FAMILIES)
def test_mixed_batch_equals_solo(family):
    prompts = mixed_prompts()
    late = [prompts[0][:29] + [3, 1, 4], [9] * 12]
    engine = PagedEngine(model_of(family), block_size=BS, max_batch_size=6, prefill_step_size=16)
    outputs = run_all(engine, prompts, late=late)
    for prompt, got in zip(prompts + late, outputs, strict=True):
        assert got == solo(family, tuple(prompt))
    stats = engine.stats()
    assert stats.prefix_hit_tokens > 0
    assert stats.generated_tokens == MAX_TOKENS * len(outputs)
    assert stats.live_blocks == 0 and stats.preemptions == 0


@pytest.mark.parametrize("family", ["llama", "gemma3_text", "qwen3_next"])
def test_long_prompts_go_alone_in_whole_steps_and_still_match_solo(family, monkeypatch):
    """Prompts over ``prefill_batch_tokens`` are prefilled alone in chunks of up to
    ``prefill_step_size`` (a sliding window's and a hybrid's too); short ones batch."""
    prompts = mixed_prompts(4)
    engine = PagedEngine(
        model_of(family), block_size=BS, max_batch_size=6, prefill_step_size=40,
        prefill_batch_tokens=12,
    )  # fmt: skip
    chunks = []
    prefill = engine.runner.prefill

    def spy(req, n, logits=False):
        chunks.append(n)
        return prefill(req, n, logits)

    monkeypatch.setattr(engine.runner, "prefill", spy)
    for prompt, got in zip(prompts, run_all(engine, prompts), strict=True):
        assert got == solo(family, tuple(prompt))
    assert chunks and max(chunks) <= 40 and any(n > 12 for n in chunks), chunks
    assert engine.stats().live_blocks == 0


@pytest.mark.parametrize("family", FAMILIES)
def test_suffixes_of_different_lengths_share_one_padded_forward(family, monkeypatch):
    """Requests adopting a cached prefix prefill suffixes of about 18, 20 and 22 tokens in
    one forward padded to the longest, and still generate what each would alone."""
    rng = random.Random(3)
    system = [rng.randrange(VOCAB) for _ in range(29)]
    prompts = [system + [rng.randrange(VOCAB) for _ in range(k)] for k in (18, 20, 22)]
    engine = PagedEngine(model_of(family), block_size=BS, max_batch_size=6)
    engine.generate([system], max_tokens=1)  # caches the prefix
    calls = record_forwards(engine, monkeypatch)
    outputs = run_all(engine, prompts)
    (width, counts), *rest = calls
    assert not rest and width == max(counts) and len(set(counts)) == 3, calls
    for prompt, got in zip(prompts, outputs, strict=True):
        assert got == solo(family, tuple(prompt))
    assert engine.stats().live_blocks == 0


@pytest.mark.parametrize("overlap", [True, False])
def test_batched_prefills_are_dispatched_before_the_first_tokens_before_them_are_read(overlap):
    """With ``overlap``, each batched prefill forward after the first goes out before the
    first tokens of the one before it are read (they are picked on the device first);
    without it, each forward is read before the next. The tokens are the same."""
    rng = random.Random(11)
    system = [rng.randrange(VOCAB) for _ in range(24)]
    prompts = [system + [rng.randrange(VOCAB) for _ in range(6)] for _ in range(6)]
    engine = PagedEngine(
        model_of("llama"), block_size=BS, max_batch_size=6, prefill_batch_tokens=12, overlap=overlap
    )
    engine.generate([system], max_tokens=1)  # caches the prefix: 6 suffixes, 2 rows a forward
    log: list[tuple[str, object]] = []
    forward = engine.runner.forward

    def spy(reqs, n, logits=False, counts=None, wait=True):
        log.append(("forward", tuple(r.uid for r in reqs), wait))
        return forward(reqs, n, logits, counts, wait)

    engine.runner.forward = spy
    uids = [engine.add_request(p, MAX_TOKENS) for p in prompts]
    out: dict[int, list[int]] = {u: [] for u in uids}
    while engine.waiting or engine.running:
        for e in engine.step(on_event=lambda e: log.append(("token", e.uid))):
            out[e.uid].append(e.token)
    forwards = [entry for entry in log if entry[0] == "forward"]
    assert [len(f[1]) for f in forwards] == [2, 2, 2]
    assert all(f[2] is not overlap for f in forwards)  # dispatched only, or read
    firsts = [log.index(("token", f[1][0])) for f in forwards]
    nexts = [log.index(f) for f in forwards[1:]]
    if overlap:  # forward k + 1 before forward k's first tokens
        assert all(nxt < first for nxt, first in zip(nexts, firsts, strict=False))
    else:
        assert all(first < nxt for nxt, first in zip(nexts, firsts, strict=False))
    for prompt, uid in zip(prompts, uids, strict=True):
        assert out[uid] == solo("llama", tuple(prompt))
    assert engine.stats().live_blocks == 0


def test_a_prefill_budget_changes_when_tokens_come_not_which():
    prompts = mixed_prompts()
    engine = PagedEngine(model_of("llama"), block_size=BS, max_batch_size=6, prefill_budget=24)
    for prompt, got in zip(prompts, run_all(engine, prompts), strict=True):
        assert got == solo("llama", tuple(prompt))
    assert engine.stats().live_blocks == 0


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_kernel_path_reads_the_batch_where_it_lies(family, monkeypatch):
    """With the reference paged kernel offered, batched decode reads through the PagedView."""
    monkeypatch.setattr(routing, "KERNELS", [reference_paged_decode])
    prompts = mixed_prompts(seed=6)
    engine = PagedEngine(model_of(family), block_size=BS, max_batch_size=6, prefill_step_size=16)
    before = attention.path_counts["reference_paged_decode"]
    outputs = run_all(engine, prompts)
    for prompt, got in zip(prompts, outputs, strict=True):
        assert got == solo(family, tuple(prompt))
    assert attention.path_counts["reference_paged_decode"] > before


def reference_prefill(queries, view, scale, sinks):
    """The prefill kernels' spec as a ``PREFILL_KERNELS`` entry (no sinks, as the CUDA one)."""
    return None if sinks is not None else reference_paged_prefill(queries, view, scale)


def declining_prefill(queries, view, scale, sinks):
    """A ``PREFILL_KERNELS`` entry that takes no call: the deferred K/V are read after all."""
    return None


@pytest.mark.parametrize("kernel", [reference_prefill, declining_prefill])
@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_prefill_kernel_path_reads_the_batch_where_it_lies(family, kernel, monkeypatch):
    """With a prefill kernel offered, batched prefills (suffixes after shared prefixes, right
    padding, sliding windows) read through the PrefillView, or gather if it declines."""
    monkeypatch.setattr(routing, "PREFILL_KERNELS", [kernel])
    routing._ready.clear()
    prompts = mixed_prompts(seed=6)
    engine = PagedEngine(model_of(family), block_size=BS, max_batch_size=6, prefill_step_size=16)
    name = "reference_prefill"
    before = attention.path_counts[name]
    outputs = run_all(engine, prompts)
    for prompt, got in zip(prompts, outputs, strict=True):
        assert got == solo(family, tuple(prompt))
    served = attention.path_counts[name] - before
    assert served > 0 if kernel is reference_prefill else served == 0
    routing._ready.clear()


@pytest.mark.parametrize("kernel", [None, reference_prefill, declining_prefill])
def test_batches_widen_where_a_prefill_kernel_serves_them(kernel, monkeypatch):
    """2048-token batched forwards where a prefill kernel runs; 512 again once it declines
    one; 512 with no kernel; an explicit prefill_batch_tokens stays as given."""
    monkeypatch.setattr(routing, "PREFILL_KERNELS", [] if kernel is None else [kernel])
    routing._ready.clear()
    engine = PagedEngine(model_of("llama"), block_size=BS, max_batch_size=6)
    widened = kernel is not None
    assert engine.scheduler.prefill_batch_tokens == (2048 if widened else 512)
    system = list(range(1, 3 * BS + 1))
    engine.generate([system + [70]], max_tokens=1)  # cached, so the next ones batch
    prompts = [system + [80 + i] * (i + 1) for i in range(3)]
    for prompt, got in zip(prompts, engine.generate(prompts, max_tokens=2), strict=True):
        assert got == solo("llama", tuple(prompt), 2)
    keeps = kernel is reference_prefill
    assert engine.scheduler.prefill_batch_tokens == (2048 if keeps else 512)
    assert engine.prefiller.widened is keeps
    fixed = PagedEngine(model_of("llama"), block_size=BS, prefill_batch_tokens=64)
    assert fixed.scheduler.prefill_batch_tokens == 64
    routing._ready.clear()


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_second_run_prefills_only_what_is_new(family):
    prompts = mixed_prompts(seed=1)
    engine = PagedEngine(model_of(family), block_size=BS, num_blocks=400, prefill_step_size=16)
    first = engine.generate(prompts, max_tokens=MAX_TOKENS)
    before = engine.stats()
    second = engine.generate(prompts, max_tokens=MAX_TOKENS)
    after = engine.stats()
    assert second == first
    # Each prompt's K/V is cached but its last token must run again for logits.
    assert after.prefilled_tokens - before.prefilled_tokens == len(prompts)
    assert after.prefix_hit_tokens - before.prefix_hit_tokens == sum(len(p) - 1 for p in prompts)
    engine.check_invariants()


def test_second_run_allocates_only_suffix_blocks():
    system = list(range(1, 41))  # 5 full blocks
    engine = PagedEngine(model_of("llama"), block_size=BS, num_blocks=64, max_batch_size=1)
    engine.generate([system + [50]], max_tokens=4)
    cached = engine.stats().cached_blocks
    assert cached == 6  # 41 prompt + 3 decoded tokens
    engine.add_request(system + [60, 61], max_tokens=4)
    engine.step()  # admit + prefill + first decode
    stats = engine.stats()
    # It holds the 5 system blocks by reference plus one block of its own.
    assert stats.live_blocks == 6 and stats.prefix_hit_tokens == 40
    (req,) = engine.running
    (table,) = req.tables.values()
    assert table.blocks[:5] == [0, 1, 2, 3, 4]


def test_tiny_pool_preempts_and_still_matches():
    prompts = mixed_prompts(seed=2)
    longest = max(len(p) for p in prompts) + MAX_TOKENS
    num_blocks = -(-longest // BS) + 2  # barely more than one request
    engine = PagedEngine(model_of("llama"), block_size=BS, num_blocks=num_blocks)
    outputs = run_all(engine, prompts)
    for prompt, got in zip(prompts, outputs, strict=True):
        assert got == solo("llama", tuple(prompt))
    assert engine.stats().total_blocks == num_blocks


def test_decode_growth_preempts_and_resumes():
    rng = random.Random(5)
    prompts = [[rng.randrange(VOCAB) for _ in range(7)] for _ in range(5)]
    # Three start together in one block each; each needs three by the end.
    engine = PagedEngine(model_of("llama"), block_size=BS, num_blocks=6)
    outputs = run_all(engine, prompts, max_tokens=14)
    for prompt, got in zip(prompts, outputs, strict=True):
        assert got == solo("llama", tuple(prompt), 14)
    stats = engine.stats()
    assert stats.preemptions > 0
    # The preempted request's K/V was recomputed (or adopted) on its return.
    assert stats.prefilled_tokens + stats.prefix_hit_tokens > sum(map(len, prompts))
    assert stats.peak_live_blocks == 6


def test_tiny_pool_with_sliding_layers():
    prompts = mixed_prompts(seed=3)[:5]
    engine = PagedEngine(model_of("gemma3_text"), block_size=BS, num_blocks=10)
    outputs = run_all(engine, prompts)
    for prompt, got in zip(prompts, outputs, strict=True):
        assert got == solo("gemma3_text", tuple(prompt))


def test_per_request_settings():
    family = "qwen3"
    engine = PagedEngine(model_of(family), block_size=BS)
    prompts = mixed_prompts(seed=4)[:3]
    greedy = solo(family, tuple(prompts[1]))

    def only_seven(tokens, logits):
        return mx.where(mx.arange(logits.shape[-1]) == 7, 0.0, -1e9)[None]

    uids = [
        engine.add_request(prompts[0], 4),
        engine.add_request(prompts[1], MAX_TOKENS, stop_tokens=[greedy[2]]),
        engine.add_request(prompts[2], 5, logits_processors=[only_seven]),
        engine.add_request(prompts[2], 3, sampler=lambda lp: mx.array([11])),
    ]
    events: dict[int, list[Event]] = {u: [] for u in uids}
    for e in engine.stream():
        events[e.uid].append(e)
    tokens = {u: [e.token for e in ev] for u, ev in events.items()}
    assert tokens[uids[0]] == solo(family, tuple(prompts[0]))[:4]
    stop_at = greedy.index(greedy[2]) + 1
    assert tokens[uids[1]] == greedy[:stop_at] and events[uids[1]][-1].finish_reason == "stop"
    assert tokens[uids[2]] == [7] * 5 and events[uids[2]][-1].finish_reason == "length"
    assert tokens[uids[3]] == [11] * 3
    assert all(e.finish_reason is None for ev in events.values() for e in ev[:-1])


@pytest.mark.parametrize("overlap", [True, False])
def test_a_stop_token_ends_a_request_and_its_kv_is_reused(overlap):
    """An overlapped step feeds the stop token before the host reads it: its K/V is written
    and indexed, so the next turn adopts one token more, and still generates as alone."""
    prompt = mixed_prompts(seed=10)[0]
    greedy = solo("llama", tuple(prompt))
    engine = PagedEngine(model_of("llama"), block_size=BS, overlap=overlap)
    engine.add_request(prompt, MAX_TOKENS, stop_tokens=[greedy[3]])
    events = list(engine.stream())
    stop_at = greedy.index(greedy[3]) + 1
    assert [e.token for e in events] == greedy[:stop_at] and events[-1].finish_reason == "stop"
    assert [e.finish_reason for e in events[:-1]] == [None] * (stop_at - 1)
    engine.check_invariants()
    turn = prompt + greedy[:stop_at] + [5, 9]
    uid = engine.add_request(turn, MAX_TOKENS)
    req = engine.request(uid)
    assert [e.token for e in engine.stream()] == solo("llama", tuple(turn))
    written = len(prompt) + stop_at - (0 if overlap else 1)
    assert req.prefix_hit == written
    assert engine.stats().live_blocks == 0
    engine.check_invariants()


class AnyToken:
    """A constraint that allows every token (its grammar state needs each one)."""

    def fill(self, row):
        row[:] = -1

    def accept(self, token: int) -> bool:
        return True


def test_overlap_waits_while_a_request_needs_its_tokens_on_the_host():
    """A constraint needs each token before the next step (its grammar gives the next
    mask): while a constrained request runs, every step's tokens come out in that step."""
    prompts = mixed_prompts(seed=11)[:2]
    engine = PagedEngine(model_of("llama"), block_size=BS)
    first = engine.add_request(prompts[0], MAX_TOKENS)
    engine.step()
    # One greedy request alone overlaps: its decode's token comes out a step later.
    assert [e.uid for e in engine.step()] == [first]
    second = engine.add_request(prompts[1], 4, constraint=AnyToken())
    # The waiting token in flight, the new request's first, then this step's decode.
    assert [e.uid for e in engine.step()] == [second, first, first, second]
    out = {first: [], second: []}
    for e in engine.stream():
        out[e.uid].append(e.token)
    assert len(out[first]) == MAX_TOKENS - 4 and len(out[second]) == 2
    assert engine.stats().generated_tokens == MAX_TOKENS + 4
    engine.check_invariants()


def seeded_sampler(seed: int, temperature: float = 0.7):
    """A sampler with its own random stream, as the server makes one per request."""
    key = [mx.random.key(seed)]

    def sample(logprobs):
        key[0], sub = mx.random.split(key[0])
        return mx.random.categorical(logprobs * (1 / temperature), key=sub)

    return sample


def test_sampled_requests_overlap_and_draw_what_step_by_step_would():
    prompts = mixed_prompts(seed=12)[:4]
    outputs = []
    for overlap in (True, False):
        engine = PagedEngine(model_of("llama"), block_size=BS, overlap=overlap)
        uids = [engine.add_request(p, MAX_TOKENS, sampler=seeded_sampler(i))
                for i, p in enumerate(prompts[:3])]  # fmt: skip
        uids.append(engine.add_request(prompts[3], MAX_TOKENS))
        first = engine.step()
        # Overlapped, the first decode's tokens are still in flight.
        assert len(first) == (4 if overlap else 8)
        out = {u: [] for u in uids}
        for e in [*first, *engine.stream()]:
            out[e.uid].append(e.token)
        engine.check_invariants()
        outputs.append([out[u] for u in uids])
    assert outputs[0] == outputs[1]
    assert outputs[0][3] == solo("llama", tuple(prompts[3]))
    assert len({tuple(o) for o in outputs[0]}) == 4


class SharedSampler:
    """An argmax sampler whose requests share one call a step (``batch_key``)."""

    def __init__(self, key, calls: list[int], fail: bool = False):
        self.batch_key, self.calls, self.fail = key, calls, fail

    def __call__(self, logprobs):
        self.calls.append(logprobs.shape[0])
        if self.fail and len(self.calls) > 1:
            raise RuntimeError("group bug")
        return mx.argmax(logprobs, -1)


@pytest.mark.parametrize("overlap", [True, False])
def test_samplers_sharing_a_batch_key_are_called_once_a_step(overlap):
    prompts = mixed_prompts(seed=14)[:5]
    calls, failing = [], []
    engine = PagedEngine(model_of("llama"), block_size=BS, overlap=overlap)
    uids = [engine.add_request(p, MAX_TOKENS, sampler=SharedSampler("a", calls))
            for p in prompts[:3]]  # fmt: skip
    uids.append(engine.add_request(prompts[3], MAX_TOKENS))
    uids.append(engine.add_request(prompts[4], 4, sampler=SharedSampler("b", failing, True)))
    events: dict[int, list[Event]] = {u: [] for u in uids}
    for e in engine.stream():
        events[e.uid].append(e)
    for uid, prompt in zip(uids[:4], prompts[:4], strict=True):
        assert [e.token for e in events[uid]] == solo("llama", tuple(prompt))
    # Decode steps pass all three rows at once (first tokens come from each prefill).
    assert calls.count(3) == MAX_TOKENS - 1 and set(calls) <= {1, 2, 3}
    *ok, last = events[uids[4]]
    assert len(ok) == 1 and last.finish_reason == "error" and "group bug" in last.error
    assert engine.stats().failed == 1
    engine.check_invariants()


@pytest.mark.parametrize("bad", ["raises", "out of range"])
def test_a_sampler_failing_in_an_overlapped_step_ends_its_request_only(bad):
    """The bad token is in flight, fed to the next step clipped, and refused when read."""
    prompts = mixed_prompts(seed=13)[:2]
    calls = [0]

    def flaky(logprobs):
        calls[0] += 1
        if calls[0] < 3:
            return mx.argmax(logprobs, -1)
        if bad == "raises":
            raise RuntimeError("sampler bug")
        return mx.array([VOCAB + 5])

    engine = PagedEngine(model_of("llama"), block_size=BS)
    good = engine.add_request(prompts[0], MAX_TOKENS)
    failing = engine.add_request(prompts[1], MAX_TOKENS, sampler=flaky)
    events: dict[int, list[Event]] = {good: [], failing: []}
    for e in engine.stream():
        events[e.uid].append(e)
    *tokens, last = events[failing]
    assert [e.token for e in tokens] == solo("llama", tuple(prompts[1]))[:2]
    assert last.finish_reason == "error" and last.token == -1
    assert ("sampler bug" if bad == "raises" else "not a token id") in last.error
    assert [e.token for e in events[good]] == solo("llama", tuple(prompts[0]))
    stats = engine.stats()
    assert (stats.failed, stats.live_blocks, stats.running) == (1, 0, 0)
    engine.check_invariants()
    # Only the K/V of its two tokens was parked, not the refused one the next step ran.
    turn = prompts[1] + [e.token for e in tokens] + [3]
    uid = engine.add_request(turn, MAX_TOKENS)
    req = engine.request(uid)
    assert [e.token for e in engine.stream()] == solo("llama", tuple(turn))
    assert req.prefix_hit == len(prompts[1]) + 2


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(tokens=[], max_tokens=4), "empty"),
        (dict(tokens=[1, 2], max_tokens=0), "max_tokens"),
        (dict(tokens=[1, 2], max_tokens=-3), "max_tokens"),
        (dict(tokens=[1, 2], max_tokens=2.5), "max_tokens"),
        (dict(tokens=list(range(100)), max_tokens=4), "needs up to .* blocks"),
    ],
)
def test_bad_requests(kwargs, match):
    engine = PagedEngine(model_of("llama"), block_size=BS, num_blocks=8)
    with pytest.raises(ValueError, match=match):
        engine.add_request(**kwargs)
    assert not engine.waiting


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(block_size=0), "block_size"),
        (dict(max_batch_size=0), "max_batch_size"),
        (dict(prefill_step_size=-1), "prefill_step_size"),
        (dict(num_blocks=0), "num_blocks"),
        (dict(prefill_budget=0), "prefill_budget"),
        (dict(prefill_budget=True), "prefill_budget"),
        (dict(prefill_batch_tokens=0), "prefill_batch_tokens"),
        (dict(prefill_batch_tokens=2.5), "prefill_batch_tokens"),
        (dict(overlap="no"), "overlap"),
        (dict(overlap=None), "overlap"),
    ],
)
def test_bad_engine_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PagedEngine(model_of("llama"), **kwargs)


def test_unpageable_layouts_are_refused_by_model_type_and_cache_class():
    from mlx_lm.models.cache import ArraysCache, ChunkedKVCache

    class Chunked:
        model_type = "chunked_test"
        layers = [None, None]

        def make_cache(self):
            return [ArraysCache(2), ChunkedKVCache(8)]

    with pytest.raises(ValueError, match="chunked_test: ChunkedKVCache"):
        PagedEngine(Chunked())


# ---- property test --------------------------------------------------------

_rng = random.Random(7)
_SYSTEM = [_rng.randrange(VOCAB) for _ in range(13)]
PROMPTS = st.builds(
    lambda shared, tail: (_SYSTEM[:shared] if shared else []) + tail,
    st.sampled_from([0, 5, 13]),
    st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=9),
)


class EngineMachine(RuleBasedStateMachine):
    """Random arrivals, aborts and steps on a small pool; every output equals the solo one
    (an aborted request's, up to the abort)."""

    family = "llama"

    def __init__(self):
        super().__init__()
        self.engine: PagedEngine | None = None
        self.prompts: dict[int, list[int]] = {}
        self.max_tokens: dict[int, int] = {}
        self.out: dict[int, list[int]] = {}
        self.done: set[int] = set()
        self.aborted: set[int] = set()

    @rule(num_blocks=st.integers(5, 12), batch=st.integers(1, 4))
    def build(self, num_blocks, batch):
        if self.engine is None:
            self.engine = PagedEngine(
                model_of(self.family),
                block_size=4,
                num_blocks=num_blocks,
                max_batch_size=batch,
                prefill_step_size=8,
            )

    @rule(prompt=PROMPTS, max_tokens=st.integers(1, 4))
    def arrive(self, prompt, max_tokens):
        if self.engine is None:
            return
        try:
            uid = self.engine.add_request(prompt, max_tokens)
        except ValueError:
            return  # longer than the pool allows: refused up front
        self.prompts[uid], self.max_tokens[uid], self.out[uid] = prompt, max_tokens, []

    @rule()
    def step(self):
        if self.engine is not None:
            self.record(self.engine.step())

    @rule(pick=st.integers(0, 50))
    def abort(self, pick):
        """End a waiting or running request (one may have a token in flight)."""
        live = [u for u in self.prompts if u not in self.done]
        if self.engine is not None and live:
            uid = live[pick % len(live)]
            assert self.engine.abort(uid)
            self.done.add(uid)
            self.aborted.add(uid)

    def record(self, events):
        for e in events:
            assert e.uid not in self.done
            self.out[e.uid].append(e.token)
            if e.finish_reason:
                self.done.add(e.uid)

    @invariant()
    def invariants_hold(self):
        if self.engine is not None:
            self.engine.check_invariants()

    def teardown(self):
        if self.engine is None:
            return
        for _ in range(200):
            if not (self.engine.waiting or self.engine.running):
                break
            self.record(self.engine.step())
            self.engine.check_invariants()
        assert self.done == set(self.prompts), "a request was lost"
        for uid, prompt in self.prompts.items():
            want = solo(self.family, tuple(prompt), self.max_tokens[uid])
            if uid in self.aborted:  # what came out before the abort
                want = want[: len(self.out[uid])]
            assert self.out[uid] == want, f"request {uid} diverged"


EngineMachine.TestCase.settings = settings(
    max_examples=25,
    stateful_step_count=20,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_engine_machine = EngineMachine.TestCase


def test_peak_live_blocks_counts_requests_that_finish_at_once():
    engine = PagedEngine(model_of("llama"), block_size=BS)
    engine.generate([[1, 2, 3] * 5, [4, 5] * 7], max_tokens=1)  # 2 blocks each
    stats = engine.stats()
    assert (stats.peak_live_blocks, stats.live_blocks) == (4, 0)


@pytest.mark.parametrize("make", [list, tuple, lambda t: [np.int64(x) for x in t]])
def test_token_ids_of_any_int_type_are_kept_as_a_list_of_plain_ints(make):
    engine = PagedEngine(model_of("llama"), block_size=BS)
    given = make([3, 1, VOCAB - 1])
    uid = engine.add_request(given, 2)
    (req,) = [r for r in engine.waiting if r.uid == uid]
    assert req.prompt == [3, 1, VOCAB - 1] and all(type(t) is int for t in req.prompt)
    assert req.prompt is not given  # the engine's own copy


@pytest.mark.parametrize(
    "bad", [[1, VOCAB], [-1, 2], [1.5], ["7"], [True], [2**40], [3, 2**64], [2, 3.0, 4]]
)
def test_token_ids_outside_the_vocabulary_are_refused(bad):
    engine = PagedEngine(model_of("llama"), block_size=BS)
    with pytest.raises(ValueError, match="token 0|token 1"):
        engine.add_request(bad, 4)
    assert not engine.waiting and engine.stats().prompt_tokens == 0


@pytest.mark.parametrize("overlap", [True, False])
def test_abort_frees_blocks_and_spares_the_others(overlap):
    engine = PagedEngine(model_of("llama"), block_size=BS, max_batch_size=2, overlap=overlap)
    prompts = mixed_prompts(seed=6)[:3]
    uids = [engine.add_request(p, MAX_TOKENS) for p in prompts]
    events: dict[int, list[int]] = {u: [] for u in uids}
    for _ in range(3):
        for e in engine.step():
            events[e.uid].append(e.token)
    assert [r.uid for r in engine.running] == uids[:2] and [r.uid for r in engine.waiting] == [2]
    assert engine.abort(uids[0]) and engine.abort(uids[2])  # one running, one waiting
    assert not engine.abort(uids[0]) and not engine.abort(12345)
    engine.check_invariants()
    for e in engine.stream():
        events[e.uid].append(e.token)
    # The first step samples a first token and decodes one more; none come after the abort,
    # not even the one an overlapped step had in flight.
    assert len(events[uids[0]]) == (3 if overlap else 4) and events[uids[2]] == []
    assert events[uids[1]] == solo("llama", tuple(prompts[1]))
    stats = engine.stats()
    assert (stats.aborted, stats.live_blocks, stats.running, stats.waiting) == (2, 0, 0, 0)
    engine.check_invariants()


def test_a_failing_request_ends_alone():
    engine = PagedEngine(model_of("qwen3"), block_size=BS)
    prompts = mixed_prompts(seed=7)[:3]

    def boom(tokens, logits):
        raise RuntimeError("processor bug")

    uids = [
        engine.add_request(prompts[0], MAX_TOKENS, logits_processors=[boom]),
        engine.add_request(prompts[1], MAX_TOKENS),
        engine.add_request(prompts[2], MAX_TOKENS, sampler=lambda lp: mx.array([VOCAB + 5])),
    ]
    events: dict[int, list[Event]] = {u: [] for u in uids}
    for e in engine.stream():
        events[e.uid].append(e)
    for uid, why in ((uids[0], "processor bug"), (uids[2], "not a token id")):
        (only,) = events[uid]
        assert only.finish_reason == "error" and only.token == -1 and why in only.error
    assert [e.token for e in events[uids[1]]] == solo("qwen3", tuple(prompts[1]))
    stats = engine.stats()
    assert (stats.failed, stats.live_blocks, stats.running) == (2, 0, 0)
    engine.check_invariants()


def test_logprobs_match_mlx_lm_and_prefix_hits_are_per_request():
    model = model_of("llama")
    prompt = mixed_prompts(seed=8)[0]
    want = list(generate_step(mx.array(prompt), model, max_tokens=5))
    engine = PagedEngine(model, block_size=BS)
    first = engine.add_request(prompt, 5, logprobs=3)
    req = engine.request(first)
    got = list(engine.stream())
    assert [e.token for e in got] == [t for t, _ in want]
    for e, (t, lp) in zip(got, want, strict=True):
        assert abs(e.logprob - lp[t].item()) < 1e-4
        assert [i for i, _ in e.top_logprobs] == mx.argsort(-lp)[:3].tolist()
        values = [v for _, v in e.top_logprobs]
        assert values == sorted(values, reverse=True) and values[0] >= e.logprob
    again = engine.request(engine.add_request(prompt, 2))
    list(engine.stream())
    assert req.prefix_hit == 0
    # The whole prompt but its last token is served from the index, in whole blocks
    # or a copied partial tail.
    assert again.prefix_hit == len(prompt) - 1
    assert engine.stats().prompt_tokens == 2 * len(prompt)


def test_logits_processors_overlap_and_see_the_token_in_flight():
    """mlx-lm's repetition penalty reads each request's tokens: overlapped, its history ends
    with the token still on the device, and the text is what mlx-lm generates."""
    from mlx_lm.sample_utils import make_logits_processors

    prompts = mixed_prompts(seed=16)[:3]
    model = model_of("llama")

    def penalty():
        return make_logits_processors(repetition_penalty=1.8, repetition_context_size=8)

    steps = [generate_step(mx.array(p), model, max_tokens=8, logits_processors=penalty())
             for p in prompts]  # fmt: skip
    want = [[t for t, _ in s] for s in steps]

    def after_last(tokens, logits):  # forces the token after the last one
        nxt = (tokens[-1] + 1) % logits.shape[-1]
        return mx.where(mx.arange(logits.shape[-1]) == nxt, 1e9, logits)

    for overlap in (True, False):
        engine = PagedEngine(model, block_size=BS, overlap=overlap)
        uids = [engine.add_request(p, 8, logits_processors=penalty()) for p in prompts[:2]]
        uids.append(engine.add_request(prompts[2], 8, logits_processors=penalty(), logprobs=1))
        counting = engine.add_request(prompts[0], 6, logits_processors=[after_last])
        first = engine.step()
        assert len(first) == (4 if overlap else 8)
        out: dict[int, list[int]] = {u: [] for u in [*uids, counting]}
        for e in [*first, *engine.stream()]:
            out[e.uid].append(e.token)
        assert [out[u] for u in uids] == want
        assert out[counting] == [(prompts[0][-1] + k) % VOCAB for k in range(1, 7)]
        engine.check_invariants()


def test_log_probs_overlap_and_match_step_by_step_and_mlx_lm():
    """Requests asking for 0, 2 or 5 top log-probs in one batch with plain ones: their picks
    and log-probs come out of one lazy vector, overlapped, as they would step by step."""
    prompts = mixed_prompts(seed=15)[:4]
    asks = [0, 2, None, 5]
    runs = []
    for overlap in (True, False):
        engine = PagedEngine(model_of("llama"), block_size=BS, overlap=overlap)
        uids = [engine.add_request(p, 6, logprobs=k) for p, k in zip(prompts, asks, strict=True)]
        first = engine.step()
        assert len(first) == (4 if overlap else 8)  # overlapped: the decode still in flight
        events: dict[int, list[Event]] = {u: [] for u in uids}
        for e in [*first, *engine.stream()]:
            events[e.uid].append(e)
        runs.append([events[u] for u in uids])
    for a, b in zip(*runs, strict=True):
        assert [e.token for e in a] == [e.token for e in b]
        assert [e.top_logprobs and [i for i, _ in e.top_logprobs] for e in a] == [
            e.top_logprobs and [i for i, _ in e.top_logprobs] for e in b
        ]
        for x, y in zip(a, b, strict=True):
            assert (x.logprob is None) == (y.logprob is None)
            assert x.logprob is None or abs(x.logprob - y.logprob) < 1e-5
    want = list(generate_step(mx.array(prompts[3]), model_of("llama"), max_tokens=6))
    for e, (t, lp) in zip(runs[0][3], want, strict=True):
        assert e.token == t and abs(e.logprob - lp[t].item()) < 1e-4
        assert [i for i, _ in e.top_logprobs] == mx.argsort(-lp)[:5].tolist()
    assert all(e.top_logprobs == () for e in runs[0][0])
    assert all(len(e.top_logprobs) == 2 for e in runs[0][1])
    assert all(e.logprob is None and e.top_logprobs is None for e in runs[0][2])


@pytest.mark.parametrize("overlap", [True, False])
def test_first_tokens_are_told_before_the_steps_decode(overlap):
    engine = PagedEngine(model_of("llama"), block_size=BS, overlap=overlap)
    prompts = mixed_prompts(seed=9)[:2]
    first = engine.add_request(prompts[0], MAX_TOKENS)
    engine.step()
    second = engine.add_request(prompts[1], MAX_TOKENS)
    heard: list[tuple[Event, int]] = []
    # What the model has run when each event is heard: the decode forward comes last. An
    # overlapped step tells the previous decode's token once its own decode is dispatched.
    returned = engine.step(on_event=lambda e: heard.append((e, engine.stats().generated_tokens)))
    assert [e for e, _ in heard] == returned
    if overlap:
        assert [(e.uid, n) for e, n in heard] == [(second, 2), (first, 3)]
        assert [e.uid for e in engine.step()] == [first, second]  # this step's, read next step
    else:
        assert [(e.uid, n) for e, n in heard] == [(second, 3), (first, 5), (second, 5)]


def test_warm_up_leaves_the_engine_as_good_as_new(monkeypatch):
    from mlx_paged.engine import warmup
    from mlx_paged.engine.warmup import warm_up

    prebuilt = []
    monkeypatch.setattr(warmup, "prebuild_kernels", lambda: prebuilt.append(1) or 0)
    engine = PagedEngine(model_of("llama"), block_size=BS, max_batch_size=4)
    decode, batch_sizes = engine.runner.decode, []

    def recording(reqs, tokens=None):
        batch_sizes.append(len(reqs))
        return decode(reqs, tokens)

    engine.runner.decode = recording
    forward, padded = engine.runner.forward, []

    def spy(reqs, n, logits=False, counts=None, wait=True):
        padded.append(counts is not None and len(set(counts)) > 1)
        return forward(reqs, n, logits, counts, wait)

    engine.runner.forward = spy
    picks: list[int] = []
    assert warm_up(engine, sampler=SharedSampler("warm", picks)) > 0
    assert batch_sizes == [4, 3, 2, 1], "the burst decodes once at every batch size"
    assert 2 in picks, "two requests of the burst sample, in one call a step"
    assert any(padded), "the burst's suffixes share a padded forward, as a real burst's do"
    assert prebuilt == [1], "the kernels' layouts for longer contexts are built once"
    engine.runner.decode, engine.runner.forward = decode, forward
    stats = engine.stats()
    assert stats.prompt_tokens == stats.generated_tokens == stats.prefix_hit_tokens == 0
    assert stats.live_blocks == stats.cached_blocks == stats.peak_live_blocks == 0
    engine.check_invariants()
    prompts = mixed_prompts(seed=7)[:4]
    for prompt, got in zip(prompts, run_all(engine, prompts), strict=True):
        assert got == solo("llama", tuple(prompt))
    for bad in ([0], [5], [True], [1.5]):
        with pytest.raises(ValueError, match="warm-up batch sizes"):
            warm_up(engine, bad)


def test_warm_up_runs_a_full_prefill_chunk_and_a_full_batched_forward():
    """The shapes a long prompt and a large burst bring: a chunk of ``prefill_step_size``
    alone, and a batched forward of close to ``prefill_batch_tokens``."""
    from mlx_paged.engine.warmup import warm_up

    engine = PagedEngine(
        model_of("llama"),
        block_size=BS,
        max_batch_size=4,
        prefill_step_size=48,
        prefill_batch_tokens=40,
    )
    runner = engine.runner
    prefill, forward, alone, batched = runner.prefill, runner.forward, [], []

    def spy_prefill(req, n, logits=False):
        alone.append(n)
        return prefill(req, n, logits)

    def spy_forward(reqs, n, logits=False, counts=None, wait=True):
        batched.append(sum(counts) if counts is not None else len(reqs) * n)
        return forward(reqs, n, logits, counts, wait)

    runner.prefill, runner.forward = spy_prefill, spy_forward
    warm_up(engine)
    runner.prefill, runner.forward = prefill, forward
    assert max(alone) == 48, "a long prompt's first chunk, prefill_step_size wide"
    assert 40 - 4 < max(batched) <= 40, "a burst's suffixes fill one batched forward"
    engine.check_invariants()
    assert engine.stats().live_blocks == 0


def test_warm_up_leaves_out_a_long_prompt_the_pool_cannot_hold():
    from mlx_paged.engine.warmup import warm_up

    engine = PagedEngine(
        model_of("llama"), block_size=BS, max_batch_size=2, num_blocks=24, prefill_step_size=512
    )
    assert warm_up(engine) > 0
    engine.check_invariants()
