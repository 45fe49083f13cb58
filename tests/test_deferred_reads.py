"""Decode steps that leave the K/V read to the kernel: the source check that allows it,
stand-ins that reach attention, the real read when no kernel takes the call, and the
bounded set of kernel launch shapes."""

from __future__ import annotations

import textwrap

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache
from test_parity import max_diff
from tiny_models import VOCAB, tiny_model

from mlx_paged import PagedEngine, make_paged_cache
from mlx_paged.attention import (
    paged_attention,
    path_counts,
    routing,
    set_attention_path,
    table_width,
)
from mlx_paged.attention.kernels import compiled_variants
from mlx_paged.attention.kernels.plan import LaunchCache
from mlx_paged.attention.kernels.reference import reference_paged_decode
from mlx_paged.cache.families import _reads_kv_directly, attention_reads_kv_directly

DIRECT = """
def attend(self, x, cache):
    keys, values = cache.update_and_fetch(k, v)
    if mask is not None and mask.shape[-1] != keys.shape[-2]:
        mask = mask[..., -keys.shape[-2]:]
    return scaled_dot_product_attention(q, keys, values, cache=cache, mask=mask)
"""


@pytest.mark.parametrize(
    "edit, verdict",
    [
        ("", True),
        ("keys = self.rope(keys)", False),  # transforms them
        ("self.saved = values", False),  # keeps them
        ("keys = keys.astype(mx.float32)", False),
        ("x = keys.shape[2]", True),
    ],
)
def test_source_check_allows_only_direct_use(edit, verdict):
    lines = DIRECT.splitlines()
    lines.insert(3, "    " + edit) if edit else None
    assert _reads_kv_directly("\n".join(lines)) is verdict


def test_source_check_cases():
    assert _reads_kv_directly("def f(x):\n    return x\n") is None  # no cache at all
    kw = DIRECT.replace("(q, keys, values,", "(q, keys=keys, values=values,")
    assert _reads_kv_directly(kw) is False  # keyword use is not recognised: refuse
    fast = DIRECT.replace("return scaled_", "return mx.fast.scaled_")
    assert _reads_kv_directly(fast) is False  # MLX's own SDPA is not routed
    rebound = textwrap.dedent("""
    def f(self, cache):
        keys, values = cache.update_and_fetch(k, v)
        out = scaled_dot_product_attention(q, keys, values, cache=cache)
        keys = other
        return keys + 1
    """)
    assert _reads_kv_directly(rebound) is True  # after rebinding, keys is something else
    looped = textwrap.dedent("""
    def f(self, cache):
        for _ in range(2):
            use(keys)
            keys, values = cache.update_and_fetch(k, v)
    """)
    assert _reads_kv_directly(looped) is False  # the loop's next turn reads them


@pytest.mark.parametrize(
    "family, direct",
    [("llama", True), ("qwen3", True), ("gemma3_text", True), ("gpt_oss", True)]
    + [("deepseek_v3", False)],  # MLA: the model expands the latent K/V itself
)
def test_families(family, direct):
    assert attention_reads_kv_directly(tiny_model(family)) is direct


@pytest.fixture
def kernel(monkeypatch):
    """A KERNELS entry that takes (the reference) or declines every call, counting both."""
    calls = {"took": 0, "declined": 0, "take": True}

    def entry(queries, view, scale, sinks):
        if calls["take"]:
            calls["took"] += 1
            return reference_paged_decode(queries, view, scale, sinks)
        calls["declined"] += 1
        return None

    monkeypatch.setattr(routing, "KERNELS", [entry])
    set_attention_path("kernel")  # never in place: every eligible decode call meets ``entry``
    yield calls
    set_attention_path("auto")


def decode_logits(model, cache, prompt, steps):
    model(prompt, cache=cache)
    return mx.concatenate([model(steps[:, i : i + 1], cache=cache) for i in range(steps.shape[1])])


