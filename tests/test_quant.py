"""The quantized cold tier: quality against mlx-lm's QuantizedKVCache, exact block state.

Blocks behind a sequence's last ``hot_tokens`` tokens move to a cold tier of
per-block ``mx.quantize`` storage (``kv_bits``). Quality is measured against
mlx-lm's own dense and quantized caches on the same model and tokens; the
bookkeeping is checked by block id and refcount.
"""

from __future__ import annotations

import copy
import gc
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import (
    QuantizedKVCache,
    load_prompt_cache,
    make_prompt_cache,
    save_prompt_cache,
    trim_prompt_cache,
)
from tiny_models import VOCAB, tiny_model

from mlx_paged import PagedEngine, PagedKVCache, make_paged_cache
from mlx_paged.blocks import COLD, HOLE, BlockTables, TieredBlockPool, is_cold
from mlx_paged.cache import PagedLayout, make_pools
from mlx_paged.embedded import convert_gguf, find_embedded_gguf, load_model
from mlx_paged.storage import ColdLayout, ColdStore, KVQuant

BLOCK = 8
HOT = 16  # tokens kept in full precision
BATCH = 64 // BLOCK  # blocks that move together


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", head_dim=64)  # mx.quantize needs groups of 32 or more


def tokens(n: int, seed: int = 0) -> mx.array:
    mx.random.seed(seed)
    return mx.random.randint(0, VOCAB, (1, n))


def teacher_forced(model, cache, toks: mx.array, chunk: int) -> mx.array:
    """Logits at every position, feeding ``toks`` ``chunk`` tokens per forward."""
    n = toks.shape[1]
    out = [model(toks[:, i : i + chunk], cache=cache) for i in range(0, n, chunk)]
    return mx.concatenate(out, axis=1)[0].astype(mx.float32)


def kl_and_top1(reference: mx.array, other: mx.array, tie: float = 0.0) -> tuple[float, float]:
    """Mean KL(reference || other) over positions, and how often their argmax agrees.

    Positions where the reference's top two logits are within ``tie`` are left
    out of the top-1 count: rounding, not the cache, decides those.
    """
    p = reference - mx.logsumexp(reference, axis=-1, keepdims=True)
    q = other - mx.logsumexp(other, axis=-1, keepdims=True)
    kl = (mx.exp(p) * (p - q)).sum(axis=-1).mean().item()
    top2 = mx.topk(reference, 2, axis=-1)
    clear = (top2.max(-1) - top2.min(-1)) > tie
    agree = (reference.argmax(-1) == other.argmax(-1)) & clear
    return kl, agree.sum().item() / max(clear.sum().item(), 1)


# ---- quality: the embedded model, against mlx-lm's QuantizedKVCache ------------


# 176 tokens move 8 blocks to the cold tier, as 224 would (the next 4 are not yet due).
TEXT_TOKENS = 176
SCORED = 128  # the last positions, whose queries read the most cold blocks
# Top-1 leaves out positions whose two best full-precision logits are closer than this:
# 2 of the 128 here are within 0.006, and either cache may tip them.
TIE = 0.01


@pytest.fixture(scope="module")
def smollm(tmp_path_factory):
    out = tmp_path_factory.mktemp("embedded") / "smollm2"
    convert_gguf(find_embedded_gguf(), out, progress=False)
    model, tokenizer = load_model(str(out), dtype="float32")
    text = (Path(__file__).parents[1] / "README.md").read_text()
    toks = mx.array(tokenizer.encode(text)[:TEXT_TOKENS])[None]
    return model, toks, scored_logits(model, make_prompt_cache(model), toks)


def scored_logits(model, cache, toks: mx.array, chunk: int = 16) -> mx.array:
    """Teacher-forced logits of the last ``SCORED`` positions, ``chunk`` tokens per forward.

    The tied head over the vocabulary costs more than the model on the CPU, so it
    runs on the scored positions only.
    """
    hidden = [
        model.model(toks[:, i : i + chunk], cache=cache) for i in range(0, toks.shape[1], chunk)
    ]
    last = mx.concatenate(hidden, axis=1)[:, -SCORED:]
    return model.model.embed_tokens.as_linear(last)[0].astype(mx.float32)


