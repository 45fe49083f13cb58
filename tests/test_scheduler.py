"""The scheduler on pure-Python block tables: admission, prefix adoption, preemption, finishing.

No model and no MLX: a stand-in runner does what the model runner does to the
tables (reserve the written span, advance every layer's length), so each test
checks exact block ids, refcounts and queue states in milliseconds.
"""

from __future__ import annotations

import pickle

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlx_paged.blocks import BlockTables, LayerKind
from mlx_paged.engine.prefills import batched_prefills
from mlx_paged.engine.request import Prefill, Request
from mlx_paged.engine.scheduler import Scheduler

BS = 4  # block size
FULL = LayerKind()


def make(num_blocks=None, max_batch_size=8, prefill_step_size=64, layers=2, budget=None):
    groups = {FULL: BlockTables(layers, BS, num_blocks)}
    return Scheduler(groups, max_batch_size, prefill_step_size, budget)


def request(uid, prompt, max_tokens=4, stop=()):
    return Request(uid, list(prompt), max_tokens, None, [], frozenset(stop))


def write(sched, req, n):
    """What a forward over ``n`` more tokens of ``req`` does to its tables."""
    for kind, group in sched.groups.items():
        t = req.tables[kind]
        start = t.lengths[0]
        group.reserve(t, start, start + n)
        t.lengths[:] = [start + n] * group.num_layers


def run_prefill(sched, work: Prefill):
    for k, n in enumerate(work.steps):
        for i, req in enumerate(work.requests):
            write(sched, req, n if work.counts is None else work.counts[k][i])
            sched.index_written(req)
        sched.check_invariants()


def step(sched, token=7):
    """One engine step with a stand-in model that always samples ``token``."""
    events = []
    for work in sched.admit():
        run_prefill(sched, work)
        if work.fresh:
            events += [sched.emit(r, token) for r in work.requests]
    if sched.running:
        reqs = sched.schedule_decode()
        for r in reqs:
            r.tables[FULL].lengths[:] = [r.tables[FULL].lengths[0] + 1] * 2
        events += [sched.emit(r, token) for r in reqs]
    sched.check_invariants()
    return events


def refcounts(sched):
    return sched.groups[FULL].blocks.refcounts


def test_chunked_prefill_steps_end_with_the_last_token():
    sched = make(prefill_step_size=16)
    sched.add(request(0, range(40)))
    (work,) = list(sched.admit())
    assert work.alone and work.fresh
    assert work.steps == [16, 16, 8]  # the first token comes from the last chunk's logits
    assert sched.counters["prefilled_tokens"] == 40


def test_prompts_over_the_batch_tokens_go_alone_in_whole_steps_and_short_ones_batch():
    groups = {FULL: BlockTables(2, BS, None)}
    sched = Scheduler(groups, 8, 64, prefill_batch_tokens=16)
    sched.add(request(0, range(40)))  # over 16 tokens: alone, one forward of 40 (<= 64)
    for uid in (1, 2, 3):  # 8 distinct tokens each: two share a 16-token forward
        sched.add(request(uid, range(100 * uid, 100 * uid + 8)))
    works = list(sched.admit())
    assert [(w.alone, [r.uid for r in w.requests], w.steps) for w in works] == [
        (True, [0], [40]),
        (False, [1, 2], [8]),
        (False, [3], [8]),
    ]
    assert Scheduler(groups, 8, 12, prefill_batch_tokens=16).prefill_batch_tokens == 12
    assert Scheduler(groups, 8, 2048).prefill_batch_tokens == 512


def test_a_prefill_budget_admits_per_step_and_running_requests_decode_between():
    sched = make(budget=20)
    for uid in range(5):
        sched.add(request(uid, range(10 * uid + 1, 10 * uid + 11), max_tokens=8))
    running, generated = [], []
    for _ in range(3):
        step(sched)
        running.append([r.uid for r in sched.running])
        generated.append([len(r.generated) for r in sched.running])
    # 20 tokens a step: two 10-token prompts; everyone running decodes every step.
    assert running == [[0, 1], [0, 1, 2, 3], [0, 1, 2, 3, 4]]
    assert generated == [[2, 2], [3, 3, 2, 2], [4, 4, 3, 3, 2]]
    assert sched.counters["prefilled_tokens"] == 50


def test_a_prompt_over_the_budget_is_still_admitted_alone():
    sched = make(budget=8)
    sched.add(request(0, range(30)))
    sched.add(request(1, range(100, 104)))
    step(sched)
    assert [r.uid for r in sched.running] == [0] and [r.uid for r in sched.waiting] == [1]
    step(sched)
    assert [r.uid for r in sched.running] == [0, 1]


