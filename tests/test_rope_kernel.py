"""Decode steps that leave the layers' RoPE to the attention kernel (``rope_in_kernel``):
which layers change, the rotation the kernel is handed against the layer's own, and the
engine's tokens against mlx-lm's dense cache whether a kernel rotates, declines (the cache
and the attention fallback rotate), or no kernel stores rows (nothing is left to a kernel).
On the CPU a stand-in ``KERNELS`` entry does what the CUDA kernel does with MLX ops; the
CUDA kernel's own rotation is checked on the GPU (``test_kernel_sources.py``)."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models.rope_utils import initialize_rope
from stand_ins import store_new_rows
from test_engine import mixed_prompts, run_all, solo
from tiny_models import tiny_model

from mlx_paged import PagedEngine, rope_in_kernel
from mlx_paged.attention import routing, set_attention_path
from mlx_paged.attention.kernels.reference import reference_paged_decode, rotate
from mlx_paged.engine.rope import KernelRoPE, kernel_ropes, rope_spec

MAX_TOKENS = 8
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


@pytest.mark.parametrize(
    "rope",
    [
        nn.RoPE(16, base=10000.0),
        nn.RoPE(16, traditional=True, base=500000.0),
        nn.RoPE(16, base=10000.0, scale=0.25),
        initialize_rope(16, 500000.0, False, LLAMA3, 1024),
        nn.RoPE(4, base=10000.0),  # qwen3_next's kind: the head's leading quarter turns
        nn.RoPE(8, traditional=True, base=10000.0),
    ],
    ids=["rope", "traditional", "scaled", "llama3", "quarter", "half-traditional"],
)
def test_the_kernels_rotation_is_the_layers_own(rope):
    spec = rope_spec(rope)
    x = mx.random.normal((3, 4, 1, 16), key=mx.random.key(1))
    positions = mx.array([0, 37, 900])
    got = rotate(x, positions, spec)
    assert mx.allclose(got, rope(x, offset=positions), atol=1e-4).item()
    assert mx.allclose(spec.apply(x, positions), rope(x, offset=positions)).item()
    assert mx.allclose(rotate(got, positions, spec, inverse=True), x, atol=1e-5).item()
    assert spec.freqs.dtype == mx.float32 and spec.freqs.shape == (rope.dims // 2,)


def test_only_supported_layers_change_and_only_once():
    model = tiny_model("llama")
    x = mx.array([[3, 1, 4, 1, 5]])
    before = model(x)
    assert rope_in_kernel(model) == 4
    assert all(isinstance(layer.self_attn.rope, KernelRoPE) for layer in model.layers)
    assert rope_in_kernel(model) == 0
    assert mx.array_equal(model(x), before).item()  # the switch is off: the layers rotate
    switch, specs = kernel_ropes(model)
    assert len(specs) == 4 and all(s is not None for s in specs)
    with switch.deferring():
        assert not mx.allclose(model(x), before, atol=1e-3).item()  # nothing rotated
    for family in ("qwen3", "qwen3_moe", "gemma3_text"):
        assert rope_in_kernel(tiny_model(family)) > 0
    for family in ("qwen3_5", "qwen3_next"):  # hybrids: their attention layers (every second)
        model = tiny_model(family)
        assert rope_in_kernel(model) == 2
        _, specs = kernel_ropes(model)
        assert [s is not None for s in specs] == [False, True, False, True]
        assert specs[1].freqs.shape == (4,)  # half of a 16-wide head turns
    for family in ("gpt_oss", "lfm2"):  # other layer classes
        model = tiny_model(family)
        assert rope_in_kernel(model) == 0 and kernel_ropes(model) is None


@pytest.fixture
def kernel(monkeypatch):
    """A ``KERNELS`` entry that stores the new rows, rotating the queries and keys of a view
    with ``rope`` as the CUDA kernel does (``ropes``), then reads like the reference; or
    one that only stores (``ropes`` false), or declines. It records the views it was
    offered."""
    calls = {"take": True, "ropes": True, "views": []}

    def entry(queries, view, scale, sinks):
        calls["views"].append(view)
        if not calls["take"]:
            return None
        if view.rope is not None:
            at = view.lengths - 1
            queries = rotate(queries, at, view.rope).astype(queries.dtype)
            if view.new_keys is not None:
                rotated = rotate(view.new_keys, at, view.rope).astype(view.new_keys.dtype)
                view = view._replace(new_keys=rotated)
        if view.new_keys is not None:
            store_new_rows(view)
        return reference_paged_decode(queries, view, scale, sinks)

    entry.writes = entry.ropes = True
    monkeypatch.setattr(routing, "KERNELS", [entry])
    routing._ready.clear()
    set_attention_path("kernel")

    def configure(take: bool, ropes: bool) -> None:
        calls["take"], calls["views"] = take, []
        entry.ropes = ropes

    calls["configure"] = configure
    yield calls
    set_attention_path("auto")
    routing._ready.clear()


@pytest.mark.parametrize(
    "family", ["llama", "qwen3", "qwen3_moe", "gemma3_text", "qwen3_next", "qwen3_5"]
)
@pytest.mark.parametrize("compiled", [True, False])
def test_engine_tokens_with_the_rotation_left_to_the_kernel_match_solo_dense(
    kernel, family, compiled
):
    """A kernel that rotates, one that declines a view with a rotation (the cache rotates
    the keys it writes and attention the queries), one that does not rotate (routing
    skips it: the same fallback), and the gather path: the same tokens."""
    model = tiny_model(family)
    assert rope_in_kernel(model) > 0
    prompts = mixed_prompts(seed=5)
    want = [solo(family, tuple(p), MAX_TOKENS) for p in prompts]
    for path, take, ropes in (
        ("kernel", True, True),
        ("kernel", False, True),
        ("kernel", True, False),
        ("gather", True, True),
    ):
        set_attention_path(path)
        kernel["configure"](take, ropes)
        engine = PagedEngine(model, block_size=8, max_batch_size=4, compile_decode=compiled)
        assert run_all(engine, prompts, max_tokens=MAX_TOKENS) == want, (path, take, ropes)
        rotating = [v.rope is not None for v in kernel["views"]]
        if path == "kernel" and ropes:
            assert rotating and all(rotating)
        else:  # an entry that does not rotate is never offered such a view
            assert not any(rotating)


def test_a_fallback_that_forgets_the_queries_changes_the_tokens(kernel, monkeypatch):
    """The check above can fail: without the fallback's rotation of the queries the
    tokens differ."""
    from mlx_paged.cache import StepPagedKVCache

    model = tiny_model("llama")
    rope_in_kernel(model)
    prompts = mixed_prompts(seed=5)
    want = [solo("llama", tuple(p), MAX_TOKENS) for p in prompts]
    kernel["configure"](False, True)
    monkeypatch.setattr(StepPagedKVCache, "rotated_queries", lambda self, q: q)
    engine = PagedEngine(model, block_size=8, max_batch_size=4)
    assert run_all(engine, prompts, max_tokens=MAX_TOKENS) != want


def test_without_a_kernel_that_stores_rows_nothing_is_left_to_a_kernel():
    """On the CPU no entry stores rows (``kernels_write``): the layers rotate as before."""
    model = tiny_model("llama")
    rope_in_kernel(model)
    prompts = mixed_prompts(seed=5)
    engine = PagedEngine(model, block_size=8, max_batch_size=4)
    switch, _ = kernel_ropes(model)
    seen = []
    original = switch.deferring
    switch.deferring = lambda on=True: (seen.append(on), original(on))[1]
    assert run_all(engine, prompts, max_tokens=MAX_TOKENS) == [
        solo("llama", tuple(p), MAX_TOKENS) for p in prompts
    ]
    assert not seen


def cuda_only(test):
    """Run ``test`` on a CUDA GPU; skip it elsewhere."""
    test = pytest.mark.skipif(not mx.cuda.is_available(), reason="needs a CUDA GPU")(test)
    return pytest.mark.gpu(test)


@cuda_only
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
@pytest.mark.parametrize("traditional", [False, True])
@pytest.mark.parametrize("kv_bits", [None, 8, 4])
@pytest.mark.parametrize("dims", [64, 16])  # the whole head, or its first quarter
def test_the_cuda_kernel_rotates_queries_and_the_keys_it_stores(dtype, traditional, kv_bits, dims):
    """The kernel handed unrotated queries and new keys (rotated back from the reference's)
    against the reference, split and not, the stored rows included (``self_check``)."""
    from mlx_paged.attention.kernels import dispatch
    from mlx_paged.attention.kernels.cuda import paged_decode_cuda
    from mlx_paged.attention.kernels.synthetic import random_paged_batch

    rope = rope_spec(nn.RoPE(dims, traditional=traditional, base=10000.0))
    batch = random_paged_batch([300, 5], 8, 2, 64, dtype=dtype, kv_bits=kv_bits)
    rows = [mx.zeros((2, 2, 1, 64), dtype=dtype)] * 2
    view = batch.view._replace(new_keys=rows[0], new_values=rows[1], rope=rope)
    err = dispatch.self_check(paged_decode_cuda, batch.queries, view, 0.125, None)
    assert err <= dispatch.TOLERANCE[dtype], err
    # Queries alone (the keys in the pool): rotated back, the kernel turns them again;
    # left as they are, the output is far off.
    back = rotate(batch.queries, batch.view.lengths - 1, rope, inverse=True).astype(dtype)
    with mx.stream(mx.cpu):
        want = reference_paged_decode(batch.queries, batch.view, 0.125, None)
    for given, close in ((batch.view._replace(rope=rope), True), (batch.view, False)):
        got = paged_decode_cuda(back, given, 0.125, None)
        diff = mx.abs(got.astype(mx.float32) - want.astype(mx.float32)).max().item()
        assert (diff <= dispatch.TOLERANCE[dtype]) if close else diff > 0.05, diff


@cuda_only
@pytest.mark.parametrize(
    "family, kv_bits, layers, turned",
    [("llama", None, 4, 64), ("llama", 8, 4, 64), ("qwen3_next", None, 2, 32)],
)
def test_engine_tokens_with_the_cuda_kernel_rotating_match_the_layers_rotating(
    family, kv_bits, layers, turned
):
    """llama turns the whole head; qwen3_next's attention layers (half of a hybrid's
    layers) turn half of it here (``partial_rotary_factor``)."""
    from mlx_paged.attention import path_counts
    from mlx_paged.attention.kernels.plan import kernel_templates

    prompts = [list(range(1 + s, 60 + 9 * s)) for s in range(3)]
    results = []
    for rotate_in_kernel in (False, True):  # float32: greedy tokens do not drift apart
        model = tiny_model(family, head_dim=64)
        if rotate_in_kernel:
            assert rope_in_kernel(model) == layers
        kw = {"kv_bits": kv_bits, "hot_tokens": 16} if kv_bits else {}
        engine = PagedEngine(model, block_size=8, max_batch_size=3, **kw)
        before = path_counts["cuda_paged_decode"]
        results.append(run_all(engine, prompts, max_tokens=12))
        assert path_counts["cuda_paged_decode"] > before
    assert any(("ROPE", turned) in t for t in kernel_templates)
    assert results[0] == results[1]


def test_the_kernels_decline_angles_that_do_not_fit_the_head():
    """MLX does not bounds-check the kernel's reads of the angles: a view whose angles are
    not one float32 for each of 1 to half the head's pairs goes to no kernel."""
    from mlx_paged.attention.kernels.plan import plan_decode
    from mlx_paged.attention.kernels.synthetic import random_paged_batch

    b = random_paged_batch([20, 9], 4, 2, 64)
    spec = rope_spec(nn.RoPE(64))
    for freqs in (spec.freqs, spec.freqs[:16], spec.freqs[:1]):  # the whole head, or its start
        view = b.view._replace(rope=spec._replace(freqs=freqs))
        assert plan_decode(b.queries, view).reason is None
    bad = (spec.freqs.astype(mx.float16), mx.zeros((33,)), mx.zeros((0,)), spec.freqs[None])
    for freqs in bad:
        view = b.view._replace(rope=spec._replace(freqs=freqs))
        assert "RoPE" in plan_decode(b.queries, view).reason
