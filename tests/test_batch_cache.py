"""mlx-lm's batch-cache protocol on paged caches, against mlx-lm's own dense batching.

``batch_generate`` and ``BatchGenerator`` run once on mlx-lm's caches and once
paged (``install_paged_cache``, or per-request ``make_paged_cache`` caches), on
the same tiny models and prompts: the greedy tokens must be equal. The
protocol's bookkeeping is checked on exact block ids and refcounts.
"""

from __future__ import annotations

import copy
import random

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx_lm.generate import BatchGenerator, batch_generate
from mlx_lm.models.cache import make_prompt_cache
from test_engine import reference_prefill
from tiny_models import VOCAB, tiny_model

from mlx_paged import (
    PagedBatchKVCache,
    PagedKVCache,
    attention,
    install_paged_cache,
    make_paged_cache,
    uninstall_paged_cache,
)
from mlx_paged.attention import routing
from mlx_paged.cache import DecodeBatch
from mlx_paged.storage import KVPool

# lfm2, qwen3_5, falcon_h1 (inside CacheList): recurrent layers merge as mlx-lm's ArraysCache.
FAMILIES = [
    "llama",
    "gemma3_text",
    "gpt_oss",
    "ministral3",
    "deepseek_v3",
    "lfm2",
    "qwen3_5",
    "falcon_h1",
]


class Tokenizer:
    """What batch_generate needs of a tokenizer: no EOS, so every request runs to max_tokens."""

    eos_token_ids: set[int] = set()

    def decode(self, tokens):
        return " ".join(map(str, tokens))


def prompts(n=5, shared=37, seed=0):
    rng = random.Random(seed)
    head = [rng.randrange(1, VOCAB) for _ in range(shared)]
    out = [head + [rng.randrange(1, VOCAB) for _ in range(rng.randrange(1, 30))] for _ in range(n)]
    return out + [[5]]  # a one-token prompt goes straight to generation


def run_generator(model, ps, max_tokens=10, caches=None):
    gen = BatchGenerator(model, max_tokens=max_tokens, prefill_step_size=16)
    uids = gen.insert(ps, max_tokens=[max_tokens] * len(ps), caches=caches)
    out = {u: [] for u in uids}
    while responses := gen.next_generated():
        for r in responses:
            out[r.uid].append(r.token)
    gen.close()
    return [out[u] for u in uids]


def pool_stats(model):
    return {k: p.blocks.stats() for k, p in model.make_cache.pools.items()}


@pytest.mark.parametrize("family", FAMILIES)
def test_batch_generator_installed_matches_dense(family):
    model = tiny_model(family)
    ps = prompts()
    dense = run_generator(model, ps)
    install_paged_cache(model)
    try:
        flat = [x for c in make_prompt_cache(model) for x in getattr(c, "caches", [c])]
        assert any(isinstance(c, PagedKVCache) for c in flat)
        paged = run_generator(model, ps)
        stats = pool_stats(model)
    finally:
        uninstall_paged_cache(model)
    assert paged == dense
    assert all(s.live_blocks == 0 for s in stats.values()), stats  # nothing leaked
    assert not any(isinstance(c, PagedKVCache) for c in make_prompt_cache(model))  # uninstalled


@pytest.mark.parametrize("family", ["llama", "gemma3_text", "qwen3_5"])
def test_batch_generator_installed_through_a_prefill_kernel_matches_dense(family, monkeypatch):
    """BatchGenerator's batched prefills on installed caches reach PREFILL_KERNELS through
    PagedBatchKVCache.prefill_view; with the kernels' spec there, the tokens are mlx-lm's."""
    monkeypatch.setattr(routing, "PREFILL_KERNELS", [reference_prefill])
    routing._ready.clear()
    model = tiny_model(family)
    ps = prompts()
    dense = run_generator(model, ps)
    before = attention.path_counts["reference_prefill"]
    install_paged_cache(model)
    try:
        paged = run_generator(model, ps)
    finally:
        uninstall_paged_cache(model)
        routing._ready.clear()
    assert paged == dense
    assert attention.path_counts["reference_prefill"] > before


