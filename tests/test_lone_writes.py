"""A lone sequence's decode steps (``make_paged_cache``) that leave the token's write to the
fused kernel (``PagedView.new_keys``): when they do, the write when no kernel takes the call,
copy-on-write of a shared tail block, and tokens against mlx-lm's dense cache. Here a
stand-in entry stores the rows with MLX ops (``writing``, in conftest.py); the CUDA
kernel's own stores are checked on the GPU at the end."""

from __future__ import annotations

import copy

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache, make_prompt_cache
from test_parity import BLOCK, ROTATING, TOL, max_diff, prompt_tokens, run_generate_step
from tiny_models import VOCAB, tiny_model

from mlx_paged import make_paged_cache
from mlx_paged.attention import one_token_read, path_counts, routing, set_attention_path

PROMPT, STEPS = 45, 8


def decode(model, cache, prompt: mx.array, steps: mx.array) -> mx.array:
    """The logits of a prompt's last token and of each step's token."""
    out = [model(prompt, cache=cache)[:, -1:]]
    out += [model(steps[:, i : i + 1], cache=cache) for i in range(steps.shape[1])]
    return mx.concatenate(out, axis=1)


def tokens(n: int, seed: int) -> mx.array:
    return mx.random.randint(0, VOCAB, (1, n), key=mx.random.key(seed))


@pytest.mark.parametrize("family", ["llama", "gemma3_text", "qwen3"])
@pytest.mark.parametrize("take", [True, False])
def test_lone_steps_leave_the_write_to_a_storing_kernel(writing, family, take):
    """From the second step on (the first checks the token's shapes), every layer's view
    carries the token for the kernel to store; a kernel that declines leaves the write to
    the cache. Logits and every full layer's K/V match mlx-lm's dense cache."""
    set_attention_path("kernel")
    writing["take"] = take
    model = tiny_model(family)
    prompt, steps = tokens(PROMPT, 1), tokens(STEPS, 2)
    dense = make_prompt_cache(model)
    want = decode(model, dense, prompt, steps)
    cache = make_paged_cache(model, block_size=BLOCK)
    got = decode(model, cache, prompt, steps)
    assert max_diff(want, got) < TOL
    layers = len(cache)
    offered = [v.new_keys is not None for v in writing["views"]]
    assert offered == [False] * layers + [True] * (STEPS - 1) * layers
    assert all(c._new is None for c in cache)  # stored by the kernel, or written on decline
    tol = TOL if family in ROTATING else 0.0  # later layers' inputs differ in the last bits
    for c, d in zip(cache, dense, strict=True):
        assert c.offset == PROMPT + STEPS
        if type(d) is KVCache:
            k, v = c.keys_and_values()
            assert max_diff(k, d.keys[..., : d.offset, :]) <= tol
            assert max_diff(v, d.values[..., : d.offset, :]) <= tol


@pytest.mark.parametrize("head_dim, read", [(32, "store"), (64, "views")])
def test_on_cuda_only_views_mlx_would_copy_go_to_the_storing_kernel(
    writing, monkeypatch, head_dim, read
):
    """Under ``auto`` on CUDA, head dims MLX's vector attention does not take go to the
    kernel, which stores the token; the others read the pool in place."""
    set_attention_path("auto")
    monkeypatch.setattr(routing, "on_cuda", lambda: True)
    assert one_token_read(head_dim, head_dim) == read
    model = tiny_model("qwen3", head_dim=head_dim)
    prompt, steps = tokens(21, 1), tokens(6, 2)
    want = decode(model, make_prompt_cache(model), prompt, steps)
    cache = make_paged_cache(model, block_size=BLOCK)
    in_place = path_counts["in_place"]
    got = decode(model, cache, prompt, steps)
    stored = sum(v.new_keys is not None for v in writing["views"])
    assert stored == (5 * len(cache) if read == "store" else 0)
    assert path_counts["in_place"] - in_place == len(cache) * (1 if read == "store" else 7)
    assert max_diff(want, got) < TOL