def test_quality_is_at_least_mlx_lms_quantized_cache(smollm):
    model, toks, full = smollm
    for bits in (8, 4):
        theirs = [QuantizedKVCache(group_size=64, bits=bits) for _ in model.layers]
        ours = make_paged_cache(model, kv_bits=bits, kv_group_size=64, hot_tokens=48)
        kl_theirs, top1_theirs = kl_and_top1(full, scored_logits(model, theirs, toks), TIE)
        kl_ours, top1_ours = kl_and_top1(full, scored_logits(model, ours, toks), TIE)
        print(
            f"{bits} bits: KL {kl_ours:.2e} (mlx-lm {kl_theirs:.2e}), "
            f"top-1 {top1_ours:.3f} (mlx-lm {top1_theirs:.3f})"
        )
        cold = ours[0].pool.tier_stats()
        # The text really went cold: all but the hot tail and the blocks not yet due.
        assert cold.cold_blocks >= (TEXT_TOKENS - 48 - 64) // 16, cold
        assert 0 < kl_ours <= kl_theirs, (bits, kl_ours, kl_theirs)
        assert top1_ours >= top1_theirs, (bits, top1_ours, top1_theirs)


# ---- migration: which blocks, when, and the refcounts ------------------------


def test_blocks_behind_the_hot_tail_move_in_batches_of_64_tokens(model):
    cache = make_paged_cache(model, block_size=BLOCK, kv_bits=8, hot_tokens=HOT)
    toks = tokens(110)
    model(toks[:, :100], cache=cache)
    pool, table = cache[0].pool, cache[0].table
    assert table.blocks == list(range(13)) and pool.tier_stats().migrations == 0
    model(toks[:, 100:101], cache=cache)  # the next step's first write moves what is due
    # (100 - 16) // 8 = 10 blocks lie wholly before the hot tail: all of them move.
    assert table.blocks == [COLD + c for c in range(10)] + [10, 11, 12]
    stats = pool.blocks.stats()
    assert (stats.live_blocks, stats.free_blocks) == (3, 10)
    assert [pool.blocks.refcount(COLD + c) for c in range(10)] == [1] * 10
    for _ in range(9):  # 110 tokens: only 1 more block is due, less than a batch
        model(toks[:, :1], cache=cache)
    assert table.blocks == [COLD + c for c in range(10)] + [10, 11, 12, 0]
    assert pool.tier_stats().migrations == 10
    pool.blocks.check_invariants([table.blocks])


def test_a_shared_block_moves_once_for_every_holder(model):
    cache = make_paged_cache(model, block_size=BLOCK, kv_bits=8, hot_tokens=HOT)
    model(tokens(100)[:, :100], cache=cache)
    fork = copy.deepcopy(cache)
    pool, mine, theirs = cache[0].pool, cache[0].table, fork[0].table
    assert mine.blocks == theirs.blocks == list(range(13))
    model(tokens(1, seed=1), cache=cache)
    cold = [COLD + c for c in range(10)]
    # One quantized copy; the fork's table points at it too.
    assert mine.blocks[:10] == theirs.blocks[:10] == cold
    assert [pool.blocks.refcount(b) for b in cold] == [2] * 10
    assert pool.tier_stats().cold_blocks == 10
    pool.blocks.check_invariants([mine.blocks, theirs.blocks])
    # Both read the same, quantized, K/V for the 100 shared tokens.
    mine_k = cache[0].keys_and_values()[0]
    assert mx.array_equal(fork[0].keys_and_values()[0], mine_k[:, :, :100])
    del cache, fork, mine, theirs
    gc.collect()
    assert pool.tier_stats().cold_blocks == 0 and pool.blocks.stats().live_blocks == 0


