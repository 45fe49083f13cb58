"""Decode steps that leave the K/V write to the kernel (``PagedView.new_keys``): who is offered
such a view, what it carries, the write when no kernel takes the call, and the engine's tokens
on every path against mlx-lm's dense cache. The CUDA kernel's own stores are checked on the GPU
(``test_kernel_sources.py``); here a stand-in entry stores the rows with MLX ops (``writing``,
in conftest.py)."""

from __future__ import annotations

import mlx.core as mx
import pytest
from test_engine import mixed_prompts, run_all, solo
from tiny_models import tiny_model

from mlx_paged import PagedEngine
from mlx_paged.attention import routing, set_attention_path
from mlx_paged.cache import DecodeBatch, StepPagedKVCache
from mlx_paged.storage import KVPool

MAX_TOKENS = 8


@pytest.mark.parametrize("family", ["llama", "gemma3_text", "gpt_oss"])
@pytest.mark.parametrize("compiled", [True, False])
def test_engine_tokens_with_kernel_writes_match_solo_dense(writing, family, compiled):
    """Every request gets its tokens alone on mlx-lm's cache whether the kernel stores the
    step's K/V, declines (the cache writes them then), or no kernel is offered the call."""
    model = tiny_model(family)
    prompts = mixed_prompts(seed=3)
    want = [solo(family, tuple(p), MAX_TOKENS) for p in prompts]
    for path, take in (("kernel", True), ("kernel", False), ("gather", True)):
        set_attention_path(path)
        writing["take"], writing["views"] = take, []
        engine = PagedEngine(model, block_size=8, max_batch_size=4, compile_decode=compiled)
        assert run_all(engine, prompts, max_tokens=MAX_TOKENS) == want, (path, take)
        offered = [v.new_keys is not None for v in writing["views"]]
        assert (any(offered) and all(offered)) if path == "kernel" else not offered


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_preempted_and_resumed_requests_with_kernel_writes_match_solo_dense(writing, family):
    """Decode growth in a six-block pool preempts requests; their K/V, stored by the kernel
    before, is recomputed or adopted on their return."""
    model = tiny_model(family)
    prompts = [[(11 * i + 5 * s) % 97 + 1 for i in range(7)] for s in range(5)]
    engine = PagedEngine(model, block_size=8, num_blocks=6)
    outputs = run_all(engine, prompts, max_tokens=14)
    assert engine.stats().preemptions > 0
    assert outputs == [solo(family, tuple(p), 14) for p in prompts]
    assert any(v.new_keys is not None for v in writing["views"])


def test_engine_with_a_cold_tier_and_kernel_writes_keeps_its_tokens(writing):
    model = tiny_model("llama", head_dim=64)
    prompts = [list(range(1 + s, 90 + 7 * s)) for s in range(3)]
    results = []
    for path in ("kernel", "gather"):
        set_attention_path(path)
        engine = PagedEngine(model, block_size=8, max_batch_size=3, kv_bits=8, hot_tokens=16)
        results.append(run_all(engine, prompts, max_tokens=12))
    assert any(v.cold is not None and v.new_keys is not None for v in writing["views"])
    assert results[0] == results[1]


def one_step(pool: KVPool, tables, keys, values) -> StepPagedKVCache:
    batch = DecodeBatch(pool, tables, None, n_new=keys.shape[2])
    cache = StepPagedKVCache(pool, batch, 0)
    cache.update_and_fetch(keys, values)
    return cache


def test_a_step_left_to_the_kernel_hands_it_the_rows_and_leaves_the_pool(writing):
    pool = KVPool(1, 8, None)
    pool.defer_reads = True
    tables = [pool.new_table(), pool.new_table()]
    prefill = [mx.random.normal((1, 2, n, 16), key=mx.random.key(n)) for n in (11, 16)]
    for t, kv in zip(tables, prefill, strict=True):
        pool.reserve(t, 0, kv.shape[2])
        pool.write_prefill(t, 0, kv, kv)
    for t in tables:
        pool.reserve(t, t.lengths[0], t.lengths[0] + 1)
    mx.eval(pool.keys[0], pool.values[0])
    before = [pool.keys[0], pool.values[0]]
    snapshot = mx.array(pool.keys[0])
    k, v = mx.random.normal((2, 2, 1, 16)), mx.random.normal((2, 2, 1, 16))
    cache = one_step(pool, tables, k, v)
    view = cache.paged_view()
    assert view.new_keys is k and view.new_values is v
    assert [pool.keys[0], pool.values[0]] == before  # the same arrays: nothing written
    assert mx.array_equal(pool.keys[0], snapshot).item()
    assert view.lengths.tolist() == [12, 17]
    # No kernel took it: the read writes the rows first, then reads them back.
    cache.deferred_read(None, None)
    blocks = [tables[0].blocks[1], tables[1].blocks[2]]  # positions 11 and 16
    for b, s, row in zip(blocks, [3, 0], (0, 1), strict=True):
        assert mx.array_equal(pool.keys[0][b, s], k[row, :, 0]).item()
        assert mx.array_equal(pool.values[0][b, s], v[row, :, 0]).item()
    assert cache.paged_view().new_keys is None  # written once


@pytest.mark.parametrize("case", ["prefill", "kv_dtype", "no writer", "gather"])
def test_steps_that_write_before_the_kernel(writing, case):
    """Prefill chunks, a pool that stores another dtype, a kernel set with an entry that does
    not store rows, and the gather path all write K/V as before."""
    pool = KVPool(1, 8, None, kv_dtype=mx.float16 if case == "kv_dtype" else None)
    pool.defer_reads = True
    n = 3 if case == "prefill" else 1
    if case == "no writer":
        routing.KERNELS.append(lambda *a: None)
    if case == "gather":
        set_attention_path("gather")
    table = pool.new_table()
    pool.reserve(table, 0, 5)
    pool.write_prefill(table, 0, mx.ones((1, 2, 5, 16)), mx.ones((1, 2, 5, 16)))
    pool.reserve(table, 5, 5 + n)
    kv = mx.random.normal((1, 2, n, 16))
    cache = one_step(pool, [table], kv, kv)
    assert cache.paged_view().new_keys is None
    got = pool.keys[0][table.blocks[0], 5 : 5 + n].astype(mx.float32)
    assert mx.allclose(got, kv[0].swapaxes(0, 1), atol=1e-3).item()


def test_kernels_write_only_where_every_running_entry_stores_rows(writing):
    assert routing.kernels_write()
    routing.KERNELS.append(lambda *a: None)  # an entry without ``writes``
    routing._ready.clear()
    assert routing.kernels_ready() and not routing.kernels_write()
    set_attention_path("gather")
    assert not routing.kernels_write()
