"""End-to-end parity: mlx-lm on a paged cache against mlx-lm's own dense cache."""

from __future__ import annotations

import copy

import mlx.core as mx
import pytest
from mlx_lm.generate import generate, generate_step, stream_generate
from mlx_lm.models.cache import (
    ChunkedKVCache,
    KVCache,
    QuantizedKVCache,
    can_trim_prompt_cache,
    load_prompt_cache,
    make_prompt_cache,
    save_prompt_cache,
    trim_prompt_cache,
)
from mlx_lm.tokenizer_utils import TokenizerWrapper
from tiny_models import FAMILIES, HYBRIDS, VOCAB, tiny_model

from mlx_paged import PagedKVCache, make_paged_cache
from mlx_paged.attention import path_counts, set_attention_path

BLOCK = 8
PROMPT_LEN = 45  # not a multiple of BLOCK; crosses every sliding window
DECODE_STEPS = 30
TOL = 1e-4
# Families whose sliding layers use mlx-lm's RotatingKVCache, which orders keys
# differently once it wraps: sums then differ in the last bits.
ROTATING = {"ministral3", "gemma3_text", "gpt_oss"}
# Families with recurrent layers, whose native ArraysCache is not trimmable.
RECURRENT = set(HYBRIDS)


@pytest.fixture(scope="module", params=FAMILIES)
def family_model(request):
    return request.param, tiny_model(request.param)


def prompt_tokens(n: int, seed: int = 1) -> mx.array:
    return mx.random.randint(0, VOCAB, (n,), key=mx.random.key(seed))


def run_generate_step(model, prompt, cache, steps=DECODE_STEPS, prefill_step_size=16, **kwargs):
    """Greedy tokens and the raw logits of every step (``kwargs`` go to ``generate_step``)."""
    logits = []

    def record(_tokens, x):
        logits.append(x)
        return x

    tokens = []
    for (tok, _), _ in zip(
        generate_step(
            prompt,
            model,
            prompt_cache=cache,
            prefill_step_size=prefill_step_size,
            max_tokens=steps,
            logits_processors=[record],
            **kwargs,
        ),
        range(steps),
        strict=False,
    ):
        tokens.append(tok)
    return tokens, mx.concatenate(logits)


@pytest.mark.skipif(not mx.is_available(mx.gpu), reason="only a GPU machine can differ")
def test_unmarked_tests_generate_on_the_cpu():
    """mlx-lm's generate_step runs on the stream mlx-lm made at import, on the default device
    then: conftest makes that the CPU first, so unmarked tests run where they say, not on a
    GPU's nondeterministic reductions (BatchGenerator parity flaked there before)."""
    from mlx_lm.generate import generation_stream

    assert generation_stream.device == mx.cpu


def max_diff(a: mx.array, b: mx.array) -> float:
    return mx.abs(a - b).max().item()


def check(family: str, diff: float) -> None:
    if family in ROTATING:
        assert diff <= TOL, f"{family}: max |dense - paged| = {diff}"
    else:
        assert diff == 0.0, f"{family}: max |dense - paged| = {diff} on the gather path"


def feed(model, cache, tokens: list[int]) -> mx.array:
    """Run tokens through the model; return the last position's logits."""
    out = model(mx.array(tokens)[None], cache=cache)[:, -1, :]
    mx.eval(out)
    return out


def test_generate_step_logits_match_dense(family_model):
    family, model = family_model
    prompt = prompt_tokens(PROMPT_LEN)
    before = path_counts["gather"] + path_counts["in_place"]
    dense_tokens, dense = run_generate_step(model, prompt, make_prompt_cache(model))
    paged_tokens, paged = run_generate_step(model, prompt, make_paged_cache(model, BLOCK))
    print(f"\n{family}: max |dense - paged| logits = {max_diff(dense, paged):.3g}")
    # generate_step computes one step ahead of what it yields.
    assert dense.shape == paged.shape == (DECODE_STEPS + 1, VOCAB)
    assert paged_tokens == dense_tokens
    check(family, max_diff(dense, paged))
    routed = path_counts["gather"] + path_counts["in_place"]
    assert routed > before, "paged attention was not routed"


def test_generate_and_stream_generate_text_match(family_model):
    family, model = family_model
    tokenizer = word_tokenizer()
    prompt = " ".join(f"w{i}" for i in prompt_tokens(PROMPT_LEN, seed=2).tolist())
    kwargs = dict(max_tokens=DECODE_STEPS, prefill_step_size=16)
    dense = generate(model, tokenizer, prompt, prompt_cache=make_prompt_cache(model), **kwargs)
    paged = generate(
        model, tokenizer, prompt, prompt_cache=make_paged_cache(model, BLOCK), **kwargs
    )
    assert paged == dense and len(dense.split()) > 5
    streamed = "".join(
        r.text
        for r in stream_generate(
            model, tokenizer, prompt, prompt_cache=make_paged_cache(model, BLOCK), **kwargs
        )
    )
    assert streamed == dense