def test_writing_into_a_cold_block_copies_it_to_a_hot_one(model):
    cache = make_paged_cache(model, block_size=BLOCK, kv_bits=8, hot_tokens=HOT)
    toks = tokens(101)
    model(toks[:, :100], cache=cache)
    model(toks[:, 100:101], cache=cache)
    table, pool = cache[0].table, cache[0].pool
    assert is_cold(table.blocks[9])
    expected = copy.deepcopy(cache)
    trim_prompt_cache(cache, 101 - 75)  # 75 tokens: block 9 is cold and now the tail
    trim_prompt_cache(expected, 101 - 75)
    before = expected[0].keys_and_values()[0]
    model(toks[:, 75:76], cache=cache)
    assert not is_cold(table.blocks[9])  # a fresh full-precision block
    assert pool.blocks.refcount(expected[0].table.blocks[9]) == 1  # only the copy holds it now
    after = cache[0].keys_and_values()[0]
    # The dequantized tokens were copied; the new token landed after them.
    assert mx.array_equal(after[:, :, :75], before)
    pool.blocks.check_invariants([table.blocks, expected[0].table.blocks])


def test_a_full_cold_tier_leaves_blocks_hot(model):
    layout = PagedLayout.of(model)
    pools = make_pools(layout, BLOCK, None, None, KVQuant(8, 64, HOT), cold_blocks=4)
    (pool,) = pools.values()
    table = pool.new_table()
    caches = layout.bind(pools, {kind: table for kind in pools})
    toks = tokens(101)
    dense = make_prompt_cache(model)
    model(toks[:, :100], cache=caches)
    model(toks[:, :100], cache=dense)
    out = model(toks[:, 100:101], cache=caches)
    assert table.blocks == [COLD + c for c in range(4)] + list(range(4, 13))
    assert pool.tier_stats().cold_blocks == 4
    ref = model(toks[:, 100:101], cache=dense)
    assert mx.abs(out - ref).max().item() < 0.5  # 4 of 13 blocks at 8 bits


def test_a_hot_tail_longer_than_the_text_changes_nothing(model):
    toks = tokens(120)
    full = teacher_forced(model, make_paged_cache(model, block_size=BLOCK), toks, 8)
    tiered = make_paged_cache(model, block_size=BLOCK, kv_bits=4, hot_tokens=120)
    assert mx.array_equal(teacher_forced(model, tiered, toks, 8), full)
    assert tiered[0].pool.tier_stats().migrations == 0


def test_reads_mixing_tiers_in_any_order_match_block_by_block(model):
    cache = make_paged_cache(model, block_size=BLOCK, kv_bits=8, hot_tokens=0)
    toks = tokens(80)
    model(toks[:, :72], cache=cache)
    model(toks[:, 72:73], cache=cache)
    pool, table = cache[0].pool, cache[0].table
    cold = [b for b in table.blocks if is_cold(b)]
    hot = [b for b in table.blocks if not is_cold(b)]
    assert len(cold) == 9 and hot
    rows = [cold[:3] + hot[:1] + cold[3:5], hot[:1] + cold[5:9] + hot[:1], cold[:6]]
    for plan_rows in (rows, [rows[2]]):  # mixed rows (masked), and a cold prefix
        plan = pool.tier_plan(plan_rows)
        for layer in (0, 2):
            k, v = pool.read_tiered(layer, plan)
            for i, r in enumerate(plan_rows):
                bk, bv = pool.block_rows(layer, r)  # (n, bs, H, D)
                want_k = bk.transpose(2, 0, 1, 3).reshape(1, bk.shape[2], -1, bk.shape[3])
                want_v = bv.transpose(2, 0, 1, 3).reshape(1, bv.shape[2], -1, bv.shape[3])
                assert mx.array_equal(k[i : i + 1], want_k)
                assert mx.array_equal(v[i : i + 1], want_v)


def test_a_batch_reading_cold_blocks_matches_each_sequence_alone(model):
    # Two sequences of different lengths: their cold blocks end at different columns,
    # so the batch's read picks tiers per row (the masked path of read_tiered).
    long = make_paged_cache(model, block_size=BLOCK, kv_bits=8, hot_tokens=HOT)
    toks = tokens(130)
    model(toks[:, :100], cache=long)
    short = copy.deepcopy(long)
    trim_prompt_cache(short, 100 - 60)
    model(toks[:, 100:130], cache=long)  # long: 130 tokens, short: 60
    model(toks[:, 60:61], cache=short)
    alone = [copy.deepcopy(long), copy.deepcopy(short)]
    step = tokens(2, seed=3).reshape(2, 1)
    batch = [type(a).merge([a, b]) for a, b in zip(long, short, strict=True)]
    together = model(step, cache=batch)
    assert any(map(is_cold, long[0].table.blocks)) and any(map(is_cold, short[0].table.blocks))
    for i, cache in enumerate(alone):
        mine = model(step[i : i + 1], cache=cache)
        assert mx.allclose(together[i : i + 1], mine, atol=1e-4), i