@pytest.mark.parametrize("family", ["llama", "gemma3_text", "gpt_oss"])
@pytest.mark.parametrize("take", [True, False])
def test_deferred_decode_matches_the_dense_cache(kernel, family, take):
    """Stand-ins reach attention; a kernel reads the blocks, or attention reads them then."""
    kernel["take"] = take
    model = tiny_model(family)
    prompt = mx.random.randint(0, VOCAB, (1, 45), key=mx.random.key(1))
    steps = mx.random.randint(0, VOCAB, (1, 8), key=mx.random.key(2))
    want = decode_logits(model, make_prompt_cache(model), prompt, steps)
    cache = make_paged_cache(model, block_size=8)
    gathered = path_counts["gather"]
    got = decode_logits(model, cache, prompt, steps)
    assert all(c._deferred is not None for c in cache)  # the last step deferred every read
    calls = 8 * len(cache)
    assert kernel["took" if take else "declined"] == calls
    assert path_counts["gather"] - gathered == (0 if take else calls) + len(cache)  # + prefill
    assert max_diff(want, got) < 1e-4


def test_no_stand_ins_without_a_kernel(kernel):
    model = tiny_model("llama")
    prompt = mx.random.randint(0, VOCAB, (1, 20), key=mx.random.key(1))
    for path, deferred in (("gather", False), ("kernel", True)):
        set_attention_path(path)
        cache = make_paged_cache(model, block_size=8)
        decode_logits(model, cache, prompt, prompt[:, :1])
        assert all((c._deferred is not None) is deferred for c in cache)
    deepseek = tiny_model("deepseek_v3")
    cache = make_paged_cache(deepseek, block_size=8)
    decode_logits(deepseek, cache, prompt, prompt[:, :1])
    assert all(c._deferred is None for c in cache)  # its attention transforms K/V


def test_stand_ins_read_twice(kernel):
    """A second attention over the same stand-ins (the kernel took the first) reads the
    real K/V too."""
    kernel["take"] = False
    model = tiny_model("llama")
    cache = make_paged_cache(model, block_size=8)[0]
    k = mx.random.normal((1, 2, 13, 16))
    cache.update_and_fetch(k, k)
    q, new = mx.random.normal((1, 4, 1, 16)), mx.random.normal((1, 2, 1, 16))
    keys, values = cache.update_and_fetch(new, new)
    assert not mx.array_equal(keys[:, :, -1:], new).item()  # a stand-in
    real = mx.concatenate([k, new], axis=2)
    want = mx.fast.scaled_dot_product_attention(q, real, real, scale=0.25)
    for _ in range(2):
        got = paged_attention(q, keys, values, cache, 0.25, None)
        assert max_diff(want, got) < 1e-5


def test_engine_tokens_do_not_depend_on_who_reads(kernel):
    model = tiny_model("gpt_oss")
    prompts = [list(range(1 + s, 40 + 9 * s)) for s in range(3)]
    results = []
    for path, take in (("gather", True), ("auto", True), ("auto", False)):
        set_attention_path(path)
        kernel["take"] = take
        engine = PagedEngine(model, block_size=8, max_batch_size=3)
        results.append(engine.generate(prompts, max_tokens=10))
    assert kernel["took"] > 0 and kernel["declined"] > 0
    assert results[0] == results[1] == results[2]


def test_table_widths_come_in_eight_steps_per_doubling():
    widths = [table_width(n) for n in (0, 1, 2, 3, 8, 9, 16, 17, 19, 33, 1000, 1025)]
    assert widths == [1, 1, 2, 3, 8, 9, 16, 18, 20, 36, 1024, 1152]
    assert all(n <= table_width(n) <= n * 9 / 8 for n in range(1, 5000))
    assert len({table_width(n) for n in range(1025, 2049)}) == 8