def test_short_prompts_share_padded_forwards_with_blocks_reserved_at_admission():
    sched = make()  # 64 tokens per forward, padding included
    for uid, prompt in enumerate([[1, 2, 3, 4, 5], [9, 8, 7, 6, 5], [3, 3, 3]]):
        sched.add(request(uid, prompt))
    works = list(sched.admit())
    assert [([r.uid for r in w.requests], w.steps, w.counts, w.alone) for w in works] == [
        ([2, 0, 1], [5], ((3, 5, 5),), False),
    ]
    # Admission order took the blocks: 2 per 5-token prompt, 1 for the 3-token one.
    assert [r.tables[FULL].blocks for r in sched.running] == [[0, 1], [2, 3], [4]]
    assert refcounts(sched) == [1, 1, 1, 1, 1]  # the growable pool holds just these


def test_padded_forwards_group_lengths_alike_within_the_token_budget():
    sched = make()  # 64 tokens per forward, padding included
    for uid, n in enumerate([5, 40, 3, 30, 2, 2, 4, 28]):
        sched.add(request(uid, [uid + 1] * n))
    works = [([r.uid for r in w.requests], w.steps, w.counts) for w in sched.admit()]
    # Shortest first. 2, 2, 3 pad 2 of 9 tokens; a 4 would make 4 of 16 padding (at most a
    # quarter may be), so 4 and 5 go on; two rows of 30 fit 64 tokens; 40 goes alone.
    assert works == [
        ([4, 5, 2], [3], ((2, 2, 3),)),
        ([6, 0], [5], ((4, 5),)),
        ([7, 3], [30], ((28, 30),)),
        ([1], [40], None),
    ]
    for work in sched.admit():
        raise AssertionError(f"admitted twice: {work}")


def test_a_request_behind_adopts_the_prefix_its_neighbour_just_wrote():
    sched = make()
    shared = list(range(100, 110))  # two full blocks and half of a third
    sched.add(request(0, shared + [1, 2]))
    sched.add(request(1, shared + [3, 4, 5]))
    admitted = sched.admit()
    first = next(admitted)
    # Request 1 starts with the same block, so request 0 is prefilled alone, first.
    assert first.alone and [r.uid for r in first.requests] == [0]
    run_prefill(sched, first)
    assert sched.running[0].tables[FULL].blocks == [0, 1, 2]
    second = next(admitted)
    a, b = sched.running
    # Request 1 adopted all 10 shared tokens: blocks 0 and 1, and half of block 2, which
    # it copied on write (block 3) before its own tokens go in; block 4 is new.
    assert b.written == 10 and sched.counters["prefix_hit_tokens"] == 10
    assert b.tables[FULL].blocks == [0, 1, 3, 4]
    assert second.steps == [3] and second.counts is None and not second.alone
    # Blocks 0 and 1: both tables and the index; block 2: request 0 and the index.
    assert refcounts(sched)[:5] == [3, 3, 2, 1, 1]
    assert list(admitted) == []


def test_finished_requests_park_their_blocks_for_the_next_one():
    sched = make()
    sched.add(request(0, range(8), max_tokens=2))
    while sched.running or sched.waiting:
        step(sched)
    stats = sched.stats()
    assert (stats.live_blocks, stats.cached_blocks) == (0, 3)
    sched.add(request(1, list(range(8)) + [7, 7, 0]))
    (work,) = list(sched.admit())
    (req,) = work.requests
    # Everything the first request computed: its prompt and first sampled token (7).
    assert req.written == 9
    assert req.tables[FULL].blocks == [0, 1, 3]  # the partial block 2 copied on write


def test_stop_token_and_max_tokens_finish():
    sched = make()
    sched.add(request(0, [1, 2, 3], max_tokens=5, stop={7}))
    sched.add(request(1, [4, 5, 6, 9], max_tokens=1))
    events = step(sched, token=7)
    assert {(e.uid, e.finish_reason) for e in events} == {(0, "stop"), (1, "length")}
    assert not sched.running and not sched.waiting
    assert sched.stats().live_blocks == 0


def test_decode_short_of_blocks_preempts_the_newest_and_it_resumes_from_the_cache():
    sched = make(num_blocks=6)
    sched.add(request(0, range(10, 17), max_tokens=8))
    sched.add(request(1, range(20, 27), max_tokens=8))
    for _ in range(5):  # 7 prompt tokens, then decode up to 12 written: 3 blocks each
        step(sched)
    assert [r.tables[FULL].blocks for r in sched.running] == [[0, 1, 4], [2, 3, 5]]
    step(sched)  # both need a 4th block; only one can have it
    assert sched.counters["preemptions"] == 1
    assert [r.uid for r in sched.waiting] == [1] and sched.waiting[0].tables is None
    # Request 1's full blocks stay parked; its partial block went to request 0.
    assert [r.tables[FULL].blocks for r in sched.running] == [[0, 1, 4, 5]]
    assert sched.stats().cached_blocks == 2
    step(sched)  # request 0 finishes
    step(sched)  # request 1 resumes from its parked blocks
    assert sched.running[0].tables[FULL].blocks[:2] == [2, 3]
    while sched.running or sched.waiting:
        step(sched)
    assert sched.stats().live_blocks == 0
    assert sched.counters["generated_tokens"] == 16


