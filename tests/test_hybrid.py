"""PagedEngine on hybrid and pure recurrent models against mlx-lm's own caches.

Each family's recurrent layers keep mlx-lm's ``ArraysCache`` state; the engine
holds it in slots and reuses prefixes through snapshots of it.
"""

from __future__ import annotations

import random

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import ArraysCache, CacheList, make_prompt_cache
from tiny_models import HYBRIDS, MORE_HYBRIDS, RECURRENT_ONLY, VOCAB, model_of, record_forwards
from tiny_models import solo as dense_solo

from mlx_paged import PagedEngine
from mlx_paged.cache import PagedLayout
from mlx_paged.engine import prefilling, recurrent
from mlx_paged.engine.engine import MIN_STATE_SNAPSHOTS

BS = 8
INTERVAL = 16  # two blocks
MAX_TOKENS = 8
FAMILIES = HYBRIDS + RECURRENT_ONLY


def solo(family: str, prompt: tuple[int, ...], max_tokens: int = MAX_TOKENS) -> list[int]:
    """Greedy tokens of one request alone, on mlx-lm's own caches."""
    return dense_solo(family, prompt, max_tokens)


def toks(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(n)]


def engine_of(family: str, **kw) -> PagedEngine:
    kw = {"block_size": BS, "state_snapshot_interval": INTERVAL, "max_batch_size": 8, **kw}
    return PagedEngine(model_of(family), **kw)


def run(engine: PagedEngine, prompts, max_tokens=MAX_TOKENS, each_step=None):
    """Add ``prompts``, step to the end checking invariants; return tokens per prompt."""
    return run_requests(engine, prompts, max_tokens, each_step)[1]


def run_requests(engine: PagedEngine, prompts, max_tokens=MAX_TOKENS, each_step=None):
    """``run``, also returning the requests (added at once, in order)."""
    uids = [engine.add_request(p, max_tokens) for p in prompts]
    reqs = [engine.request(u) for u in uids]
    out: dict[int, list[int]] = {u: [] for u in uids}
    while engine.waiting or engine.running:
        for e in engine.step():
            out[e.uid].append(e.token)
        engine.check_invariants()
        if each_step is not None:
            each_step(engine)
    return reqs, [out[u] for u in uids]


def assert_idle(engine: PagedEngine) -> None:
    """Nothing running holds a block or a slot; the index holds every snapshot."""
    s = engine.stats()
    assert (s.running, s.live_blocks, s.state_slots_used) == (0, 0, 0)
    assert s.state_snapshots == len(engine.scheduler.index.snapshots)
    engine.check_invariants()


@pytest.mark.parametrize("family", FAMILIES)
def test_mixed_batch_equals_dense(family):
    rng = random.Random(1)
    system = toks(rng, 21)  # ends mid-block, shared by three
    prompts = [system + toks(rng, 5), system + toks(rng, 14), system, toks(rng, 3), toks(rng, 40)]
    engine = engine_of(family)
    assert run(engine, prompts) == [solo(family, tuple(p)) for p in prompts]
    assert_idle(engine)
    assert engine.stats().state_snapshots > 0


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("budget, alone", [(16, True), (64, False)])
def test_shared_prefix_adopts_the_last_snapshot_at_or_below_it(family, budget, alone):
    rng = random.Random(2)
    shared = toks(rng, 2 * INTERVAL + 13)  # 45: snapshots at 16 and 32 lie inside it
    prompts = [shared + toks(rng, n) for n in (10, 2, 3, 2, 1)]
    engine = engine_of(family, prefill_batch_tokens=budget)
    reqs, got = run_requests(engine, prompts)
    # The second adopts the snapshot at 32 and finds the first's blocks up to 40 (the last
    # whole block of the shared prefix). Left to batch, the three behind it would recompute
    # 3 x 8 tokens: over a 16-token budget it goes alone and snapshots 40 first, which they
    # adopt; within 64 they batch with it from 32 (each still snapshots at 40).
    behind = 40 if alone else 2 * INTERVAL
    assert [r.prefix_hit for r in reqs] == [0, 2 * INTERVAL, behind, behind, behind]
    assert got == [solo(family, tuple(p)) for p in prompts]
    cached = 2 * INTERVAL + 3 * behind
    assert engine.stats().prefilled_tokens == sum(map(len, prompts)) - cached
    assert_idle(engine)