def test_nbytes_counts_each_block_in_its_tier(model):
    cache = make_paged_cache(model, block_size=BLOCK, kv_bits=4, hot_tokens=HOT)
    toks = tokens(101)
    model(toks[:, :100], cache=cache)
    hot_only = cache[0].nbytes
    model(toks[:, 100:101], cache=cache)
    # float32 K/V of 2 heads x 64 per token; 4 bits plus a float32 scale and bias per 64.
    hot_block = 2 * BLOCK * 2 * 64 * 4
    cold_block = 2 * BLOCK * 2 * (64 // 2 + 2 * 4)
    assert hot_only == 13 * hot_block
    assert cache[0].nbytes == 3 * hot_block + 10 * cold_block
    stats = cache[0].pool.tier_stats()
    assert stats.cold_blocks == 10 and stats.compression > 3


def test_save_and_load_keep_cold_blocks(model, tmp_path):
    cache = make_paged_cache(model, block_size=BLOCK, kv_bits=8, hot_tokens=HOT)
    toks = tokens(102)
    model(toks[:, :100], cache=cache)
    model(toks[:, 100:101], cache=cache)
    path = str(tmp_path / "cache.safetensors")
    save_prompt_cache(path, cache)
    loaded = load_prompt_cache(path)
    assert isinstance(loaded[0], PagedKVCache)
    assert sum(map(is_cold, loaded[0].table.blocks)) == 10
    a = model(toks[:, 101:102], cache=cache)
    b = model(toks[:, 101:102], cache=loaded)
    assert mx.array_equal(a, b)


# ---- mlx-lm's kv_bits, the engine, and bad input -----------------------------


def test_mlx_lm_kv_bits_keeps_the_cache_paged_and_quantizes_it(model):
    cache = make_paged_cache(model, block_size=BLOCK)
    prompt = tokens(300)[0]
    steps = generate_step(
        prompt,
        model,
        prompt_cache=cache,
        kv_bits=8,
        kv_group_size=64,
        max_tokens=40,
        quantized_kv_start=0,
    )
    list(steps)
    assert all(isinstance(c, PagedKVCache) for c in cache)
    pool = cache[0].pool
    assert pool.quant == KVQuant(8, 64, 256)
    # 256 tokens stay hot; 8 blocks (64 tokens) move together, at 320 tokens. By the
    # end (339 tokens written) 10 blocks lie behind the hot tail: 2 wait for a batch.
    assert pool.tier_stats().cold_blocks == 8


def test_the_engine_quantizes_shares_and_frees_cold_blocks(model):
    engine = PagedEngine(model, block_size=BLOCK, kv_bits=8, hot_tokens=HOT, max_batch_size=4)
    prefix = tokens(96)[0].tolist()
    prompts = [prefix + tokens(5, seed=s)[0].tolist() for s in range(1, 4)]
    out = engine.generate(prompts[:1], max_tokens=20)
    first = engine.stats()
    assert first.cold_blocks > 0 and first.migrations > 0
    # The next requests adopt the parked prefix, cold blocks included.
    engine.generate(prompts[1:], max_tokens=20)
    assert engine.stats().prefix_hit_tokens >= 2 * 96
    engine.check_invariants()
    stats = engine.stats()
    assert stats.live_blocks == 0 and stats.running == 0 and len(out[0]) == 20
    assert stats.cold_blocks > 0  # parked in the prefix index, still cold


def test_one_sequences_batch_moves_every_sequences_blocks_behind_its_hot_tail(model):
    """Sequences of staggered lengths share a migration: once one has a batch (8 blocks of
    8) behind its hot tail, the blocks behind the others' tails move with it."""
    engine = PagedEngine(model, block_size=BLOCK, kv_bits=8, hot_tokens=HOT, max_batch_size=2)
    engine.add_request(tokens(90)[0].tolist(), max_tokens=6)
    engine.add_request(tokens(40, seed=1)[0].tolist(), max_tokens=6)
    engine.step()  # both prefilled, then the decode step's migration, then its writes
    long, short = (r.tables[next(iter(r.tables))] for r in engine.running)
    # (90 - 16) // 8 = 9 blocks behind the long one's tail: a batch. (40 - 16) // 8 = 3
    # behind the short one's: alone they would wait for 5 more.
    assert [b >= COLD for b in long.blocks] == [True] * 9 + [False] * 3
    assert [b >= COLD for b in short.blocks] == [True] * 3 + [False] * 3
    cold = long.blocks[:9] + short.blocks[:3]
    assert sorted(cold) == [COLD + c for c in range(12)]
    pool = engine.runner.pools[next(iter(engine.runner.pools))]
    # Each held by its sequence and by the prefix index, as its hot block was.
    assert [pool.blocks.refcount(b) for b in cold] == [2] * 12
    stats = engine.stats()
    assert (stats.migrations, stats.cold_blocks, stats.live_blocks) == (12, 12, 6)
    for _ in range(5):  # 96 and 46 tokens: one block behind each tail, no batch
        engine.step()
    assert engine.stats().migrations == 12
    engine.check_invariants()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"kv_bits": 3}, "kv_bits must be one of"),
        ({"kv_bits": 8, "kv_group_size": 48}, "kv_group_size must be one of"),
        ({"kv_bits": 8, "hot_tokens": -1}, "hot_tokens must be an int >= 0"),
        ({"kv_dtype": mx.int8}, "kv_dtype must be a floating"),
    ],
)
def test_bad_options_are_refused(model, kwargs, message):
    with pytest.raises(ValueError, match=message):
        make_paged_cache(model, **kwargs)
    with pytest.raises(ValueError, match=message):
        PagedEngine(model, **kwargs)