def test_a_request_that_cannot_fit_alone_is_refused():
    sched = make(num_blocks=4)
    with pytest.raises(ValueError, match="needs up to 6 blocks of 4, but the pool has 4"):
        sched.add(request(0, range(16), max_tokens=1))
    assert not sched.waiting


@settings(max_examples=60, deadline=None)
@given(
    prompts=st.lists(
        st.tuples(st.integers(0, 3), st.integers(1, 12), st.integers(1, 6)), min_size=1, max_size=6
    ),
    num_blocks=st.integers(10, 24),
    max_batch_size=st.integers(1, 4),
)
def test_every_request_gets_all_its_tokens_under_pressure(prompts, num_blocks, max_batch_size):
    sched = make(num_blocks=num_blocks, max_batch_size=max_batch_size, prefill_step_size=8)
    want = {}
    for uid, (prefix, extra, max_tokens) in enumerate(prompts):
        prompt = [prefix] * 6 + list(range(uid * 20, uid * 20 + extra))
        sched.add(request(uid, prompt, max_tokens=max_tokens))
        want[uid] = max_tokens
    got = dict.fromkeys(want, 0)
    for _ in range(200):
        if not (sched.running or sched.waiting):
            break
        for e in step(sched):
            got[e.uid] += 1
    assert got == want
    stats = sched.stats()
    assert stats.live_blocks == 0
    assert stats.cached_blocks + stats.free_blocks == stats.total_blocks


@settings(max_examples=80, deadline=None)
@given(
    st.lists(st.integers(0, 3 * BS), min_size=1, max_size=6),
    st.lists(st.integers(0, 6), max_size=6),
    st.integers(0, 2),
)
def test_a_decode_tokens_blocks_are_what_reserve_takes_for_it(lengths, forks, first):
    """``next_token_blocks`` (schedule_decode's fast count) equals ``blocks_needed`` for the
    next token, on tables that share blocks by forks and begin past dropped blocks."""
    group = BlockTables(1, BS, None)
    tables = []
    for n in lengths:
        t = group.new_table()
        t.first = min(first, n // BS)
        group.reserve(t, t.first * BS, max(n, t.first * BS))  # the next token's block: not yet
        t.lengths[:] = [n]
        tables.append(t)
    for i in forks:  # a fork shares every block of its source
        if i < len(tables):
            tables.append(group.fork(tables[i]))
    for t in tables:
        p = t.lengths[0]
        assert group.next_token_blocks(t) == group.blocks_needed(t, p, p + 1)
        if p % BS == 0 and p // BS - t.first == len(t.blocks):
            assert group.next_token_blocks(t) == 1  # a block boundary past the table's end


def test_requests_of_several_steps_share_forwards_padded_step_by_step():
    """A hybrid model's prefills stop at snapshot cuts: requests with as many steps share
    forwards, each padded to its longest row, under the same padding and token bounds."""
    reqs = [request(uid, [uid + 1]) for uid in range(5)]
    steps = [[8, 3], [8, 6], [16, 5], [8, 4], [16, 5]]
    works = batched_prefills(list(zip(reqs, steps, strict=True)), 64)
    # Alike first: 8+3, 8+4 and 8+6 pad 5 of 42 tokens; adding 16+5 would pad 30 of 88.
    assert [([r.uid for r in w.requests], w.steps, w.counts) for w in works] == [
        ([0, 3, 1], [8, 6], ((8, 8, 8), (3, 4, 6))),
        ([2, 4], [16, 5], None),
    ]
    # Each forward of a batch stays within the budget, padding included.
    works = batched_prefills(list(zip(reqs, steps, strict=True)), 20)
    assert [[r.uid for r in w.requests] for w in works] == [[0, 3], [1], [2], [4]]


@given(
    prompt=st.lists(st.integers(0, 9), min_size=1, max_size=12),
    generated=st.lists(st.integers(0, 9), max_size=6),
    lo=st.integers(0, 20),
    n=st.integers(0, 20),
)
def test_tokens_between_is_a_slice_of_the_tokens(prompt, generated, lo, n):
    req = request(0, prompt)
    req.generated = list(generated)
    assert req.tokens_between(lo, lo + n) == req.tokens[lo : lo + n]
    assert req.kv_target == len(req.tokens) - (1 if generated else 0)


def test_a_layer_kind_keeps_its_hash_and_is_pickled_without_it():
    """Kinds key every table lookup; the kept hash must be the fields' own, and an
    unpickled kind (another rank, a restart) computes its own: ``hash(None)`` is per
    process."""
    kinds = [LayerKind(), LayerKind(window=8), LayerKind(window=8, keep=4)]
    for kind in kinds:
        assert hash(kind) == hash((kind.window, kind.keep))
        again = pickle.loads(pickle.dumps(kind))
        assert again == kind and hash(again) == hash(kind)
        assert b"_hash" not in pickle.dumps(kind)
    assert {k: i for i, k in enumerate(kinds)}[LayerKind(window=8, keep=4)] == 2
    assert LayerKind(window=8) != LayerKind(window=8, keep=4)