@pytest.mark.parametrize("family", ["llama", "gemma3_text", "gpt_oss"])
def test_batch_generate_with_per_request_paged_caches_matches_dense(family):
    """Caches from separate make_paged_cache calls live in separate pools: merge copies them."""
    model = tiny_model(family)
    ps = prompts(n=3)
    # Each request's cache already holds all but its last token, as a prompt cache would.
    dense_caches = [make_prompt_cache(model) for _ in ps]
    paged_caches = [make_paged_cache(model) for _ in ps]
    for p, dense, paged in zip(ps, dense_caches, paged_caches, strict=True):
        if len(p) > 1:
            model(mx.array(p[:-1])[None], cache=dense)
            model(mx.array(p[:-1])[None], cache=paged)
    tails = [p[-1:] for p in ps]
    kw = dict(max_tokens=8, return_token_ids=True, prefill_step_size=16)
    dense = batch_generate(model, Tokenizer(), tails, prompt_caches=dense_caches, **kw)
    paged = batch_generate(model, Tokenizer(), tails, prompt_caches=paged_caches, **kw)
    assert paged.token_ids == dense.token_ids


def two_sequence_caches(model):
    """Two requests' caches in the installed pool: 20 and 7 tokens written."""
    caches = [make_prompt_cache(model) for _ in range(2)]
    model(mx.arange(1, 21)[None], cache=caches[0])
    model(mx.arange(30, 37)[None], cache=caches[1])
    return caches


def test_merge_in_one_pool_takes_references_and_copies_nothing():
    model = tiny_model("llama")
    install_paged_cache(model, block_size=4)
    caches = two_sequence_caches(model)
    (pool,) = model.make_cache.pools.values()
    before = pool.blocks.stats()
    tables = [c[0].table for c in caches]
    assert [t.blocks for t in tables] == [[0, 1, 2, 3, 4], [5, 6]]
    merged = [PagedKVCache.merge([c[i] for c in caches]) for i in range(len(caches[0]))]
    assert all(isinstance(m, PagedBatchKVCache) for m in merged)
    assert len({id(m.batch) for m in merged}) == 1  # the layers share one batch
    assert pool.blocks.stats() == before  # no block allocated or copied
    assert pool.blocks.refcounts[:7] == [2] * 7  # each block: its request and the batch
    assert merged[0].offset.tolist() == [20, 7]
    del caches, tables
    assert pool.blocks.refcounts[:7] == [1] * 7  # the requests' caches gave theirs back
    assert merged[0].batch.tables[0].blocks == [0, 1, 2, 3, 4]


def test_filter_extract_extend_move_tables():
    model = tiny_model("llama")
    install_paged_cache(model, block_size=4)
    caches = two_sequence_caches(model)
    batch = [PagedKVCache.merge([c[i] for c in caches]) for i in range(len(caches[0]))]
    del caches
    (pool,) = model.make_cache.pools.values()
    single = [c.extract(1) for c in batch]
    assert len({id(c.table) for c in single}) == 1  # one table for the sequence's layers
    assert single[0].table.blocks == [5, 6] and single[0].offset == 7
    assert pool.blocks.refcounts[5:7] == [2, 2]
    for c in batch:
        c.filter([0])
    assert pool.blocks.refcounts[:7] == [1, 1, 1, 1, 1, 1, 1]  # request 1: only its extract
    other = [PagedKVCache.merge([c]) for c in single]
    for a, b in zip(batch, other, strict=True):
        a.extend(b)
    assert batch[0].offset.tolist() == [20, 7]
    assert other[0].batch.tables == []  # the tables moved
    assert pool.blocks.refcounts[5:7] == [2, 2]  # the batch and the extracted cache