def test_a_group_size_that_does_not_divide_the_head_dim_is_refused():
    model = tiny_model("llama")  # head_dim 16
    cache = make_paged_cache(model, kv_bits=8, kv_group_size=32)
    with pytest.raises(ValueError, match="does not divide the head dim 16"):
        model(tokens(4), cache=cache)


def test_switching_bits_on_a_quantized_pool_is_refused(model):
    cache = make_paged_cache(model, block_size=BLOCK, kv_bits=8)
    with pytest.raises(ValueError, match="already quantizes to 8 bits"):
        cache[0].to_quantized(group_size=64, bits=4)


# ---- the tiered pool, under random operations --------------------------------


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 50)), max_size=60))
def test_tiered_refcounts_match_holders(ops):
    pool = TieredBlockPool(8, BLOCK, cold_blocks=4)
    tables: list[list[int]] = [[], []]
    renamed: dict[int, int] = {}
    pool.on_rename = renamed.update
    for op, arg in ops:
        table = tables[arg % 2]
        held = [b for t in tables for b in t]
        if op == 0 and pool.can_allocate(1):
            table.extend(pool.allocate(1))
        elif op == 1 and held:
            b = held[arg % len(held)]
            pool.retain(b)
            table.append(b)
        elif op == 2 and table:
            pool.release(table.pop(arg % len(table)))
        elif op == 3 and table:
            b = table[arg % len(table)]
            if b not in pool.parked_ids():
                pool.park(b)
        elif op == 4 and pool.parked_ids():
            parked = sorted(pool.parked_ids())
            pool.unpark(parked[arg % len(parked)])
        elif op == 5 and table and not is_cold(table[arg % len(table)]):
            old = table[arg % len(table)]
            new = pool.migrate(old)
            if new is not None:
                assert renamed[old] == new and is_cold(new)
                for t in tables:
                    t[:] = [new if b == old else b for b in t]
        pool.check_invariants(tables)
    for t in tables:
        pool.release_all(t)
    for b in sorted(pool.parked_ids()):
        pool.unpark(b)
    assert pool.num_free == 8 and pool.cold.num_free == pool.cold.capacity


