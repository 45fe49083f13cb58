"""``max_kv_size`` on paged caches: the first tokens and a window, as mlx-lm keeps them.

mlx-lm's ``make_prompt_cache(model, max_kv_size)`` builds ``RotatingKVCache(max_size,
keep=4)`` layers for models without their own ``make_cache``; ``make_paged_cache(model,
max_kv_size=...)`` builds ``PagedSinkKVCache`` layers. Every test compares with the
dense cache on the same model and tokens, or checks exact block ids and refcounts.
"""

from __future__ import annotations

import copy

import mlx.core as mx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import (
    BatchRotatingKVCache,
    load_prompt_cache,
    make_prompt_cache,
    save_prompt_cache,
    trim_prompt_cache,
)
from test_batch_cache import run_generator
from test_parity import feed, run_generate_step
from tiny_models import VOCAB, tiny_model

from mlx_paged import PagedKVCache, install_paged_cache, make_paged_cache
from mlx_paged.blocks import HOLE, BlockTables
from mlx_paged.cache.sinks import PagedSinkKVCache

WINDOW = 24  # max_kv_size: 4 kept tokens and 20 recent ones
BLOCK = 8
TOL = 1e-4  # mlx-lm's rotating buffer sums keys in another order once it wraps


@pytest.fixture(scope="module", params=["qwen3", "deepseek_v3"])
def model(request):
    return tiny_model(request.param)


def tokens(n: int, seed: int = 3) -> mx.array:
    return mx.random.randint(0, VOCAB, (n,), key=mx.random.key(seed))


@pytest.mark.parametrize(
    ("prompt_len", "step"),
    [
        (20, 16),  # prompt inside the window, decoding past it
        (45, 7),  # chunks after the window filled: later queries lose sinks, as in mlx-lm
        (100, 64),  # a first chunk longer than the window
    ],
)
def test_generation_matches_dense_max_kv_size(model, prompt_len, step):
    prompt = tokens(prompt_len)
    dense = make_prompt_cache(model, max_kv_size=WINDOW)
    paged = make_paged_cache(model, BLOCK, max_kv_size=WINDOW)
    assert all(type(c) is PagedSinkKVCache for c in paged)
    want, want_logits = run_generate_step(model, prompt, dense, steps=40, prefill_step_size=step)
    got, got_logits = run_generate_step(model, prompt, paged, steps=40, prefill_step_size=step)
    assert got == want
    assert mx.abs(got_logits - want_logits).max().item() <= TOL
    assert [c.offset for c in paged] == [c.offset for c in dense]
    assert [c.size() for c in paged] == [c.size() for c in dense] == [WINDOW] * len(dense)


def test_blocks_between_the_sinks_and_the_window_go_back():
    model = tiny_model("qwen3")
    cache = make_paged_cache(model, BLOCK, max_kv_size=WINDOW)
    table, pool = cache[0].table, cache[0].pool
    seq = tokens(41).tolist()
    for chunk in (seq[:16], seq[16:32], seq[32:40]):
        feed(model, cache, chunk)
    # The last step started at 32: it read the sinks and tokens 13.. (mlx-lm keeps 19 old
    # ones), so block 1 (tokens 8..15) is still needed; nothing went back.
    assert HOLE not in table.blocks and len(table.blocks) == 5
    feed(model, cache, seq[40:])
    # Started at 40: reads the sinks and 21..40; block 1 holds only tokens no step reads.
    held = table.blocks
    assert held[1] == HOLE and HOLE not in held[:1] + held[2:] and len(held) == 6
    stats = pool.blocks.stats()
    assert stats.live_blocks == 5 and stats.free_blocks == stats.total_blocks - 5
    assert [pool.blocks.refcounts[b] for b in held if b != HOLE] == [1] * 5
    assert cache[0].nbytes == 5 * pool.held_bytes(0, [held[0]])


def test_decoding_holds_a_bounded_number_of_blocks():
    model = tiny_model("qwen3")
    cache = make_paged_cache(model, BLOCK, max_kv_size=WINDOW)
    pool = cache[0].pool
    feed(model, cache, tokens(30).tolist())
    # Sink block, the 20-token window plus the token being written: at most 1 + 4 blocks.
    most = 0
    for t in tokens(150, seed=4).tolist():
        feed(model, cache, [t])
        most = max(most, pool.blocks.stats().live_blocks)
    assert most == 5
    assert cache[0].offset == 180


def test_deepcopy_shares_blocks_and_continues_like_the_original():
    model = tiny_model("qwen3")
    cache = make_paged_cache(model, BLOCK, max_kv_size=WINDOW)
    feed(model, cache, tokens(50).tolist())
    pool, held = cache[0].pool, [b for b in cache[0].table.blocks if b != HOLE]
    fork = copy.deepcopy(cache)
    assert [b for b in fork[0].table.blocks if b != HOLE] == held
    assert [pool.blocks.refcounts[b] for b in held] == [2] * len(held)
    a, b = feed(model, cache, [7]), feed(model, fork, [7])
    assert mx.array_equal(a, b)
    # Each copy wrote its own tail block and gave back tokens 4..23 (blocks 1 and 2).
    mine = cache[0].table.blocks
    assert mine[:1] + mine[3:6] == held[:1] + held[3:6] and mine[1:3] == [HOLE, HOLE]
    # The first writer copied the shared tail block; the second then held it alone.
    assert mine[6] not in held and fork[0].table.blocks[6] == held[6]
    del fork
    assert pool.blocks.stats().live_blocks == 5
    assert [pool.blocks.refcounts[b] for b in mine if b != HOLE] == [1] * 5