def test_a_forked_lone_sequence_copies_its_shared_tail_before_the_kernel_stores(writing):
    """A fork shares its tail block (copy-on-write): the fork's first stored step moves it
    to a fresh block, so the kernel stores there and the original keeps its bytes. (46
    tokens in blocks of 8: two more fill the tail block.)"""
    set_attention_path("kernel")
    model = tiny_model("llama")
    prompt = tokens(PROMPT, 1)
    cache = make_paged_cache(model, block_size=BLOCK)
    mx.eval(model(prompt, cache=cache))
    mx.eval(model(tokens(1, 3), cache=cache))  # a checked one-token write: the next may store
    before = [c.keys_and_values() for c in cache]
    mx.eval(before)
    pool, table = cache[0].pool, cache[0].table
    fork = copy.deepcopy(cache)
    tail = table.blocks[-1]
    assert pool.blocks.refcounts[tail] == 2
    live = pool.blocks.stats().live_blocks
    steps, writing["views"] = tokens(2, 2), []
    for i in range(2):
        mx.eval(model(steps[:, i : i + 1], cache=fork))
    assert all(v.new_keys is not None for v in writing["views"])
    new_tail = fork[0].table.blocks[-1]
    assert new_tail != tail and fork[0].table.blocks[:-1] == table.blocks[:-1]
    assert pool.blocks.refcounts[tail] == 1 and pool.blocks.refcounts[new_tail] == 1
    assert pool.blocks.stats().live_blocks == live + 1
    for c, (k, v) in zip(cache, before, strict=True):  # the original's K/V is untouched
        assert c.offset == PROMPT + 1
        assert max_diff(c.keys_and_values()[0], k) == 0.0
        assert max_diff(c.keys_and_values()[1], v) == 0.0
    dense = make_prompt_cache(model)
    model(prompt, cache=dense)
    model(tokens(1, 3), cache=dense)
    want = mx.concatenate([model(steps[:, i : i + 1], cache=dense) for i in range(2)])
    fork2 = copy.deepcopy(cache)
    got = mx.concatenate([model(steps[:, i : i + 1], cache=fork2) for i in range(2)])
    assert max_diff(want, got) < TOL


def cuda_only(test):
    test = pytest.mark.skipif(not mx.cuda.is_available(), reason="needs a CUDA GPU")(test)
    return pytest.mark.gpu(test)


@cuda_only
@pytest.mark.parametrize("family, config", [("qwen3", {"head_dim": 32}), ("gemma3_text", {})])
def test_on_the_gpu_the_kernel_stores_each_token(family, config):
    """On the GPU, the CUDA kernel stores each step's token: the tokens match mlx-lm's
    dense cache, and a layer's state read before the step's output is evaluated holds
    the step's token (the pool arrays wait for the kernel)."""
    set_attention_path("auto")
    model = tiny_model(family, **config)
    prompt = prompt_tokens(PROMPT)
    gpu = mx.new_stream(mx.gpu)
    dense_cache = make_prompt_cache(model)
    dense_tokens, dense_logits = run_generate_step(model, prompt, dense_cache, stream=gpu)
    stored = path_counts["cuda_paged_decode"]
    cache = make_paged_cache(model, BLOCK)
    got_tokens, logits = run_generate_step(model, prompt, cache, stream=gpu)
    assert path_counts["cuda_paged_decode"] > stored
    assert got_tokens == dense_tokens and max_diff(dense_logits, logits) <= TOL
    with mx.stream(gpu):
        dense = make_prompt_cache(model)
        mx.eval(model(prompt[None], cache=dense), model(prompt[None, -1:], cache=dense))
        lone = make_paged_cache(model, BLOCK)
        mx.eval(model(prompt[None], cache=lone), model(prompt[None, -1:], cache=lone))
        model(prompt[None, :1], cache=dense)
        model(prompt[None, :1], cache=lone)  # not evaluated: only the states are below
        mx.eval([c.state for c in lone])
        for c, d in zip(lone, dense, strict=True):  # later layers' inputs differ in the last bits
            if type(d) is KVCache:
                k, v = c.keys_and_values()
                assert max_diff(k, d.keys[..., : d.offset, :]) <= TOL
                assert max_diff(v, d.values[..., : d.offset, :]) <= TOL