@settings(max_examples=80, deadline=None)
@given(
    st.lists(st.sampled_from(["hot", "cold", "hole"]), max_size=24),
    st.lists(st.integers(0, 400), min_size=1, max_size=3),
    st.integers(0, 4),
    st.sampled_from([0, 16, 40]),
    st.integers(0, 5),
)
def test_batch_due_agrees_with_the_cold_candidates(kinds, lengths, first, hot, batch):
    """The one-comparison check says a batch is due exactly when the blocks behind the
    hot tail number ``batch`` or more, and follows the table as it grows and migrates."""
    pool = TieredBlockPool(None, BLOCK)
    tables = BlockTables(len(lengths), BLOCK, pool=pool)
    table = tables.new_table()
    for kind in kinds:
        b = HOLE if kind == "hole" else pool.allocate(1)[0]
        table.blocks.append(pool.migrate(b) if kind == "cold" else b)
    table.first = first
    for step in range(6):  # the same table as it grows, as blocks move, as it gains some
        table.lengths[:] = [n + step * 12 for n in lengths]
        # Every token lies in a block: new ones as a fresh table is filled (no version).
        table.blocks.extend(pool.allocate(tables._missing(table, max(table.lengths))))
        behind = (min(table.lengths) - hot) // BLOCK - table.first
        scanned = [b for b in table.blocks[: max(behind, 0)] if 0 <= b < COLD]
        assert tables.cold_candidates(table, hot) == scanned
        assert (tables.steps_until_due([table], hot, batch) <= 0) == (len(scanned) >= batch)
        if step % 2:
            table.blocks.append(pool.allocate(1)[0])  # as a fresh table is filled: no version
        else:
            tables.migrate([b for b in table.blocks[:2] if 0 <= b < COLD])


# ---- the cold store: every layer's blocks in one array per part ---------------


def cold_rows(layers: int, n: int, heads: int, seed: int) -> tuple[mx.array, mx.array]:
    """Random ``(layers, n, BLOCK, heads, 64)`` K and V, each layer different."""
    k, v = mx.random.split(mx.random.key(seed))
    shape = (layers, n, BLOCK, heads, 64)
    return mx.random.normal(shape, key=k), mx.random.normal(shape, key=v)


def test_a_cold_store_stacks_its_layers_and_each_reads_its_own():
    quant = KVQuant(8, 32)
    store, at = ColdStore(3, quant), mx.array([5, 1])
    keys, values = cold_rows(3, 2, 2, seed=0)
    store.store_layers(keys, values, at, 8)
    assert store.where == [(0, 0), (0, 1), (0, 2)]
    # 64 8-bit elements are 16 words, in 2 groups of 32: a block's record holds K's and
    # V's 2 x 16 words a token, then their 4 x 2 float32 scales and biases.
    assert store.layouts == [ColdLayout(BLOCK, 2, 16, 2, 2, 16, 2, mx.float32)]
    assert [x.shape for x in store.blobs] == [(3, 8, BLOCK * 2 * (16 + 16 + 4 * 2))]
    (kw, ks, kb), (vw, _, _) = store.layer_parts(0)
    assert kw.shape == vw.shape == (8, BLOCK, 2, 16) and ks.shape == kb.shape == (8, BLOCK, 2, 2)
    for layer in range(3):
        k, v = store.read(layer, at)
        assert mx.array_equal(k, quant.dequantize(quant.quantize(keys[layer])))
        assert mx.array_equal(v, quant.dequantize(quant.quantize(values[layer])))
        (kw, _, _), _ = store.layer_parts(layer)
        assert mx.array_equal(kw[at], quant.quantize(keys[layer])[0])
    # Layer by layer (the disk tier's writes), the same rows of the same arrays.
    apart = ColdStore(3, quant)
    for layer in range(3):
        apart.write(layer, quant.quantize(keys[layer]), quant.quantize(values[layer]), at, 8)
    assert apart.where == store.where
    for a, b in zip(apart.blobs, store.blobs, strict=True):
        assert mx.array_equal(a, b)
    # A larger tier grows every array along its slots and keeps the rows written.
    more_k, more_v = cold_rows(3, 1, 2, seed=1)
    store.store_layers(more_k, more_v, mx.array([11]), 12)
    assert [x.shape[:2] for x in store.blobs] == [(3, 12)]
    for layer in range(3):
        assert mx.array_equal(store.read(layer, at)[0], apart.read(layer, at)[0])
        assert mx.array_equal(
            store.read(layer, mx.array([11]))[1],
            quant.dequantize(quant.quantize(more_v[layer])),
        )
    assert store.bytes_per_block() == 3 * 2 * BLOCK * 2 * (16 * 4 + 2 * 4 + 2 * 4)