def test_merged_decode_matches_each_sequence_alone():
    model = tiny_model("gemma3_text")
    install_paged_cache(model, block_size=4)
    a, b = [make_prompt_cache(model) for _ in range(2)]
    pa, pb = list(range(1, 40)), list(range(50, 61))
    model(mx.array(pa)[None], cache=a)
    model(mx.array(pb)[None], cache=b)
    ref_a, ref_b = make_prompt_cache(model), make_prompt_cache(model)
    uninstall_paged_cache(model)
    dense = [make_prompt_cache(model) for _ in range(2)]
    model(mx.array(pa)[None], cache=dense[0])
    model(mx.array(pb)[None], cache=dense[1])
    merged = [PagedKVCache.merge([x, y]) for x, y in zip(a, b, strict=True)]
    del ref_a, ref_b
    tokens = mx.array([[7], [9]])
    for step in range(6):
        if step == 3:  # reorder the batch: the tables move, nothing else
            for c in merged:
                c.filter([1, 0])
            dense, tokens = dense[::-1], tokens[::-1]
        got = model(tokens, cache=merged)[:, -1]
        want = mx.concatenate([model(tokens[i : i + 1], cache=dense[i])[:, -1] for i in range(2)])
        assert mx.abs(got - want).max().item() < 1e-4
        tokens = mx.argmax(want, axis=-1)[:, None]


def test_deepcopy_of_an_installed_cache_shares_blocks():
    model = tiny_model("llama")
    install_paged_cache(model, block_size=4)
    (cache,) = [make_prompt_cache(model)]
    model(mx.arange(1, 11)[None], cache=cache)
    (pool,) = model.make_cache.pools.values()
    live = pool.blocks.stats().live_blocks
    fork = copy.deepcopy(cache)
    assert pool.blocks.stats().live_blocks == live
    assert fork[0].table.blocks == cache[0].table.blocks
    assert pool.blocks.refcounts[: len(cache[0].table.blocks)] == [2, 2, 2]


def test_bad_batch_input_raises_and_changes_nothing():
    model = tiny_model("llama")
    install_paged_cache(model, block_size=4)
    caches = two_sequence_caches(model)
    with pytest.raises(ValueError, match="at least one cache"):
        PagedKVCache.merge([])
    other = make_paged_cache(model, block_size=8)
    with pytest.raises(ValueError, match="same block size"):
        PagedKVCache.merge([caches[0][0], other[0]])
    with pytest.raises(ValueError, match="same layer"):
        PagedKVCache.merge([caches[0][0], caches[1][1]])
    with pytest.raises(ValueError, match="cannot merge"):
        PagedKVCache.merge([caches[0][0], make_prompt_cache(tiny_model("qwen3"))[0]])
    batch = [PagedKVCache.merge([c[i] for c in caches]) for i in range(len(caches[0]))]
    (pool,) = model.make_cache.pools.values()
    refs = list(pool.blocks.refcounts)
    with pytest.raises(ValueError, match="outside this batch of 2"):
        batch[0].extract(2)
    with pytest.raises(ValueError, match="outside this batch of 2"):
        batch[0].filter([0, 5])
    with pytest.raises(ValueError, match="at least one index"):
        batch[0].filter([])
    assert pool.blocks.refcounts == refs
    assert [len(c.batch.tables) for c in batch] == [2] * len(batch)


def test_keys_and_values_read_the_dense_view():
    model = tiny_model("llama")
    paged, dense = make_paged_cache(model), make_prompt_cache(model)
    for c in (paged, dense):
        model(mx.arange(1, 30)[None], cache=c)
    k, v = paged[1].keys_and_values()
    dk, dv = dense[1].keys_and_values()
    assert mx.array_equal(k, dk).item() and mx.array_equal(v, dv).item()
    assert mx.array_equal(paged[1].keys, dk).item()


def test_assigning_values_writes_this_sequence_only():
    """deepseek_v32's indexer zeroes its cache's values; a fork must keep its own."""
    model = tiny_model("llama")
    cache = make_paged_cache(model, block_size=4)
    model(mx.arange(1, 12)[None], cache=cache)
    fork = copy.deepcopy(cache)
    before = fork[1].values
    cache[1].values = mx.zeros_like(cache[1].keys)
    assert mx.array_equal(cache[1].values, mx.zeros_like(before)).item()
    assert mx.array_equal(fork[1].values, before).item()  # copied on write
    assert cache[1].table.blocks != fork[1].table.blocks
    with pytest.raises(ValueError, match="only be replaced by an array of their shape"):
        cache[1].keys = mx.zeros((1, 2, 3, 16))