def test_deepcopy_fork_matches_dense_fork(family_model):
    family, model = family_model
    prefix = prompt_tokens(PROMPT_LEN, seed=3).tolist()
    dense, paged = make_prompt_cache(model), make_paged_cache(model, BLOCK)
    feed(model, dense, prefix)
    feed(model, paged, prefix)
    dense_fork, paged_fork = copy.deepcopy(dense), copy.deepcopy(paged)
    worst = 0.0
    for step in range(6):
        # The original and the fork continue with different tokens.
        a, b = [(7 * step + 1) % VOCAB], [(11 * step + 5) % VOCAB]
        worst = max(worst, max_diff(feed(model, dense, a), feed(model, paged, a)))
        worst = max(worst, max_diff(feed(model, dense_fork, b), feed(model, paged_fork, b)))
    check(family, worst)

    # Forks share the prefix blocks instead of copying them.
    def full(caches):  # full-attention layers, looking into CacheList (falcon_h1)
        flat = [x for c in caches for x in getattr(c, "caches", [c])]
        return [c for c in flat if isinstance(c, PagedKVCache) and c.window is None]

    orig, fork = full(paged)[0].table.blocks, full(paged_fork)[0].table.blocks
    shared = PROMPT_LEN // BLOCK
    assert orig[:shared] == fork[:shared]
    assert orig[shared] != fork[shared]  # the partial tail was copied on write


def test_trim_matches_dense(family_model):
    family, model = family_model
    prompt = prompt_tokens(11, seed=4).tolist()  # short: sliding caches stay trimmable
    dense, paged = make_prompt_cache(model), make_paged_cache(model, BLOCK)
    for cache in (dense, paged):
        feed(model, cache, prompt)
        for t in (3, 9, 27, 81, 5, 6):
            feed(model, cache, [t])
    assert can_trim_prompt_cache(dense) == can_trim_prompt_cache(paged)
    if not can_trim_prompt_cache(dense):
        assert family in RECURRENT  # recurrent state cannot be rolled back
        return
    assert trim_prompt_cache(dense, 4) == trim_prompt_cache(paged, 4) == 4
    assert paged[0].offset == dense[0].offset == 13
    worst = 0.0
    for t in (100, 50, 25):
        worst = max(worst, max_diff(feed(model, dense, [t]), feed(model, paged, [t])))
    check(family, worst)


def test_save_load_round_trip(family_model, tmp_path):
    family, model = family_model
    prefix = prompt_tokens(PROMPT_LEN, seed=5).tolist()
    dense, paged = make_prompt_cache(model), make_paged_cache(model, BLOCK)
    feed(model, dense, prefix)
    feed(model, paged, prefix)
    path = str(tmp_path / "cache.safetensors")
    save_prompt_cache(path, paged, {"family": family})
    loaded, meta = load_prompt_cache(path, return_metadata=True)
    assert meta == {"family": family}
    assert [type(c) for c in loaded] == [type(c) for c in paged]
    for a, b in zip(paged, loaded, strict=True):
        if isinstance(a, PagedKVCache):
            assert b.offset == a.offset and b.window == a.window
            for x, y in zip(a.gather_visible(), b.gather_visible(), strict=True):
                assert mx.array_equal(x, y)
    worst = 0.0
    for t in (1, 2, 3):
        worst = max(worst, max_diff(feed(model, dense, [t]), feed(model, loaded, [t])))
    check(family, worst)