def test_layers_of_other_shapes_stack_apart():
    """Layers with other head counts (OpenELM's, say) make a stack of their own; each
    layer's index runs within its stack."""
    quant = KVQuant(4, 32)
    store, at = ColdStore(3, quant), mx.array([2])
    rows = [cold_rows(1, 1, heads, seed=h) for h, heads in enumerate((2, 4, 2))]
    for layer, (k, v) in enumerate(rows):
        store.write(layer, quant.quantize(k[0]), quant.quantize(v[0]), at, 4)
    assert store.where == [(0, 0), (1, 0), (0, 1)] and len(store.blobs) == 2
    assert [x.shape[:2] for x in store.blobs] == [(2, 4), (1, 4)]
    assert [layout.k_heads for layout in store.layouts] == [2, 4]
    for layer, (k, v) in enumerate(rows):
        got_k, got_v = store.read(layer, at)
        assert mx.array_equal(got_k, quant.dequantize(quant.quantize(k[0])))
        assert mx.array_equal(got_v, quant.dequantize(quant.quantize(v[0])))


def test_a_cold_records_parts_lie_where_the_decode_kernel_reads_them():
    """A block's record: K's words, V's words, then K's scales and biases and V's in the
    scales' dtype, padded to four words; ``split`` gives back exactly what ``join`` took."""
    bs, h, gs = 4, 3, 64
    k = mx.random.normal((2, bs, h, 64)).astype(mx.float16)
    v = mx.random.normal((2, bs, h, 128)).astype(mx.float16)
    kq, vq = (mx.quantize(x, group_size=gs, bits=4) for x in (k, v))
    layout = ColdLayout.of(kq, vq)
    assert layout == ColdLayout(bs, h, 8, 1, h, 16, 2, mx.float16)
    # 12 rows of 8 + 16 words, then 12 x (1 + 1 + 2 + 2) halves (36 words), padded to 4
    assert layout.words == 12 * 24 + 36 == 324
    records = layout.join(kq, vq)
    assert records.shape == (2, 324) and records.dtype == mx.uint32
    flat = np.array(records)
    np.testing.assert_array_equal(flat[:, :96], np.array(kq[0]).reshape(2, -1))
    np.testing.assert_array_equal(flat[:, 96:288], np.array(vq[0]).reshape(2, -1))
    halves = flat[:, 288:].copy().view(np.float16)
    want = [np.array(x).reshape(2, -1) for x in (kq[1], kq[2], vq[1], vq[2])]
    np.testing.assert_array_equal(halves, np.concatenate(want, axis=1))
    for got, parts in zip(layout.split(records), (kq, vq), strict=True):
        for a, b in zip(got, parts, strict=True):
            assert a.shape == b.shape and a.dtype == b.dtype and mx.array_equal(a, b)
    padded = ColdLayout(bs, 1, 8, 1, 1, 8, 1, mx.float16)  # 4 x 16 + 4 x 4 halves / 2 = 72
    assert padded.words == 72 and ColdLayout(3, 1, 8, 1, 1, 8, 1, mx.float16).words == 56
    with pytest.raises(ValueError, match="cold records"):
        layout.split(records[:, :-4])


def test_layers_stacked_out_of_order_take_store_layers_one_by_one():
    quant = KVQuant(8, 32)
    store, at = ColdStore(3, quant), mx.array([1])
    keys, values = cold_rows(3, 1, 2, seed=2)
    for layer in (2, 0, 1):  # a disk load that met the layers in this order
        store.write(layer, quant.quantize(keys[layer]), quant.quantize(values[layer]), at, 4)
    assert store.where == [(0, 1), (0, 2), (0, 0)]
    more_k, more_v = cold_rows(3, 1, 2, seed=3)
    store.store_layers(more_k, more_v, mx.array([3]), 4)
    for layer in range(3):
        assert mx.array_equal(
            store.read(layer, at)[0], quant.dequantize(quant.quantize(keys[layer]))
        )
        got = store.read(layer, mx.array([3]))[1]
        assert mx.array_equal(got, quant.dequantize(quant.quantize(more_v[layer])))


