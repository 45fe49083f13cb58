"""In-place reads: a sequence whose blocks are consecutive ids is read as views of the pool
(``KVPool.run_view``) by its decode steps and prefill chunks, as mlx-lm reads its dense
buffer; every other table gathers or meets a kernel."""

from __future__ import annotations

import collections
import copy
import io
import random
import re

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from mlx_lm.models.cache import make_prompt_cache
from test_parity import BLOCK, DECODE_STEPS, max_diff, prompt_tokens, run_generate_step
from tiny_models import VOCAB, model_of, solo, tiny_model

from mlx_paged import PagedEngine, install_paged_cache, make_paged_cache, uninstall_paged_cache
from mlx_paged.attention import path_counts, set_attention_path
from mlx_paged.blocks import COLD, HOLE
from mlx_paged.storage import KVPool
from mlx_paged.storage.runs import consecutive_start


@pytest.fixture(autouse=True)
def auto_path():
    set_attention_path("auto")
    yield
    set_attention_path("auto")


def counts() -> dict[str, int]:
    return dict(path_counts)


def grown(before: dict[str, int], path: str) -> int:
    return path_counts[path] - before.get(path, 0)


@pytest.mark.parametrize("family", ["llama", "qwen3", "deepseek_v3"])
def test_a_fresh_cache_decodes_in_place_like_the_dense_cache(family):
    model = tiny_model(family)
    prompt = prompt_tokens(45)
    dense_tokens, dense = run_generate_step(model, prompt, make_prompt_cache(model))
    before = counts()
    cache = make_paged_cache(model, BLOCK)
    tokens, paged = run_generate_step(model, prompt, cache)
    assert tokens == dense_tokens
    assert max_diff(dense, paged) == 0.0
    # Three prefill chunks (16, 16 and 12 tokens), then every decode step (generate_step
    # runs one ahead) read in place; nothing gathers.
    assert grown(before, "in_place") == len(cache) * (3 + DECODE_STEPS + 1)
    assert grown(before, "gather") == 0


def step_graph(model, cache) -> collections.Counter[str]:
    """The primitives of one decode step's graph by kind, after a 45-token prefill."""
    mx.eval(model(mx.array([prompt_tokens(45)]), cache=cache))
    dot = io.StringIO()
    mx.export_to_dot(dot, model(mx.array([[7]]), cache=cache))
    return collections.Counter(re.findall(r'label ="([A-Za-z_0-9]+)', dot.getvalue()))


def test_a_decode_step_adds_four_view_ops_a_layer_to_the_dense_graph():
    """Per layer and step the paged write and read add to mlx-lm's two slice updates and
    two slices only a reshape of each new token and a flatten under each strided view:
    every primitive of a one-token step costs host time on the GPU (a broadcast of each
    token's update, two a layer, once showed here)."""
    model = model_of("llama")
    dense = step_graph(model, make_prompt_cache(model))
    paged = step_graph(model, make_paged_cache(model, BLOCK))
    layers = len(model.layers)
    assert paged - dense == {"AsStrided": 2 * layers, "Flatten": 2 * layers, "Reshape": 2 * layers}
    assert dense - paged == {"Slice": 2 * layers}


@pytest.mark.parametrize("family", ["gemma3_text", "gpt_oss"])
def test_windows_read_in_place_until_their_blocks_are_reused(family):
    """Sliding layers give blocks back and take them again: from then on they gather."""
    model = tiny_model(family)
    prompt = prompt_tokens(45)
    dense_tokens, dense = run_generate_step(model, prompt, make_prompt_cache(model), steps=30)
    before = counts()
    tokens, paged = run_generate_step(model, prompt, make_paged_cache(model, BLOCK), steps=30)
    assert tokens == dense_tokens
    assert max_diff(dense, paged) <= 1e-4
    assert grown(before, "in_place") > 0 and grown(before, "gather") > 0


def test_interleaved_tables_gather():
    """Two sequences writing into one pool in turn hold every other block: no view."""
    model = tiny_model("llama")
    install_paged_cache(model, block_size=4)
    try:
        a, b = make_prompt_cache(model), make_prompt_cache(model)
    finally:
        uninstall_paged_cache(model)
    dense = make_prompt_cache(model)
    for t in prompt_tokens(12, seed=3).tolist():  # one token each, in turn
        for cache in (a, b, dense):
            model(mx.array([[t]]), cache=cache)
    assert a[0].table.blocks == [0, 2, 4] and b[0].table.blocks == [1, 3, 5]
    before = counts()
    got, want = model(mx.array([[7]]), cache=a), model(mx.array([[7]]), cache=dense)
    assert grown(before, "in_place") == 0 and grown(before, "gather") == len(a)
    assert max_diff(got, want) == 0.0