@pytest.mark.parametrize("family", FAMILIES)
def test_second_chat_turn_prefills_only_its_new_tokens(family):
    rng = random.Random(3)
    turn1 = toks(rng, 19)
    engine = engine_of(family)
    (answer,) = run(engine, [turn1])
    turn2 = turn1 + answer + toks(rng, 7)
    before = engine.stats().prefilled_tokens
    uid = engine.add_request(turn2, MAX_TOKENS)
    req = engine.request(uid)
    got = [e.token for e in engine.stream()]
    written = len(turn1) + len(answer) - 1  # the last answer token was never fed back
    assert req.prefix_hit == written
    assert engine.stats().prefilled_tokens - before == len(turn2) - written
    assert got == solo(family, tuple(turn2))
    assert_idle(engine)


@pytest.mark.parametrize("family", FAMILIES)
def test_preemption_in_a_small_pool_keeps_tokens(family):
    rng = random.Random(4)
    prompts = [toks(rng, n) for n in (20, 13, 27, 9)]
    engine = engine_of(family, num_blocks=8)  # the longest request needs 6 (27 + 16 tokens)
    assert run(engine, prompts, max_tokens=16) == [solo(family, tuple(p), 16) for p in prompts]
    assert engine.stats().preemptions > 0
    assert_idle(engine)


@pytest.mark.parametrize("family", FAMILIES)
def test_abort_frees_the_slot_and_leaves_the_others_alone(family):
    rng = random.Random(5)
    prompts = [toks(rng, n) for n in (11, 30, 6)]
    # Three slots for three requests: decode reads and writes the whole state arrays
    # (slots 0, 1, 2 in order); once the middle one leaves, it gathers slots 0 and 2.
    engine = engine_of(family, max_batch_size=3)
    uids = [engine.add_request(p, MAX_TOKENS) for p in prompts]
    out = {u: [] for u in uids}
    for _ in range(3):
        for e in engine.step():
            out[e.uid].append(e.token)
    assert engine.abort(uids[1])
    assert engine.stats().state_slots_used == 2
    engine.check_invariants()
    for e in engine.stream():
        out[e.uid].append(e.token)
        engine.check_invariants()
    for u, p in zip((uids[0], uids[2]), (prompts[0], prompts[2]), strict=True):
        assert out[u] == solo(family, tuple(p))
    assert out[uids[1]] == solo(family, tuple(prompts[1]))[: len(out[uids[1]])]
    assert_idle(engine)


@pytest.mark.parametrize("family", ["qwen3_5", "mamba2"])
def test_snapshot_cap_evicts_and_keeps_tokens(family):
    rng = random.Random(6)
    system = toks(rng, 40)
    prompts = [system + toks(rng, n) for n in (3, 9, 17)] + [toks(rng, 25)]

    def capped(engine):
        assert engine.stats().state_snapshots <= 3

    engine = engine_of(family, num_state_snapshots=3)
    assert run(engine, prompts, each_step=capped) == [solo(family, tuple(p)) for p in prompts]
    assert engine.stats().state_snapshots == 3
    assert_idle(engine)


def test_one_stream_at_a_time_adopts_the_shared_prefix_by_default():
    """``max_batch_size=1`` (a server at one stream): each request leaves three snapshots
    (an interval inside the shared prefix, its last whole block, its end), so a cap of
    ``2 * max_batch_size`` evicted the shared one before the next request came. The
    default keeps at least ``MIN_STATE_SNAPSHOTS``."""
    rng = random.Random(9)
    shared = toks(rng, INTERVAL + 5)
    engine = engine_of("qwen3_5", max_batch_size=1)
    hits = []
    for n in (6, 9, 4):
        reqs, _ = run_requests(engine, [shared + toks(rng, n)])
        hits.append(reqs[0].prefix_hit)
    assert hits == [0, INTERVAL, INTERVAL]
    assert engine.scheduler.recurrent.slots.num_snapshots == MIN_STATE_SNAPSHOTS
    assert_idle(engine)


@pytest.mark.parametrize("family", ["qwen3_5", "falcon_h1"])
def test_a_snapshot_holds_the_dense_state_at_its_position(family):
    rng = random.Random(7)
    prompt = toks(rng, 3 * INTERVAL + 5)
    engine = engine_of(family)
    run(engine, [prompt], max_tokens=1)
    match = engine.scheduler.index.match(prompt[: 2 * INTERVAL] + [0])
    assert match.length == 2 * INTERVAL
    saved = engine.runner.states.snapshot_state(match.snapshot)

    model = model_of(family)
    dense = make_prompt_cache(model)
    mx.eval(model(mx.array(prompt[: 2 * INTERVAL])[None], cache=dense))
    flat = []
    for c in dense:
        flat += [x for x in getattr(c, "caches", [c]) if isinstance(x, ArraysCache)]
    assert len(flat) == len(saved)
    for layer, (want, got) in enumerate(zip(flat, saved, strict=True)):
        for e, (w, g) in enumerate(zip(want.cache, got, strict=True)):
            assert g.shape == w.shape, f"layer {layer} entry {e}"
            # Chunked prefill sums the SSM scan in another order: float32 rounding only.
            assert mx.allclose(g, w, rtol=1e-4, atol=1e-5).item(), f"layer {layer} entry {e}"