def test_a_window_wider_than_the_layer_is_accepted():
    model = tiny_model("gemma3_text")
    cache = make_paged_cache(model)
    model(mx.arange(1, 60)[None], cache=cache)
    sliding = next(c for c in cache if c.window is not None)
    assert mx.array_equal(
        sliding.make_mask(3, return_array=True, window_size=10 * sliding.window),
        sliding.make_mask(3, return_array=True),
    ).item()


def table_ops(names: str, max_size: int) -> st.SearchStrategy:
    """Lists of ``(op, table index 0-2, amount 1-9)``, ``op`` one of ``names``."""
    ops = st.tuples(st.sampled_from(names.split()), st.integers(0, 2), st.integers(1, 9))
    return st.lists(ops, max_size=max_size)


@settings(max_examples=40, deadline=None)
@given(table_ops("grow fork drop truncate same", 25))
def test_a_steps_block_tables_follow_every_table_change(ops):
    """Each row of a decode step's block tables (as read, and padded for the kernels) is its
    table's blocks as they are now, whatever changed them; a table that did not change
    hands its row over as it was (no conversion a step)."""
    bs = 4
    pool = KVPool(num_layers=1, block_size=bs)
    tables = [pool.new_table() for _ in range(3)]
    for t in tables:
        pool.reserve(t, 0, 1)
    for op, i, k in ops:
        t = tables[i]
        n = t.lengths[0]
        if op == "grow":  # write k tokens: new blocks, or private copies of shared ones
            t.lengths[0] = n + k
        elif op == "fork":  # shares every block, so the next write copies the last one
            tables[(i + 1) % 3] = t = pool.fork(t)
        elif op == "drop":
            pool.drop_before(t, min(n, k * bs))
        elif op == "truncate":
            pool.truncate(t, 0, max(n - k, t.first * bs))
        pool.reserve(t, t.lengths[0], t.lengths[0] + 1)
        kept = [t._derived.get("row") for t in tables]
        batch = DecodeBatch(pool, tables, None)
        rows = [t.blocks[: t.lengths[0] // bs - t.first + 1] for t in tables]
        width = max(map(len, rows))
        for cols, got in (
            (width, batch.block_tables),
            (width + 3, batch._padded_tables(width + 3)),
        ):
            want = [r + [r[-1]] * (cols - len(r)) for r in rows]
            assert np.array(got).tolist() == want
        for t, before in zip(tables, kept, strict=True):
            key, row = t._derived["row"]
            if before is not None and before[0] == key:
                assert row is before[1]


@settings(max_examples=150, deadline=None)
@given(st.sampled_from([None, 6, 13]), table_ops("grow fork drop truncate", 20))
def test_a_one_token_step_is_built_as_any_step_would_be(window, ops):
    """A decode step's own loop gives what the general one gives for one real token a row:
    the same tables, starts, offsets, lengths and new tokens' blocks and slots, or the same
    refusal of a block given back before its query reads it."""
    bs = 4
    pool = KVPool(num_layers=1, block_size=bs)
    tables = [pool.new_table() for _ in range(3)]
    for t in tables:
        pool.reserve(t, 0, 1)

    def built(**given) -> tuple | type:
        try:
            b = DecodeBatch(pool, tables, window, **given)
        except AssertionError as e:
            return type(e)
        parts = (b.block_tables, b.starts, b.offset, b.lengths, b.counts, b.write_ids)
        arrays = [np.array(a).tolist() for a in (*parts, b.write_slots)]
        return b.width, b.new_tokens, b.padded, arrays

    for op, i, k in ops:
        t = tables[i]
        n = t.lengths[0]
        if op == "grow":
            t.lengths[0] = n + k
        elif op == "fork":
            tables[(i + 1) % 3] = t = pool.fork(t)
        elif op == "drop":
            pool.drop_before(t, min(n, k * bs))
        else:
            pool.truncate(t, 0, max(n - k, t.first * bs))
        pool.reserve(t, t.lengths[0], t.lengths[0] + 1)
        assert built() == built(counts=[1] * len(tables))