def test_a_fork_reads_shared_blocks_in_place_until_copy_on_write_moves_its_tail():
    model = tiny_model("llama")
    cache = make_paged_cache(model, block_size=BLOCK)
    model(prompt_tokens(20)[None], cache=cache)  # 20 tokens: the tail block is partial
    fork = copy.deepcopy(cache)
    assert fork[0].table.blocks == cache[0].table.blocks
    before = counts()
    model(mx.array([[5]]), cache=fork)  # its tail block is copied, to a new id
    assert fork[0].table.blocks[:-1] == cache[0].table.blocks[:-1]
    assert fork[0].table.blocks[-1] != cache[0].table.blocks[-1]
    assert grown(before, "in_place") == 0
    before = counts()
    model(mx.array([[5]]), cache=cache)  # the original's blocks are still consecutive
    assert grown(before, "in_place") == len(cache)


@pytest.mark.parametrize("path", ["kernel", "gather"])
def test_the_kernel_path_never_reads_in_place(path):
    set_attention_path(path)
    model = tiny_model("llama")
    before = counts()
    run_generate_step(model, prompt_tokens(20), make_paged_cache(model, BLOCK), steps=3)
    assert (grown(before, "in_place") > 0) is (path == "gather")


@pytest.mark.parametrize(
    "kwargs", [dict(kv_dtype=mx.float16), dict(kv_bits=8, hot_tokens=16, kv_group_size=32)]
)
def test_other_storage_is_not_read_in_place(kwargs):
    """A storage dtype other than the model's, or cold blocks, cannot be a view."""
    model = tiny_model("llama", head_dim=64)  # mx.quantize needs groups of 32 or more
    prompt = prompt_tokens(100)
    dense_tokens, _ = run_generate_step(model, prompt, make_prompt_cache(model), steps=3)
    before = counts()
    cache = make_paged_cache(model, BLOCK, **kwargs)
    tokens, _ = run_generate_step(model, prompt, cache, steps=3)
    if "kv_bits" in kwargs:
        # The first prefill chunks ran before any block went cold; a step over cold ones
        # gathers.
        assert cache[0].pool.has_cold(cache[0].table)
        before = counts()
        model(mx.array([[5]]), cache=cache)
        assert grown(before, "gather") == len(cache)
    else:
        assert tokens == dense_tokens
    assert grown(before, "in_place") == 0


@given(
    st.lists(st.integers(0, 40), max_size=12),
    st.integers(0, 30),
    st.integers(0, 12),
)
def test_consecutive_start(ids, first, n):
    run = list(range(first, first + n))
    assert consecutive_start(run) == (first if n else None)
    expected = ids[0] if ids and ids == list(range(ids[0], ids[0] + len(ids))) else None
    assert consecutive_start(ids) == expected
    assert consecutive_start([HOLE, *run]) is None
    assert consecutive_start([*run, COLD]) is None


def prefilled(block_size: int, tokens: int, heads: int, skip: int) -> tuple:
    """A one-layer pool (K head dim 5, V 7) whose table holds ``tokens`` random tokens in
    blocks from id ``skip`` on, and those K and V."""
    pool = KVPool(1, block_size, 16)
    table = pool.new_table()
    k = mx.random.normal((1, heads, tokens, 5), key=mx.random.key(1))
    v = mx.random.normal((1, heads, tokens, 7), key=mx.random.key(2))
    pool.blocks.allocate(skip)
    pool.write_prefill(table, 0, k, v)
    return pool, table, k, v


@pytest.mark.parametrize(("start", "end"), [(0, 1), (0, 37), (8, 37), (16, 48), (24, 25)])
def test_run_view_holds_the_gathered_tokens(start, end):
    pool, table, k, v = prefilled(block_size=8, tokens=48, heads=3, skip=2)
    assert table.blocks == [2, 3, 4, 5, 6, 7]
    got = pool.run_view(table, 0, start, end)
    want = pool.gather(table, 0, start, end)
    assert got[0].shape == want[0].shape == (1, 3, end - start, 5)
    assert mx.array_equal(got[0], want[0]).item() and mx.array_equal(got[1], want[1]).item()
    assert mx.array_equal(got[0], k[:, :, start:end]).item()
    table.blocks[3], table.version = 9, table.version + 1  # a gap (ids are not checked here)
    assert pool.run_view(table, 0, 0, 48) is None
    assert pool.run_view(table, 0, 0, 24) is not None
    table.blocks[3], table.version = 5, table.version + 1