@pytest.mark.parametrize("cuda", [True, False])
def test_a_cut_close_to_the_last_costs_no_forward_of_its_own_on_cuda(cuda, monkeypatch):
    """On CUDA, prefill forwards end at snapshot cuts only ``interval // SPAN_FRACTION``
    tokens or more past the last stop: a shared stretch of one block past the adopted
    snapshot is recomputed by later requests rather than cut into a forward of its own.
    Elsewhere every cut ends a forward."""
    monkeypatch.setattr(prefilling, "on_cuda", lambda: cuda)
    interval = 64  # on CUDA, cuts at least 16 tokens apart
    assert interval // recurrent.SPAN_FRACTION == 2 * BS
    rng = random.Random(11)
    a = toks(rng, 70)
    b = a[:24] + toks(rng, 30)  # shares 3 blocks of a past no snapshot
    c = b[:32] + toks(rng, 20)  # shares 4 blocks of b, one past b's snapshot at 24
    engine = engine_of("qwen3_5", state_snapshot_interval=interval)
    calls = record_forwards(engine, monkeypatch)
    hits, steps = [], []
    for prompt in (a, b, c):
        reqs, got = run_requests(engine, [prompt])
        assert got == [solo("qwen3_5", tuple(prompt))]
        hits.append(reqs[0].prefix_hit)
        steps.append([n for n, _ in calls])
        calls.clear()
    assert hits == [0, 0, 24]
    # a: the interval and its last full block (64); b: where it stops sharing a's blocks
    # (24) and its last full block (48); c on CUDA: from b's snapshot at 24 straight to
    # 48, not stopping at 32 where it stops sharing b's blocks (8 tokens on).
    assert steps == [[64, 6], [24, 24, 6], [24, 4] if cuda else [8, 16, 4]]
    index = engine.scheduler.index
    assert index.match(c[:48] + [0]).length == 48
    assert index.match(c[:32] + [0]).length == (24 if cuda else 32)
    assert_idle(engine)


@pytest.mark.parametrize("cuda", [True, False])
def test_the_warm_up_burst_adopts_a_snapshot_as_a_real_burst_does(cuda, monkeypatch):
    """A hybrid's warm-up burst shares a prefix long enough that a snapshot is kept at its
    end on CUDA too (``min_span`` tokens, in whole blocks), so its other requests adopt it
    and prefill their suffixes together in one padded forward: the path, and so the
    kernels, of a real burst at a cached system prompt."""
    from mlx_paged.engine import warmup

    monkeypatch.setattr(prefilling, "on_cuda", lambda: cuda)
    monkeypatch.setattr(warmup, "prebuild_kernels", lambda: 0)
    engine = engine_of("qwen3_5", state_snapshot_interval=512, max_batch_size=6)
    states = engine.scheduler.recurrent
    assert states.min_span == (128 if cuda else 1)
    attach, adopted = states.attach, []

    def spy(req, match, target):
        attach(req, match, target)
        adopted.append(match.length if match is not None and match.snapshot is not None else 0)

    monkeypatch.setattr(states, "attach", spy)
    calls = record_forwards(engine, monkeypatch)
    warmup.warm_up(engine)
    prefix = 128 if cuda else 2 * BS
    assert adopted[:6] == [0] + [prefix] * 5, "the first burst's others adopt its prefix"
    assert calls[0] == (BS, (5, 6, 6, 7, 8)), "their suffixes in one padded forward"
    engine.check_invariants()
    prompt = toks(random.Random(3), 40)
    assert run(engine, [prompt]) == [solo("qwen3_5", tuple(prompt))]


def test_bad_snapshot_settings_are_value_errors():
    for interval in (0, 12, -16, 16.0, True):
        with pytest.raises(ValueError, match="multiple of block_size"):
            engine_of("lfm2", state_snapshot_interval=interval)
    with pytest.raises(ValueError, match="num_state_snapshots"):
        engine_of("lfm2", num_state_snapshots=0)
    engine = PagedEngine(model_of("lfm2"), block_size=24)
    assert engine.scheduler.recurrent.interval == 504, "the default is a multiple of block_size"


