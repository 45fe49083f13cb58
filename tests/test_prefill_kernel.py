"""Paged prefill attention: the MLX reference against SDPA on contiguous K/V, what the CUDA
kernel declines, its launch without a GPU, and (on a CUDA GPU only) the kernel itself."""

from __future__ import annotations

import logging
import re
import shutil
import subprocess

import mlx.core as mx
import pytest
from tiny_models import tiny_model

from mlx_paged import PagedEngine
from mlx_paged.attention import path_counts, routing
from mlx_paged.attention.kernels import cubin, cuda_prefill, dispatch, source
from mlx_paged.attention.kernels.cuda_prefill import paged_prefill_cuda, prefill_reason
from mlx_paged.attention.kernels.plan import LaunchCache
from mlx_paged.attention.kernels.reference import reference_paged_prefill
from mlx_paged.attention.kernels.synthetic import random_prefill_batch
from mlx_paged.attention.records import PrefillView

# (offsets, counts, n_new, n_heads, n_kv_heads, head_dim, block_size, window, first_blocks)
CONFIGS = [
    ([0], [1], 1, 4, 2, 64, 16, None, None),
    ([0, 16, 40], [70, 64, 5], 70, 4, 2, 64, 16, None, None),  # crosses a query tile, padding
    ([2048 + 7, 100], [64, 33], 64, 8, 2, 128, 16, None, None),  # long cached prefix
    ([35, 81, 0], [70, 61, 1], 70, 4, 4, 64, 64, None, [0, 1, 0]),  # starts past block 0
    ([90, 200, 3], [40, 12, 9], 40, 4, 1, 64, 8, 20, [8, 21, 0]),  # window, dropped blocks
    ([130, 5], [129, 1], 129, 6, 2, 128, 32, 64, [2, 0]),  # window across query tiles
    ([17, 0], [20, 20], 20, 2, 2, 16, 16, 1000, None),  # window wider than the context
    ([40, 3, 77], [33, 20, 33], 33, 8, 2, 256, 16, None, None),  # head dim 256: 16-key tiles
    ([300, 60], [70, 50], 70, 4, 1, 256, 64, 100, [2, 0]),  # head dim 256, window
    ([4000, 9], [16, 5], 16, 16, 2, 64, 16, None, None),  # short tails, 8 heads a KV head
]


def ids(c) -> str:
    return f"o{c[0]}-c{c[1]}-d{c[5]}-bs{c[6]}-w{c[7]}"


def batch_of(config, dtype=mx.float32, seed=0):
    offsets, counts, n_new, hq, hkv, d, bs, window, first = config
    return random_prefill_batch(offsets, counts, n_new, hq, hkv, d, bs, dtype, window, first, seed)