def test_save_and_load_keep_holes_and_continue_like_dense(tmp_path):
    model = tiny_model("qwen3")
    seq = tokens(60).tolist()
    dense = make_prompt_cache(model, max_kv_size=WINDOW)
    paged = make_paged_cache(model, BLOCK, max_kv_size=WINDOW)
    for chunk in (seq[:32], seq[32:52], seq[52:]):
        feed(model, dense, chunk)
        feed(model, paged, chunk)
    assert HOLE in paged[0].table.blocks
    path = str(tmp_path / "sinks.safetensors")
    save_prompt_cache(path, paged)
    loaded = load_prompt_cache(path)
    assert all(type(c) is PagedSinkKVCache for c in loaded)
    assert loaded[0].table.blocks.count(HOLE) == paged[0].table.blocks.count(HOLE)
    for t in (3, 9, 11):
        want = feed(model, dense, [t])
        assert mx.abs(feed(model, loaded, [t]) - want).max().item() <= TOL
        assert mx.abs(feed(model, paged, [t]) - want).max().item() <= TOL


def test_trim_before_the_window_fills_matches_dense():
    model = tiny_model("qwen3")
    dense = make_prompt_cache(model, max_kv_size=WINDOW)
    paged = make_paged_cache(model, BLOCK, max_kv_size=WINDOW)
    seq = tokens(20).tolist()
    feed(model, dense, seq)
    feed(model, paged, seq)
    assert paged[0].is_trimmable() and trim_prompt_cache(paged, 5) == trim_prompt_cache(dense, 5)
    want, got = feed(model, dense, [1, 2, 3]), feed(model, paged, [1, 2, 3])
    assert mx.abs(got - want).max().item() <= TOL
    feed(model, paged, tokens(10).tolist())
    assert not paged[0].is_trimmable() and trim_prompt_cache(paged, 3) == 0


def test_batching_copies_into_mlx_lms_rotating_batch_cache():
    model = tiny_model("qwen3")
    ps = [tokens(n, seed=n).tolist() for n in (30, 9, 41)]
    dense = run_generator(model, ps, caches=[make_prompt_cache(model, WINDOW) for _ in ps])
    paged = [make_paged_cache(model, BLOCK, max_kv_size=WINDOW) for _ in ps]
    assert run_generator(model, ps, caches=paged) == dense
    feed(model, paged[0], ps[0])
    merged = PagedSinkKVCache.merge([paged[0][0]])
    assert isinstance(merged, BatchRotatingKVCache) and merged.max_size == WINDOW
    gen = BatchGenerator(model, max_tokens=2)
    assert gen.max_kv_size is None  # our hook decides, as for any model with make_cache
    install_paged_cache(model, BLOCK, max_kv_size=WINDOW)
    try:
        assert all(type(c) is PagedSinkKVCache for c in model.make_cache())
        assert run_generator(model, ps) == dense
    finally:
        del model.make_cache


@pytest.mark.parametrize("bad", [4, 0, -8, 8.0, "24", True])
def test_bad_max_kv_size_is_refused(bad):
    with pytest.raises(ValueError, match="max_kv_size"):
        make_paged_cache(tiny_model("qwen3"), BLOCK, max_kv_size=bad)


def test_refusals_leave_the_cache_unchanged():
    model = tiny_model("qwen3")
    cache = make_paged_cache(model, BLOCK, max_kv_size=WINDOW)
    feed(model, cache, tokens(30).tolist())
    blocks = list(cache[0].table.blocks)
    with pytest.raises(ValueError, match="max_kv_size"):
        cache[0].keys = cache[0].keys
    with pytest.raises(ValueError, match="PagedSinkKVCache"):
        PagedSinkKVCache.merge([cache[0], make_paged_cache(model, BLOCK)[0]])
    assert cache[0].table.blocks == blocks
    # A model with its own make_cache ignores max_kv_size, as in mlx-lm.
    llama = tiny_model("llama")
    assert type(make_paged_cache(llama, BLOCK, max_kv_size=WINDOW)[0]) is PagedKVCache


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("wdfr"), st.integers(0, 3), st.integers(1, 40))))
def test_holes_keep_refcounts_exact(ops):
    """Writes, middle drops, forks and releases on pure block tables: every block's refcount
    is the number of tables holding it, and holes are never released or retained."""
    tables = BlockTables(num_layers=1, block_size=4, num_blocks=None)
    held = [tables.new_table()]
    for op, i, n in ops:
        t = held[i % len(held)]
        if op == "w":
            tables.reserve(t, t.end, t.end + n)
            t.lengths[0] += n
        elif op == "d":
            tables.drop_range(t, 4, max(0, t.end - n))
        elif op == "f":
            held.append(tables.fork(t))
        elif len(held) > 1:
            tables.release(held.pop(i % len(held)))
        ids = [b for t in held for b in t.blocks if b != HOLE]
        want = [ids.count(b) for b in range(tables.blocks.capacity)]
        assert tables.blocks.refcounts == want
        assert all(t.blocks[:1] != [HOLE] for t in held)  # the kept tokens' block stays