def test_a_fresh_stores_layers_loaded_together_make_one_stack_at_once(monkeypatch):
    """The disk tier's load writes every layer's blocks together: a fresh store makes their
    stack in one piece instead of growing it a layer at a time (a copy of it per layer)."""
    from mlx_paged.storage import cold

    grown = []
    monkeypatch.setattr(cold, "grow_rows", lambda *a, **kw: grown.append(a) or a[0])
    quant = KVQuant(8, 32)
    keys, values = cold_rows(3, 2, 2, seed=4)
    parts = [[quant.quantize(x[layer]) for layer in range(3)] for x in (keys, values)]
    store, at = ColdStore(3, quant), mx.array([0, 2])
    store.write_layers(list(zip(*parts, strict=True)), at, 4)
    assert store.where == [(0, 0), (0, 1), (0, 2)] and not grown
    assert [x.shape for x in store.blobs] == [(3, 4, BLOCK * 2 * (16 + 16 + 4 * 2))]
    for layer in range(3):
        assert mx.array_equal(store.read(layer, at)[1], quant.dequantize(parts[1][layer]))
    # Layers of other shapes still go to stacks of their own.
    mixed = ColdStore(2, quant)
    wide_k, wide_v = cold_rows(1, 2, 4, seed=5)
    wide = (quant.quantize(wide_k[0]), quant.quantize(wide_v[0]))
    mixed.write_layers([(parts[0][0], parts[1][0]), wide], at, 4)
    assert mixed.where == [(0, 0), (1, 0)]
    assert mx.array_equal(mixed.read(1, at)[0], quant.dequantize(quant.quantize(wide_k[0])))


@pytest.mark.parametrize("family, bits", [("llama", 8), ("gemma3_text", 4)])
def test_cold_bytes_per_block_is_what_the_engines_cold_blocks_take(family, bits):
    """``--cold-memory`` divides by what one cold block takes: every full-attention layer's
    record, and nothing for gemma3's sliding-window layers (they stay full precision)."""
    from mlx_paged.cache.memory import cold_bytes_per_block

    model = tiny_model(family, head_dim=64)
    quant = KVQuant(bits, 32, 0)
    engine = PagedEngine(model, block_size=BLOCK, kv_bits=bits, kv_group_size=32, hot_tokens=0)
    engine.generate([tokens(80)[0].tolist()], max_tokens=2)
    tiered = [p for p in engine.runner.pools.values() if p.quant is not None]
    assert len(tiered) == 1 and tiered[0].blocks.cold.capacity > 0
    per_block = tiered[0].blocks.cold.bytes_per_block
    assert cold_bytes_per_block(model, BLOCK, None, quant) == per_block > 0
    # float16 storage halves the scales and biases, not the packed words.
    half = cold_bytes_per_block(model, BLOCK, mx.float16, quant)
    assert per_block / 2 < half < per_block


def test_both_tiers_bounded_still_finish_every_request(model):
    """A server's ``--kv-memory`` with ``--cold-blocks``: blocks that find no cold slot stay
    full precision, requests short of full-precision blocks wait or are preempted, and every
    request still gets all its tokens, with nothing leaked."""
    engine = PagedEngine(
        model,
        block_size=BLOCK,
        num_blocks=36,
        kv_bits=8,
        hot_tokens=HOT,
        cold_blocks=6,
        max_batch_size=4,
    )
    prompts = [tokens(60, seed=s)[0].tolist() for s in range(4)]
    out = engine.generate(prompts, max_tokens=30)  # 12 blocks each, 48 in all
    assert [len(o) for o in out] == [30] * 4
    stats = engine.stats()
    assert stats.preemptions > 0 and stats.migrations >= 6
    assert stats.cold_blocks <= 6 and stats.live_blocks == 0 and stats.running == 0
    engine.check_invariants()