def test_append_view_writes_one_token_and_reads_in_place_only_where_it_may():
    """The decode fast path: one write at the tail and the views, or ``None`` and no write."""
    pool, table, k, v = prefilled(block_size=4, tokens=6, heads=2, skip=1)
    one_k = mx.random.normal((1, 2, 1, 5), key=mx.random.key(3))
    one_v = mx.random.normal((1, 2, 1, 7), key=mx.random.key(4))
    assert pool.append_view(table, 0, one_k, one_v) is None  # no one-token write checked yet
    pool.append(table, 0, one_k, one_v)
    assert table.blocks == [1, 2] and table.lengths == [7]
    got = pool.append_view(table, 0, one_k * 2, one_v * 2)  # slot 3 of block 2
    assert table.lengths == [8] and table.blocks == [1, 2]
    want_k = mx.concatenate([k, one_k, one_k * 2], axis=2)
    want_v = mx.concatenate([v, one_v, one_v * 2], axis=2)
    assert mx.array_equal(got[0], want_k).item() and mx.array_equal(got[1], want_v).item()
    assert mx.array_equal(pool.keys[0][2, 3], (one_k * 2)[0, :, 0]).item()
    # Token 8 needs a block the table does not hold yet: the general path reserves it.
    assert pool.append_view(table, 0, one_k, one_v) is None and table.lengths == [8]
    pool.append(table, 0, one_k, one_v)
    assert table.blocks == [1, 2, 3] and pool.blocks.refcounts[3] == 1
    # A tail block someone else holds is copied before a write, never written here.
    pool.blocks.retain(3)
    before = mx.array(pool.keys[0][3])
    assert pool.append_view(table, 0, one_k, one_v) is None and table.lengths == [9]
    assert mx.array_equal(pool.keys[0][3], before).item()
    pool.blocks.release(3)  # the answer holds while the table and the pool's shares do
    assert pool.append_view(table, 0, one_k, one_v) is None and table.lengths == [9]
    table.version += 1
    assert pool.append_view(table, 0, one_k, one_v) is not None and table.lengths == [10]
    # Storage in another dtype is never a view.
    pool16 = KVPool(1, 4, 16, kv_dtype=mx.float16)
    table16 = pool16.new_table()
    pool16.write_prefill(table16, 0, k, v)
    pool16.append(table16, 0, one_k, one_v)
    assert pool16.append_view(table16, 0, one_k, one_v) is None and table16.lengths == [7]


@pytest.mark.parametrize(
    "bad",
    [
        lambda k: (k, np.zeros((1, 2, 1, 16), np.float32)),
        lambda k: (k, [[0.0]]),
        lambda k: ([[0.0]], k),
        lambda k: (k[0], k),
        lambda k: (k, k[..., :8]),
        lambda k: (k.astype(mx.float16), k.astype(mx.float16)),
    ],
)
def test_a_bad_decode_write_is_refused_like_any_other(bad):
    """Once decode steps take ``append_view``, malformed K/V still get the cache's
    ValueError, and nothing is written."""
    model = tiny_model("llama")
    cache = make_paged_cache(model, BLOCK)
    model(prompt_tokens(20)[None], cache=cache)
    model(mx.array([[5]]), cache=cache)  # a one-token write, checked
    layer = cache[0]
    k = mx.ones((1, 2, 1, 16))
    assert layer.pool.keys[0].shape[2:] == (2, 16)
    before = mx.array(layer.pool.keys[0])
    with pytest.raises(ValueError):
        layer.update_and_fetch(*bad(k))
    assert layer.offset == 21 and mx.array_equal(layer.pool.keys[0], before).item()


# A fixed pool whose free ids and the earlier prompt's evicted ones make the run (its first
# tokens shared), and a growable pool whose earlier prompt is evicted for it.
@pytest.mark.parametrize("num_blocks, shared", [(60, 3), (None, 0)])
def test_an_engines_long_prompt_after_another_reads_in_place(num_blocks, shared):
    """Admission readies a new prompt's blocks as one run of ids (``ready_run``): each of
    its prefill chunks reads in place, and its tokens are mlx-lm's."""
    engine = PagedEngine(
        model_of("llama"), block_size=BLOCK, num_blocks=num_blocks, prefill_step_size=64
    )
    rng = random.Random(5)
    a = [rng.randrange(1, VOCAB) for _ in range(400)]
    b = a[:shared] + [rng.randrange(1, VOCAB) for _ in range(400 - shared)]
    b[shared] = (a[shared] + 1) % VOCAB or 1  # shares exactly ``shared`` tokens with a
    engine.generate([a], max_tokens=4)
    before = counts()
    assert engine.generate([b], max_tokens=1) == [solo("llama", tuple(b), 1)]
    assert grown(before, "gather") == 0 and grown(before, "in_place") == 7 * 4  # chunks, layers
    assert engine.generate([b], max_tokens=4) == [solo("llama", tuple(b), 4)]
    engine.check_invariants()