@pytest.mark.gpu
@pytest.mark.skipif(not mx.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("family", ["qwen3_5", "falcon_h1", "mamba2"])
def test_engine_on_the_gpu_equals_dense_on_the_gpu(family):
    """The state slots and the CUDA paged kernels together, against mlx-lm's caches on the
    same GPU (conftest turns TF32 off)."""
    rng = random.Random(8)
    system = toks(rng, 21)
    prompts = [system + toks(rng, 5), system + toks(rng, 14), toks(rng, 40), system]
    model = model_of(family)
    got = run(engine_of(family, max_batch_size=3), prompts)
    gpu = mx.new_stream(mx.gpu)
    for prompt, tokens in zip(prompts, got, strict=True):
        cache = make_prompt_cache(model)
        solo = generate_step(
            mx.array(prompt), model, prompt_cache=cache, max_tokens=MAX_TOKENS, stream=gpu
        )
        assert tokens == [tok for tok, _ in solo]


#: The families whose recurrent layers keep their state over right padding.
PADDED = ["lfm2", "qwen3_5", "qwen3_next", "granitemoehybrid", "falcon_h1", "mamba2"]
PADDED += ["lfm2_moe", "plamo2", "kimi_linear", "bailing_moe_v3", "gear", "bailing_hybrid"]
PADDED += ["kimi_k3", "qwen3_5_moe"]


@pytest.mark.parametrize("family", FAMILIES + list(MORE_HYBRIDS))
def test_which_families_keep_their_state_over_right_padding(family):
    assert PagedLayout.of(model_of(family)).padded_states == (family in PADDED)


@pytest.mark.parametrize("family", PADDED)
def test_padded_families_leave_each_rows_state_at_its_last_real_token(family):
    """Rows of 3-6 real tokens padded on the right to 6 through mlx-lm's own caches, the
    recurrent ones given ``lengths``: every state entry of row ``i`` equals the state of
    row ``i``'s real tokens run alone (after a shared 10-token start)."""
    model = model_of(family)
    rng = random.Random(7)
    start, counts = toks(rng, 10), [3, 4, 5, 6]
    rows = [toks(rng, c) + [0] * (6 - c) for c in counts]
    batch = make_prompt_cache(model)
    alone = []
    for row, c in zip(rows, counts, strict=True):
        cache = make_prompt_cache(model)
        model(mx.array([start + row[:c]]), cache=cache)
        alone.append(cache)
    model(mx.array([start] * len(rows)), cache=batch)
    for cache in recurrent_caches(batch):
        cache.lengths = mx.array(counts)
    model(mx.array(rows), cache=batch)
    states = [recurrent_caches(c) for c in [batch, *alone]]
    assert states[0]
    for layer, got in enumerate(states[0]):
        for e, rows_got in enumerate(got.cache):
            for r, own in enumerate(states[1:]):
                want = own[layer].cache[e]
                assert mx.allclose(rows_got[r : r + 1], want, atol=1e-4), (layer, e, r)


def recurrent_caches(caches: list) -> list[ArraysCache]:
    """The ``ArraysCache`` objects of a model's cache list, in order (within ``CacheList``s
    too)."""
    flat = [c for x in caches for c in (x.caches if isinstance(x, CacheList) else [x])]
    return [c for c in flat if isinstance(c, ArraysCache)]


@pytest.mark.parametrize("family", FAMILIES + list(MORE_HYBRIDS))
def test_a_bursts_suffixes_of_different_lengths_share_padded_forwards(family, monkeypatch):
    """Four requests behind a cached 32-token prefix, with suffixes of 11-14 tokens: each
    prefill stops at its last full block (40) to snapshot, then runs its 3-6 token tail.
    Where the family keeps its state over right padding, the four share both forwards,
    the second padded; elsewhere each runs its own. Each generates what it would alone."""
    rng = random.Random(4)
    system = toks(rng, 2 * INTERVAL)
    prompts = [system + toks(rng, k) for k in (11, 12, 13, 14)]
    engine = engine_of(family)
    run(engine, [system], max_tokens=1)  # caches the prefix, with a snapshot at its end
    calls = record_forwards(engine, monkeypatch)
    reqs, got = run_requests(engine, prompts)
    assert [r.prefix_hit for r in reqs] == [2 * INTERVAL] * 4
    if family in PADDED:
        assert calls == [(8, (8, 8, 8, 8)), (6, (3, 4, 5, 6))]
    else:
        assert calls == [(8, None), (3, None), (8, None), (4, None)] + [
            (8, None),
            (5, None),
            (8, None),
            (6, None),
        ]
    assert got == [solo(family, tuple(p)) for p in prompts]
    assert_idle(engine)