def test_views_pad_block_tables(kernel):
    seen = []
    kernel["take"] = True
    base = kernel_entry = routing.KERNELS[0]

    def record(queries, view, scale, sinks):
        seen.append(view.block_tables.tolist())
        return kernel_entry(queries, view, scale, sinks)

    routing.KERNELS[0] = record
    model = tiny_model("llama")
    cache = make_paged_cache(model, block_size=8)
    decode_logits(model, cache, mx.arange(1, 131)[None], mx.array([[3]]))  # 131 tokens
    ids = cache[0].table.blocks
    assert len(ids) == 17 and seen[0] == [ids + [ids[-1]]]  # padded to 18
    routing.KERNELS[0] = base


def test_launch_cache_drops_the_least_recently_used():
    made, before = [], compiled_variants()["launches"]
    cache = LaunchCache(limit=2)

    def make(name):
        made.append(name)
        return lambda *a: name

    for key in ("a", "b", "a", "c", "a", "b"):
        cache.get(key, lambda key=key: make(key))
    assert made == ["a", "b", "c", "b"]  # "b" was dropped for "c"; "a" stayed in use
    assert list(cache.fns) == ["a", "b"]
    assert compiled_variants()["launches"] == before + 2
    assert cache.get("none", lambda: None) is None  # a decline is kept, and counts no launch
    assert list(cache.fns) == ["b", "none"]
    assert compiled_variants()["launches"] == before + 1


def test_mlx_lm_batch_generator_with_deferred_reads_matches_dense(kernel):
    """mlx-lm's BatchGenerator on installed paged caches (``PagedBatchKVCache``): stand-ins
    reach attention, and the real read when no kernel takes the call gives dense tokens."""
    from test_batch_cache import prompts, run_generator

    from mlx_paged import install_paged_cache, uninstall_paged_cache

    model = tiny_model("gemma3_text")
    ps = prompts()
    dense = run_generator(model, ps)
    install_paged_cache(model, block_size=8)
    try:
        for take in (True, False):
            kernel["take"] = take
            assert run_generator(model, ps) == dense
    finally:
        uninstall_paged_cache(model)
    assert kernel["took"] > 0 and kernel["declined"] > 0


def test_kernel_readiness_is_found_once_per_device(kernel):
    """``kernels_ready`` runs on every decode layer: its answer is kept per device (and
    kernel set), not worked out again, and kept once more, at each call."""
    entry, checks = routing.KERNELS[0], []
    entry.available = lambda: checks.append(1) or True  # a fresh closure per test
    routing._ready.clear()
    for _ in range(50):
        assert routing.kernels_ready()
    assert len(routing._ready) == 1 and len(checks) == 1


@pytest.mark.parametrize("on_cuda", [True, False])
def test_decode_views_that_mlx_would_copy_go_to_the_kernel_on_cuda(kernel, monkeypatch, on_cuda):
    """On CUDA, MLX's one-query attention copies views of the pool unless the head dim is
    one its vector kernel takes (64, 96, 128): a lone sequence's decode steps of other head
    dims go to a fused kernel; elsewhere, and for those dims, they read the pool in place."""
    set_attention_path("auto")
    monkeypatch.setattr(routing, "on_cuda", lambda: on_cuda)
    prompt = mx.random.randint(0, VOCAB, (1, 21), key=mx.random.key(1))
    steps = mx.random.randint(0, VOCAB, (1, 6), key=mx.random.key(2))
    for head_dim in (64, 32):
        model = tiny_model("qwen3", head_dim=head_dim)
        want = decode_logits(model, make_prompt_cache(model), prompt, steps)
        cache = make_paged_cache(model, block_size=8)
        model(prompt, cache=cache)
        took, in_place = kernel["took"], path_counts["in_place"]
        got = mx.concatenate([model(steps[:, i : i + 1], cache=cache) for i in range(6)])
        to_kernel = on_cuda and head_dim == 32
        calls = 6 * len(cache)
        assert kernel["took"] - took == (calls if to_kernel else 0)
        assert path_counts["in_place"] - in_place == (0 if to_kernel else calls)
        assert max_diff(want, got) < 1e-4