@pytest.mark.parametrize("config", CONFIGS, ids=ids)
def test_reference_matches_sdpa_on_each_sequences_contiguous_kv(config):
    """Per sequence: its visible K/V read in token order, each query's own mask, MLX's SDPA."""
    queries, view = batch_of(config)
    offsets, counts, n_new, hq, hkv, d, bs, window, _ = config
    scale = d**-0.5
    got = reference_paged_prefill(queries, view, scale)
    for b, (off, count) in enumerate(zip(offsets, counts, strict=True)):
        start = view.starts[b].item()
        real = off + max(count, 1)
        ids_ = view.block_tables[b].tolist()
        rows = [ids_[(p - start) // bs] * bs + p % bs for p in range(start, real)]
        k = view.keys.reshape(-1, hkv, d)[mx.array(rows)].swapaxes(0, 1)[None]
        v = view.values.reshape(-1, hkv, d)[mx.array(rows)].swapaxes(0, 1)[None]
        pos = mx.arange(start, real)[None]
        query = (off + mx.arange(n_new))[:, None]
        mask = pos <= query
        if window is not None:
            mask = mask & (pos > query - window)
        want = mx.fast.scaled_dot_product_attention(
            queries[b : b + 1], k, v, scale=scale, mask=mask[None, None]
        )
        sees = mask.any(axis=-1)  # padding past a window sees no key: zeros
        want = mx.where(sees[None, None, :, None], want, 0.0)
        assert mx.allclose(got[b : b + 1], want, atol=1e-5).item(), b


def test_prefill_reason_declines_what_the_kernel_cannot_run():
    queries, view = batch_of(CONFIGS[1], mx.float16)
    assert prefill_reason(queries, view, None) is None or "architecture" in prefill_reason(
        queries, view, None
    )
    assert prefill_reason(queries, view, mx.zeros((4,))) == "attention sinks"
    assert "dtypes" in prefill_reason(queries.astype(mx.float32), view, None)
    q32, v32 = batch_of(CONFIGS[1], mx.float32)
    assert "dtypes" in prefill_reason(q32, v32, None)
    for d in (72, 272):  # not a multiple of 16; over the shared-memory tiles
        q, v = random_prefill_batch([3], [4], 4, 2, 1, d, dtype=mx.float16)
        assert prefill_reason(q, v, None) == f"head dim {d}"
    q, v = random_prefill_batch([3], [4], 4, 3, 2, 64, dtype=mx.float16)
    assert prefill_reason(q, v, None) == "3 query heads over 2 KV heads"


def test_cuda_prefill_entry_declines_off_its_device():
    queries, view = batch_of(CONFIGS[1], mx.float16)
    assert dispatch.cuda_paged_prefill(queries, view, 0.125, None) is None


def test_cuda_prefill_launch_parameters_without_a_gpu(monkeypatch):
    """The launch's plumbing, with a stand-in for the kernel object (CPU runs no CUDA)."""
    calls = []

    def fake_kernel(**kw):
        calls.append(kw)
        shapes, dtypes = kw["output_shapes"], kw["output_dtypes"]
        return [mx.zeros(s, dtype=d) for s, d in zip(shapes, dtypes, strict=True)]

    monkeypatch.setattr(cuda_prefill, "_kernel_obj", {False: fake_kernel, True: fake_kernel})
    monkeypatch.setattr(cuda_prefill, "_launches", LaunchCache())
    monkeypatch.setattr(cuda_prefill, "_tensor_cores", lambda: True)
    queries, view = batch_of(CONFIGS[2], mx.float16)
    out = paged_prefill_cuda(queries, view, 0.125, num_splits=1)
    assert out.shape == (2, 8, 64, 128) and out.dtype == mx.float16
    paged_prefill_cuda(queries, view, 0.125, num_splits=1)
    (call,) = calls  # traced once, replayed after
    t = dict(call["template"])
    assert (t["D"], t["HQ"], t["HKV"], t["BS"], t["WINDOW"], t["BQ"]) == (128, 8, 2, 16, 0, 64)
    assert t["T"] == mx.float16
    # Each block's 64 rows: 16 queries x the 4 heads of one KV head.
    assert t["PG"] == 4
    assert call["grid"] == (512, 2, 2) and call["threadgroup"] == (128, 1, 1)
    assert call["output_shapes"] == [(2, 8, 64, 128)]
    assert [x.dtype for x in call["inputs"][3:]] == [mx.int32] * 4
    q, v = batch_of(CONFIGS[1], mx.float16)  # 70 queries x 2 heads: three tiles
    paged_prefill_cuda(q, v, 0.125, num_splits=1)
    assert calls[-1]["grid"] == (384, 2, 3)
    # Forced, 16 blocks split into 4: float32 parts, merged in the launch.
    out = paged_prefill_cuda(queries, view, 0.125, num_splits=4)
    assert out.shape == (2, 8, 64, 128) and out.dtype == mx.float16
    assert calls[-1]["grid"] == (512, 2, 8)
    assert calls[-1]["output_shapes"] == [(4, 2, 8, 64, 128), (4, 2, 8, 64)]
    assert calls[-1]["output_dtypes"] == [mx.float32, mx.float32]
    # One head a block's rows (PACK_HEADS off): a block per query head.
    monkeypatch.setattr(cuda_prefill, "PACK_HEADS", False)
    paged_prefill_cuda(queries, view, 0.125, num_splits=1)
    assert dict(calls[-1]["template"])["PG"] == 1 and calls[-1]["grid"] == (128, 8, 2)


def test_plan_splits_fills_the_gpu_only_for_few_blocks_over_long_contexts():
    def splits(B, hq, L, keys, window=None, bs=16):
        q = mx.zeros((B, hq, L, 64), dtype=mx.float16)
        tables = mx.zeros((B, -(-keys // bs)), dtype=mx.int32)
        view = PrefillView(
            keys=mx.zeros((4, bs, 8, 64), dtype=mx.float16),
            values=mx.zeros((4, bs, 8, 64), dtype=mx.float16),
            block_tables=tables,
            starts=mx.zeros((B,), dtype=mx.int32),
            offsets=mx.zeros((B,), dtype=mx.int32),
            lengths=mx.zeros((B,), dtype=mx.int32),
            window=window,
        )
        return cuda_prefill.plan_splits(q, view)

    # A short tail after a long prefix: a block per KV head (16 queries x 4 heads).
    assert splits(1, 32, 16, 32768) == cuda_prefill.MAX_SPLITS
    assert splits(4, 32, 16, 32768) == 16  # 32 blocks: 16 splits reach 512
    assert splits(16, 32, 16, 32768) == 4
    assert splits(1, 32, 16, 8192) == 8  # at least 1,024 keys a split
    assert splits(1, 32, 16, 4096) == 4
    assert splits(1, 32, 16, 4080) == 1  # a table of 255 blocks: no split
    assert splits(1, 8, 16, 1 << 20) == cuda_prefill.MAX_SPLITS
    assert splits(32, 32, 64, 32768) == 1  # a burst fills the GPU by its queries
    assert splits(1, 32, 2048, 32768) == 1  # a long prompt's chunk too
    assert splits(1, 32, 16, 32768, window=1024) == 1  # a window bounds the keys a row sees
    assert splits(1, 32, 16, 32768, window=4096) == 4


def test_merge_splits_equals_attention_over_all_keys():
    """Softmax attention over key chunks, merged by their log2-sum-exp, against all at once;
    a chunk a row does not see, and a row that sees no key (zeros)."""
    rng = mx.random.key(4)
    kq, kk, kv = mx.random.split(rng, 3)
    L, T, D, S = 5, 40, 16, 4
    q = mx.random.normal((1, 2, L, D), key=kq)
    k = mx.random.normal((1, 2, T, D), key=kk)
    v = mx.random.normal((1, 2, T, D), key=kv)
    visible = mx.arange(T)[None] < mx.array([40, 33, 7, 12, 0])[:, None]  # (L, T)
    scores = mx.where(visible, (q @ k.swapaxes(-1, -2)) * 0.25, -mx.inf)
    parts, lses = [], []
    for c in range(S):
        cols = slice(c * 10, (c + 1) * 10)
        sc = scores[..., cols]
        top = mx.max(sc, axis=-1, keepdims=True)
        top = mx.where(mx.isinf(top), 0.0, top)
        e = mx.exp(sc - top)
        total = e.sum(axis=-1, keepdims=True)
        parts.append(mx.where(total > 0, (e @ v[..., cols, :]) / mx.maximum(total, 1e-30), 0.0))
        lses.append(((top + mx.log(total)) / mx.log(mx.array(2.0)))[..., 0])
    got = cuda_prefill.merge_splits(mx.stack(parts), mx.stack(lses), mx.float32)
    p = mx.softmax(scores, axis=-1)
    want = mx.where(visible.any(axis=-1)[:, None], mx.nan_to_num(p) @ v, 0.0)
    assert got.shape == (1, 2, L, D)
    assert mx.allclose(got, want, atol=1e-5).item()
    assert (got[:, :, 4] == 0).all().item()


def test_prefill_self_check_failure_declines_and_warns(caplog, monkeypatch):
    monkeypatch.setattr(dispatch, "backend_available", lambda backend: True)
    monkeypatch.setattr(dispatch, "prefill_reason", lambda *a: None)
    monkeypatch.setattr(dispatch, "prefill_self_check", lambda *a: 0.5)
    monkeypatch.setattr(dispatch, "_prefill_verdicts", {})
    queries, view = batch_of(CONFIGS[1], mx.float16)
    with caplog.at_level(logging.WARNING, logger="mlx_paged.kernels"):
        assert dispatch.cuda_paged_prefill(queries, view, 0.125, None) is None
        assert dispatch.cuda_paged_prefill(queries, view, 0.125, None) is None
    warnings = [r for r in caplog.records if "paged prefill kernel" in r.getMessage()]
    assert len(warnings) == 1 and "differs from the reference by 0.5" in warnings[0].getMessage()


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
@pytest.mark.parametrize("split", [False, True], ids=["out", "parts"])
def test_the_cuda_prefill_build_compiles_without_spilling(split, tmp_path):
    """nvcc builds the prefill kernel at the llama-1B shape, its rows over four heads and
    over one, and at head dim 128 and 256, with no register spills."""
    header, body = source.prefill_source(split)
    names = ["queries", "keys", "values", "block_tables", "starts", "offsets", "lengths"]
    dtypes = [mx.float16] * 3 + [mx.int32] * 4
    outs = (["part", "part_lse"], [mx.float32] * 2) if split else (["out"], [mx.float16])
    for d, pg in [(64, 4), (64, 1), (128, 4), (256, 2)]:
        template = [("T", mx.float16), ("D", d), ("HQ", 32), ("HKV", 32 // pg), ("BS", 16)]
        template += [("WINDOW", 0), ("SCALE_BITS", 0x3E000000), ("BQ", 64), ("PG", pg)]
        code, _ = cubin.render(
            "k", header, body, names, dtypes, [4, 4, 4, 2, 1, 1, 1], *outs, template
        )
        path = tmp_path / f"prefill_{d}_{pg}.cu"
        path.write_text(code)
        cmd = ["nvcc", "-arch=sm_90", "-cubin", "--std=c++17", "-Xptxas", "-v", str(path)]
        done = subprocess.run(
            cmd + ["-o", str(tmp_path / "k.cubin")], capture_output=True, text=True
        )
        assert done.returncode == 0, done.stderr[-3000:]
        assert re.findall(r"(\d+) bytes spill stores", done.stderr) == ["0"], done.stderr[-3000:]


def cuda_only(test):
    """Run ``test`` on a CUDA GPU; skip it elsewhere."""
    test = pytest.mark.skipif(not mx.cuda.is_available(), reason="needs a CUDA GPU")(test)
    return pytest.mark.gpu(test)


@cuda_only
@pytest.mark.parametrize("config", CONFIGS, ids=ids)
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
@pytest.mark.parametrize("num_splits", [None, 1, 2, 7])
@pytest.mark.parametrize("pack", [True, False], ids=["heads-packed", "one-head"])
def test_cuda_prefill_kernel_matches_reference(config, dtype, num_splits, pack, monkeypatch):
    """Planned splits, none, and forced ones (7: more than some calls have key tiles); a
    block's rows over every head of a KV head, and over one."""
    monkeypatch.setattr(cuda_prefill, "PACK_HEADS", pack)
    queries, view = batch_of(config, dtype, seed=3)
    scale = config[5] ** -0.5
    with mx.stream(mx.cpu):
        want = reference_paged_prefill(queries, view, scale).astype(mx.float32)
    got = paged_prefill_cuda(queries, view, scale, num_splits=num_splits)
    assert got is not None and got.dtype == dtype
    assert mx.abs(got.astype(mx.float32) - want).max().item() <= dispatch.TOLERANCE[dtype]


@cuda_only
def test_cuda_prefill_entry_passes_its_self_check():
    queries, view = batch_of(CONFIGS[2], mx.float16)
    assert dispatch.cuda_paged_prefill(queries, view, 128**-0.5, None) is not None


@cuda_only
@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
@pytest.mark.parametrize("cached", [48, 16400])
def test_engine_prefills_through_the_kernel_are_as_close_to_float32(family, cached, monkeypatch):
    """A burst's batched prefill (ragged suffixes after a cached prefix; gemma3's sliding
    windows) in PagedEngine on the GPU, in float16: the first-token logits with the CUDA
    kernel serving every attention layer are at least as close to the same weights' float32
    logits as those of attention over gathered K/V (which rounds its scores to float16).
    After 16,400 cached tokens the full-attention layers' keys are split (``plan_splits``)."""
    system = [1 + j % 100 for j in range(cached)]  # whole blocks
    planned = []
    plan = cuda_prefill.plan_splits
    monkeypatch.setattr(
        cuda_prefill, "plan_splits", lambda *a: planned.append(plan(*a)) or planned[-1]
    )
    monkeypatch.setattr(cuda_prefill, "_launches", LaunchCache())  # every launch planned here
    prompts = [system + [60 + i] * (9 + i) for i in range(4)]  # right padding, one block

    def first_logits(dtype: mx.Dtype, kernels: list) -> tuple[mx.array, int]:
        """The burst's first-token logits, and the attention calls the CUDA kernel served."""
        model = tiny_model(family)
        model.set_dtype(mx.float16)
        model.set_dtype(dtype)  # float32: the float16 weights, exactly
        monkeypatch.setattr(routing, "PREFILL_KERNELS", kernels)
        routing._ready.clear()
        engine = PagedEngine(model, block_size=16, overlap=False)
        engine.generate([system + [1]], max_tokens=1)  # the prefix, cached
        for prompt in prompts:
            engine.add_request(prompt, 1)
        (work,) = engine.scheduler.admit()  # one batched forward of the four suffixes
        assert len(work.requests) == 4 and not work.alone
        before = path_counts["cuda_paged_prefill"]
        logits = engine.prefiller.prefill(work).astype(mx.float32)
        return logits, path_counts["cuda_paged_prefill"] - before

    kernel = [dispatch.cuda_paged_prefill]
    got, served = first_logits(mx.float16, kernel)
    assert served == len(tiny_model(family).layers)
    assert (max(planned, default=1) > 1) == (cached > cuda_prefill.SPLIT_FROM_KEYS), planned
    ops, served = first_logits(mx.float16, [])
    truth, _ = first_logits(mx.float32, kernel)  # declined: float32
    routing._ready.clear()
    assert served == 0
    err, ops_err = (mx.abs(x - truth).max().item() for x in (got, ops))
    assert err <= max(ops_err, 1e-2 * mx.abs(truth).max().item()), (err, ops_err)