def test_sliding_layers_give_back_blocks():
    model = tiny_model("gemma3_text")  # window 24, every other layer sliding
    cache = make_paged_cache(model, BLOCK)
    feed(model, cache, prompt_tokens(100).tolist())
    sliding = [c for c in cache if c.window is not None]
    full = [c for c in cache if c.window is None]
    # Blocks go back on the write after the one that left them behind: the
    # queries of a step still read them.
    assert sliding[0].table.first == 0
    feed(model, cache, [5])
    assert len(full[0].table.blocks) == -(-101 // BLOCK)
    # The query at 100 sees keys from 100 - 24 + 1 = 77, which sits in block 9.
    assert sliding[0].table.first == 77 // BLOCK
    assert len(sliding[0].table.blocks) == -(-101 // BLOCK) - 77 // BLOCK
    stats = sliding[0].pool.blocks.stats()
    assert stats.live_blocks == len(sliding[0].table.blocks)


def test_kv_dtype_stores_float16():
    model = tiny_model("llama")
    prompt = prompt_tokens(PROMPT_LEN)
    dense_tokens, dense = run_generate_step(model, prompt, make_prompt_cache(model))
    cache = make_paged_cache(model, BLOCK, kv_dtype=mx.float16)
    tokens, paged = run_generate_step(model, prompt, cache)
    assert cache[0].pool.keys[0].dtype == mx.float16
    assert cache[0].gather_visible()[0].dtype == mx.float32
    # Rounding K/V to fp16 moves logits a little, and only a little.
    assert 0 < max_diff(dense, paged) < 1e-2 * mx.abs(dense).max().item()


def test_nbytes_size_empty():
    model = tiny_model("llama")
    cache = make_paged_cache(model, BLOCK)
    assert cache[0].empty() and cache[0].nbytes == 0 and bool(cache[0])
    feed(model, cache, prompt_tokens(20).tolist())
    c = cache[0]
    assert not c.empty() and c.size() == 20
    # 3 blocks of 8 tokens, 2 KV heads, head_dim 16, K and V, float32.
    assert c.nbytes == 3 * BLOCK * 2 * 16 * 2 * 4
    assert not hasattr(c, "bits")


class FakeModel:
    def __init__(self, model_type, caches):
        self.model_type = model_type
        self._caches = caches
        self.layers = caches

    def make_cache(self):
        return list(self._caches)


@pytest.mark.parametrize(
    "model_type, caches, pattern",
    [
        ("llama4", [KVCache(), ChunkedKVCache(64)], "llama4: ChunkedKVCache"),
        ("deepseek_v41", [object()], "deepseek_v41: cache type object"),
        ("some_quantized", [QuantizedKVCache()], "some_quantized: cache type QuantizedKVCache"),
    ],
)
def test_unsupported_layouts_raise(model_type, caches, pattern):
    with pytest.raises(ValueError, match=pattern):
        make_paged_cache(FakeModel(model_type, caches))


@pytest.mark.parametrize("block_size", [0, -4, 1.5, "16", True, None])
def test_bad_block_size(block_size):
    with pytest.raises(ValueError, match="block_size must be a positive int"):
        make_paged_cache(tiny_model("llama"), block_size=block_size)


@pytest.mark.parametrize("num_blocks", [0, -1, 2.0])
def test_bad_num_blocks(num_blocks):
    with pytest.raises(ValueError, match="num_blocks"):
        make_paged_cache(tiny_model("llama"), num_blocks=num_blocks)


def test_bad_kv_dtype():
    with pytest.raises(ValueError, match="kv_dtype"):
        make_paged_cache(tiny_model("llama"), kv_dtype="float16")


def test_prompt_larger_than_pool():
    model = tiny_model("llama")
    cache = make_paged_cache(model, BLOCK, num_blocks=4)  # 32 token slots
    with pytest.raises(ValueError, match="num_blocks"):
        feed(model, cache, prompt_tokens(PROMPT_LEN).tolist())


def test_batched_input_rejected():
    model = tiny_model("llama")
    cache = make_paged_cache(model, BLOCK)
    with pytest.raises(ValueError, match="one sequence"):
        model(mx.zeros((2, 4), dtype=mx.int32), cache=cache)


def word_tokenizer() -> TokenizerWrapper:
    """A word-level tokenizer over the tiny vocab: token i is the word ``w{i}``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0")
    return TokenizerWrapper(hf)


def test_caches_do_not_keep_the_kv_they_returned_alive():
    """A layer's gathered K/V must die with the model's use of them (a prefill would
    otherwise hold every layer's copy at once)."""
    import weakref

    from mlx_paged.cache import DecodeBatch, StepPagedKVCache

    model = tiny_model("llama")
    cache = make_paged_cache(model, BLOCK)
    set_attention_path("kernel")  # a gathered copy, not views of the pool
    try:
        k = mx.random.normal((1, 2, 5, 16))
        keys, values = cache[0].update_and_fetch(k, k)
    finally:
        set_attention_path("auto")
    refs = [weakref.ref(keys), weakref.ref(values)]
    assert cache[0].fetched(keys, values, None)
    del keys, values
    assert all(r() is None for r in refs)

    pool, table = cache[0].pool, cache[0].table
    pool.reserve(table, 5, 6)
    batch_cache = StepPagedKVCache(pool, DecodeBatch(pool, [table], None), 0)
    keys, values = batch_cache.update_and_fetch(k[:, :, :1], k[:, :, :1])
    refs = [weakref.ref(keys), weakref.ref(values)]
    del keys, values
    assert all(r() is None for r in refs)
