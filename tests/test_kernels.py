"""Paged decode kernels: the MLX reference against SDPA, model parity through KERNELS,
path selection, self-check fallbacks, and (on a CUDA GPU only) the CUDA kernel."""

from __future__ import annotations

import logging

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache
from test_engine import MAX_TOKENS, mixed_prompts, run_all
from test_parity import BLOCK, DECODE_STEPS, TOL, max_diff, prompt_tokens, run_generate_step
from tiny_models import tiny_model

from mlx_paged import PagedEngine, attention, make_paged_cache
from mlx_paged.attention import PagedView, path_counts, routing, set_attention_path
from mlx_paged.attention.kernels import dispatch
from mlx_paged.attention.kernels.cuda import paged_decode_cuda
from mlx_paged.attention.kernels.plan import LaunchCache, plan_decode
from mlx_paged.attention.kernels.read import read_reason
from mlx_paged.attention.kernels.reference import reference_paged_decode
from mlx_paged.attention.kernels.synthetic import dense_decode, random_paged_batch
from mlx_paged.cache import DecodeBatch, PagedKVCache, StepPagedKVCache
from mlx_paged.storage import KVPool, take_blocks

# (lengths, n_heads, n_kv_heads, dk, dv, block_size, window, sinks, first_blocks)
CONFIGS = [
    ([1], 4, 2, 64, 64, 16, None, False, None),
    ([16, 17, 1, 40], 4, 2, 64, 64, 16, None, False, None),  # block edges, mid-block
    ([100, 33, 7], 8, 2, 128, 128, 16, None, True, None),  # sinks
    ([50, 9], 4, 4, 256, 256, 8, None, False, None),
    ([70, 20], 6, 2, 128, 64, 16, None, True, None),  # K and V head dims differ
    ([90, 45, 12], 4, 1, 64, 64, 8, 20, False, [8, 2, 0]),  # window, dropped blocks
    ([200, 31], 8, 2, 64, 64, 16, 64, True, [8, 0]),  # window + sinks
    ([64, 65], 2, 2, 64, 64, 32, 1000, False, None),  # window wider than the context
]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"L{c[0]}-d{c[3]}-w{c[6]}-s{c[7]}")
@pytest.mark.parametrize("shuffle", [True, False])
def test_reference_matches_sdpa_on_contiguous_kv(config, shuffle):
    lengths, hq, hkv, dk, dv, bs, window, sinks, first = config
    batch = random_paged_batch(
        lengths, hq, hkv, dk, dv, bs, mx.float32, window, sinks, first, shuffle=shuffle
    )
    scale = dk**-0.5
    got = reference_paged_decode(batch.queries, batch.view, scale, batch.sinks)
    assert got.shape == (len(lengths), hq, 1, dv) and got.dtype == mx.float32
    assert max_diff(got, dense_decode(batch, scale)) < 1e-5


@pytest.fixture
def reference_kernel(monkeypatch):
    """Offer decode calls to the reference only, as a device kernel would be offered them
    (path ``kernel``: no in-place read of a fresh cache's consecutive blocks)."""
    monkeypatch.setattr(routing, "KERNELS", [reference_paged_decode])
    set_attention_path("kernel")
    yield
    set_attention_path("auto")


@pytest.mark.parametrize("family", ["llama", "gemma3_text", "gpt_oss"])
def test_reference_kernel_in_models_matches_dense(family, reference_kernel):
    model = tiny_model(family)
    prompt = prompt_tokens(45)
    before = path_counts["reference_paged_decode"]
    dense_tokens, dense = run_generate_step(model, prompt, make_prompt_cache(model))
    tokens, paged = run_generate_step(model, prompt, make_paged_cache(model, BLOCK))
    used = path_counts["reference_paged_decode"] - before
    assert tokens == dense_tokens
    # On a GPU the dense cache's attention is MLX's fused SDPA, which sums in another order
    # than the reference's ops (gemma3_text: 1.5e-4 apart in float32 on an H200).
    assert max_diff(dense, paged) <= (1e-4 if mx.default_device() == mx.cpu else 5e-4)
    n_attn = len(make_paged_cache(model, BLOCK))
    calls = n_attn * (DECODE_STEPS + 1)  # generate_step runs one step ahead
    assert used == calls


def test_mla_is_never_offered_to_kernels(reference_kernel):
    model = tiny_model("deepseek_v3")
    before = dict(path_counts)
    run_generate_step(model, prompt_tokens(20), make_paged_cache(model, BLOCK), steps=4)
    assert path_counts["reference_paged_decode"] == before.get("reference_paged_decode", 0)
    assert path_counts["gather"] > before.get("gather", 0)


def test_gather_path_forced(reference_kernel):
    set_attention_path("gather")
    model = tiny_model("llama")
    before = path_counts["reference_paged_decode"]
    run_generate_step(model, prompt_tokens(20), make_paged_cache(model, BLOCK), steps=3)
    assert path_counts["reference_paged_decode"] == before


@pytest.mark.skipif(mx.default_device() != mx.cpu, reason="a device kernel runs here")
def test_kernel_path_forced_on_cpu_falls_back_once(caplog):
    """With only the device kernels registered, the CPU has none: warn once, then gather."""
    assert attention.KERNELS == dispatch.DEVICE_KERNELS
    model = tiny_model("llama")
    set_attention_path("kernel")
    try:
        before = path_counts["gather"]
        with caplog.at_level(logging.WARNING, logger="mlx_paged.attention"):
            run_generate_step(model, prompt_tokens(20), make_paged_cache(model, BLOCK), steps=3)
        warnings = [r for r in caplog.records if "no fused kernel runs here" in r.message]
        assert len(warnings) == 1
        assert path_counts["gather"] > before
    finally:
        set_attention_path("auto")


def test_set_attention_path_rejects_unknown():
    with pytest.raises(ValueError, match="attention path"):
        set_attention_path("fast")


def test_device_kernels_decline_off_their_device():
    batch = random_paged_batch([20], 4, 2, 64)
    for kernel in dispatch.DEVICE_KERNELS:
        assert kernel(batch.queries, batch.view, 0.125, None) is None


def test_plan_declines_unsupported_shapes():
    batch = random_paged_batch([20], 4, 2, 80, dtype=mx.float16)  # 80 halves: 10 loads
    assert plan_decode(batch.queries, batch.view).reason
    ok = random_paged_batch([20], 32, 8, 128, dtype=mx.float16)
    plan = plan_decode(ok.queries, ok.view)
    assert plan.reason is None and plan.group == 4 and plan.heads_per_block == 4


def test_device_entry_makes_one_launch_per_shape_and_reuses_it(monkeypatch):
    """A ``KERNELS`` entry's hot path: one launch per call shape, reused; declines stay out."""
    monkeypatch.setattr(dispatch, "_verdicts", {})
    monkeypatch.setattr(dispatch, "backend_available", lambda backend: backend == "fake")
    made, ran = [], []

    def run(q, view, scale, sinks, splits=None):  # what the self-check runs
        return reference_paged_decode(q, view, scale, sinks)

    def launch_for(q, view, scale, sinks):
        made.append(view.block_tables.shape)

        def launch(q, view, sinks):
            ran.append(view.block_tables.shape)
            return reference_paged_decode(q, view, scale, sinks)

        return launch

    entry = dispatch._device_kernel("fake", run, launch_for, "fake_decode")
    short, wide = random_paged_batch([40], 4, 2, 64), random_paged_batch([70], 4, 2, 64)
    for batch in (short, short, wide, short):
        got = entry(batch.queries, batch.view, 0.125, None)
        assert max_diff(got, dense_decode(batch, 0.125)) < 1e-5
    assert made == [(1, 3), (1, 5)] and ran == [(1, 3), (1, 3), (1, 5), (1, 3)]
    odd = random_paged_batch([20], 4, 2, 80, dtype=mx.float16)  # the plan declines it
    assert entry(odd.queries, odd.view, 0.125, None) is None and len(made) == 2


def test_self_check_failures_decline_and_warn(caplog, monkeypatch):
    monkeypatch.setattr(dispatch, "_verdicts", {})
    batch = random_paged_batch([30], 4, 2, 64, seed=3)

    def wrong(q, view, scale, sinks, splits=None):
        return reference_paged_decode(q, view, scale, sinks) + 1.0

    def broken(q, view, scale, sinks, splits=None):
        raise RuntimeError("Failed to compile kernel: boom")

    with caplog.at_level(logging.WARNING, logger="mlx_paged.kernels"):
        for run in (wrong, broken):
            args = (batch.queries, batch.view, 0.125, None)
            assert not dispatch._verified(f"fake-{run.__name__}", run, *args)
    assert "differs from the reference" in caplog.text
    assert "failed its self-check (RuntimeError" in caplog.text

    def right(q, view, scale, sinks, splits=None):
        return reference_paged_decode(q, view, scale, sinks)

    assert dispatch._verified("fake-right", right, batch.queries, batch.view, 0.125, None)


@pytest.fixture
def recording_reader(monkeypatch):
    """A stand-in device reader (the portable read, recorded) as the only ``READERS`` entry."""
    calls = []

    def reader(keys, values, slots):
        calls.append(slots.shape)
        return take_blocks(keys, values, slots)

    monkeypatch.setattr(routing, "READERS", [reader])
    # Path "kernel" reads nothing in place: a lone sequence's consecutive blocks would
    # otherwise go to attention as views of the pool, with no read to offer.
    set_attention_path("kernel")
    yield calls
    set_attention_path("auto")


def test_only_prefill_reads_are_offered_to_readers(recording_reader):
    pool = KVPool(num_layers=1, block_size=4)
    cache = PagedKVCache(pool, pool.new_table(), 0)
    k, v = (mx.random.normal((1, 2, 7, 8)) for _ in range(2))
    got = cache.update_and_fetch(k, v)
    assert recording_reader == [(1, 7)]
    assert all(mx.array_equal(g, x).item() for g, x in zip(got, (k, v), strict=True))
    k1, v1 = (mx.random.normal((1, 2, 1, 8)) for _ in range(2))
    got = cache.update_and_fetch(k1, v1)  # a decode step: its kernel reads the blocks
    assert recording_reader == [(1, 7)]
    assert mx.array_equal(got[0], mx.concatenate([k, k1], axis=2)).item()
    set_attention_path("gather")
    cache.update_and_fetch(k, v)
    assert recording_reader == [(1, 7)]


def test_batched_prefill_read_returns_each_sequences_tokens(recording_reader):
    """The slots a batched prefill hands the reader pick out each sequence's own tokens."""
    pool = KVPool(num_layers=1, block_size=4)
    tables = [pool.new_table() for _ in range(2)]
    written = []
    for t, n in zip(tables, (9, 3), strict=True):
        kv = [mx.random.normal((1, 2, n, 8)) for _ in range(2)]
        pool.write_prefill(t, 0, *kv)
        pool.reserve(t, n, n + 3)
        written.append(kv)
    new = [mx.random.normal((2, 2, 3, 8)) for _ in range(2)]
    batch = DecodeBatch(pool, tables, None, n_new=3)
    got = StepPagedKVCache(pool, batch, 0).update_and_fetch(*new)
    assert recording_reader == [(2, 12)]  # 3 blocks of 4 per row
    for i, n in enumerate((9, 3)):
        for x, old, fresh in zip(got, written[i], new, strict=True):
            want = mx.concatenate([old[0], fresh[i]], axis=1)  # (H, n + 3, D)
            assert x.shape == (2, 2, 12, 8)
            assert mx.array_equal(x[i, :, : n + 3], want).item()


@pytest.mark.parametrize("family", ["llama", "gpt_oss"])
def test_models_prefill_through_a_reader_match_dense(family, recording_reader):
    model = tiny_model(family)
    prompt = prompt_tokens(45)
    dense_tokens, dense = run_generate_step(model, prompt, make_prompt_cache(model))
    tokens, paged = run_generate_step(model, prompt, make_paged_cache(model, BLOCK))
    assert recording_reader and all(shape[1] > 1 for shape in recording_reader)
    assert tokens == dense_tokens
    assert max_diff(dense, paged) <= 1e-4


def test_read_reason_declines_what_the_kernels_cannot_copy():
    k = mx.zeros((4, 8, 2, 64), dtype=mx.float16)
    slots = mx.zeros((1, 5), dtype=mx.int32)
    assert read_reason(k, k, slots) is None
    assert "slots" in read_reason(k, k, slots[0])
    assert "slots" in read_reason(k, k, slots.astype(mx.int64))
    assert "dtypes" in read_reason(k, k.astype(mx.float32), slots)
    odd = mx.zeros((4, 8, 2, 6), dtype=mx.float16)  # 12-byte rows
    assert "16-byte" in read_reason(odd, odd, slots)
    for reader in dispatch.DEVICE_READERS:  # off their device, readers decline
        assert reader(k, k, slots) is None


def test_block_read_self_check_failures_decline_and_warn(caplog, monkeypatch):
    monkeypatch.setattr(dispatch, "backend_available", lambda backend: True)
    k = mx.random.normal((4, 8, 2, 64)).astype(mx.float16)
    slots = mx.array([[5, 9, 30]], dtype=mx.int32)

    def right(backend, keys, values, slots):
        return take_blocks(keys, values, slots)

    def wrong(backend, keys, values, slots):
        return tuple(x + 1 for x in take_blocks(keys, values, slots))

    def broken(backend, keys, values, slots):
        raise RuntimeError("Failed to compile kernel: boom")

    with caplog.at_level(logging.WARNING, logger="mlx_paged.kernels"):
        for run in (wrong, broken):
            monkeypatch.setattr(dispatch, "read_blocks", run)
            assert dispatch._device_reader("fake", "fake")(k, k, slots) is None
    assert "differs from mx.take" in caplog.text
    assert "failed its self-check (RuntimeError" in caplog.text
    monkeypatch.setattr(dispatch, "read_blocks", right)
    got = dispatch._device_reader("fake", "fake")(k, k, slots)
    assert got is not None and mx.array_equal(got[0], take_blocks(k, k, slots)[0]).item()


def test_launch_cache_makes_each_shape_once_and_drops_the_oldest():
    made = []

    def maker(k):
        def make():
            made.append(k)
            return lambda x: x + k

        return make

    cache = LaunchCache(limit=2)
    first = cache.get(("a",), maker(1))
    assert cache.get(("a",), maker(1)) is first and made == [1]
    assert first(mx.array(1)).item() == 2  # what ``make`` returned
    cache.get(("b",), maker(2))
    cache.get(("c",), maker(3))
    assert list(cache.fns) == [("b",), ("c",)] and made == [1, 2, 3]
    assert cache.get(("a",), maker(4)) is not first and made == [1, 2, 3, 4]  # made again
    declined = []
    assert cache.get(("x",), lambda: declined.append(1)) is None
    assert cache.get(("x",), lambda: declined.append(1)) is None and declined == [1]


def zeros_kernel(calls: list[dict]):
    """A stand-in for the CUDA decode kernel object (CPU runs no CUDA): records each call's
    arguments in ``calls`` and returns zeros of the output shapes."""

    def launch(**kw):
        calls.append(kw)
        shapes, dtypes = kw["output_shapes"], kw["output_dtypes"]
        return [mx.zeros(s, dtype=d) for s, d in zip(shapes, dtypes, strict=True)]

    return launch


@pytest.mark.parametrize(
    "batch, length, splits, warps, rows",
    [(1, 1024, 4, 8, 8), (1, 16384, 16, 8, 16), (16, 4096, 1, 8, 16), (64, 1024, 1, 4, 16)],
)
def test_cuda_launch_parameters_without_a_gpu(monkeypatch, batch, length, splits, warps, rows):
    """The CUDA launch's plumbing, with a stand-in for the kernel object (CPU runs no CUDA)."""
    from mlx_paged.attention.kernels import cuda

    calls = []
    monkeypatch.setattr(cuda, "_kernel_obj", [zeros_kernel(calls)])
    monkeypatch.setattr(cuda, "_launches", LaunchCache())
    b = random_paged_batch([length] * batch, 32, 8, 128, 128, 16, mx.float16)
    out = paged_decode_cuda(b.queries, b.view, 0.125, None)
    assert out.shape == (batch, 32, 1, 128) and out.dtype == mx.float16
    paged_decode_cuda(b.queries, b.view, 0.125, None)
    (call,) = calls  # traced once, replayed after
    t = dict(call["template"])
    assert (t["NW"], t["RS"], t["PF"], t["HG"], t["G"]) == (warps, rows, True, 4, 4)
    blocks = 8  # one per KV head: four query heads each, one head group per block
    assert call["grid"] == (blocks * warps * 32, batch, splits)
    assert call["threadgroup"] == (warps * 32, 1, 1)
    counters = call["inputs"][7]
    if splits > 1:
        assert counters.shape == (batch * blocks,) and counters.dtype == mx.int32
    else:
        assert counters is None  # left out of the launch, as the sinks and the cold tier are
    assert call["inputs"][6] is None and call["inputs"][8:] == [None] * 4  # + no new rows
    assert t["FW"] is False


@pytest.mark.parametrize("bits", [None, 8])
def test_new_rows_reach_the_cuda_kernel_as_its_last_inputs(monkeypatch, bits):
    """A view with the step's new K/V rows launches the ``FW`` build with them as its last
    two inputs before the rotation's angles (none here), apart from the launch without
    them; wrong rows are declined."""
    from mlx_paged.attention.kernels import cuda

    calls = []
    monkeypatch.setattr(cuda, "_kernel_obj", [zeros_kernel(calls)])
    monkeypatch.setattr(cuda, "compiled_launch", lambda f: f)  # the kernel sees real arrays
    monkeypatch.setattr(cuda, "_launches", LaunchCache())
    b = random_paged_batch([100, 40], 8, 2, 64, 64, 16, mx.float32, kv_bits=bits)
    rows = [mx.ones((2, 2, 1, 64)), mx.zeros((2, 2, 1, 64))]
    view = b.view._replace(new_keys=rows[0], new_values=rows[1])
    for given, fw in ((view, True), (b.view, False)):
        paged_decode_cuda(b.queries, given, 0.125, None)
        call = calls[-1]
        assert dict(call["template"])["FW"] is fw
        assert call["inputs"][9:] == (rows if fw else [None, None]) + [None]
    assert len(calls) == 2
    for bad in (rows[0][:1], rows[0].astype(mx.float16), rows[0][:, :, :, :32]):
        wrong = b.view._replace(new_keys=bad, new_values=rows[1])
        assert paged_decode_cuda(b.queries, wrong, 0.125, None) is None
    assert len(calls) == 2


@pytest.mark.parametrize("bits", [None, 8])
def test_large_pools_reach_the_cuda_kernel_as_views_of_their_first_row(monkeypatch, bits):
    """From ``NARROW_BYTES`` on, K/V and cold arrays are handed over as views of row 0 (their
    own pointer, a small input for MLX's dispatch); smaller ones whole."""
    from mlx_paged.attention.kernels import cuda

    calls = []
    monkeypatch.setattr(cuda, "_kernel_obj", [zeros_kernel(calls)])
    monkeypatch.setattr(cuda, "compiled_launch", lambda f: f)  # the kernel sees real arrays
    b = random_paged_batch([100, 40], 8, 2, 64, 64, 16, mx.float32, kv_bits=bits)
    cold = [b.view.cold.blob] if bits else []
    whole = [b.view.keys, b.view.values, *cold]
    for threshold, narrowed in ((min(x.nbytes for x in whole), True), (1 << 62, False)):
        monkeypatch.setattr(cuda, "NARROW_BYTES", threshold)
        monkeypatch.setattr(cuda, "_launches", LaunchCache())
        calls.clear()
        paged_decode_cuda(b.queries, b.view, 0.125, None)
        (call,) = calls
        handed = [call["inputs"][1], call["inputs"][2], *(call["inputs"][8:9] if bits else [])]
        assert len(handed) == len(whole) == (3 if bits else 2)
        for got, x in zip(handed, whole, strict=True):
            assert got.shape == ((1, *x.shape[1:]) if narrowed else x.shape)
            assert mx.array_equal(got, x[: got.shape[0]])
        if not bits:
            assert call["inputs"][8] is None


class RecordingKernel:
    """Stands in for the CUDA decode kernel object on the CPU: launches return zeros, and
    launches and builds record their template sets and whether split counters came."""

    def __init__(self):
        self.launched: set[tuple] = set()
        self.built: set[tuple] = set()
        self.scalars: list[dict | None] = []

    def __call__(self, **kw):
        self.launched.add((tuple(kw["template"]), kw["inputs"][7] is not None))
        self.scalars.append(kw.get("scalars"))
        shapes, dtypes = kw["output_shapes"], kw["output_dtypes"]
        return [mx.zeros(s, dtype=d) for s, d in zip(shapes, dtypes, strict=True)]

    def build(self, inputs, template, output_dtypes, scalars=()):
        assert [x is None for x in inputs] == [False] * 6 + [True, inputs[7] is None] + [True] * 4
        assert list(scalars) == []  # cold_base comes with a cold tier only
        self.built.add((tuple(template), inputs[7] is not None))
        return True


def test_prebuild_builds_the_layouts_of_contexts_not_yet_launched(monkeypatch):
    """After launches at short contexts only (a warm-up's), ``prebuild`` builds every binary
    that batches of 1-64 at 1k-16k tokens launch (wide or narrow blocks, long or short
    warp runs, split or not)."""
    from mlx_paged.attention.kernels import cuda

    kernel = RecordingKernel()
    monkeypatch.setattr(cuda, "_kernel_obj", [kernel])
    monkeypatch.setattr(cuda, "_launches", LaunchCache())
    monkeypatch.setattr(cuda, "_variants", {})

    pool = mx.zeros((1, 16, 8, 64), dtype=mx.float16)  # the stand-in reads no block

    def launch(batch: int, length: int) -> None:
        tables = mx.zeros((batch, -(-length // 16)), dtype=mx.int32)
        lengths = mx.full((batch,), length, dtype=mx.int32)
        view = PagedView(pool, pool, tables, mx.zeros_like(lengths), lengths, None)
        paged_decode_cuda(mx.zeros((batch, 32, 1, 64), mx.float16), view, 0.125, None)

    for batch in (64, 8, 1):
        launch(batch, 40)
    warm = set(kernel.launched)
    assert cuda.prebuild() == 6  # narrow: 2 row layouts x split or not; wide: 2, unsplit
    for batch in (1, 4, 16, 64):
        for length in (1024, 4096, 16384):
            launch(batch, length)
    assert kernel.launched - warm  # long contexts launch layouts short ones did not
    assert kernel.launched <= kernel.built | warm


def test_every_layer_of_a_cold_stack_shares_one_launch_at_its_own_rows(monkeypatch):
    """A cold view's layer reaches the kernel as the first row of its blocks (``cold_base``,
    the layer times the stack's slots); the layers of a step share one cached launch."""
    from mlx_paged.attention.kernels import cuda

    kernel = RecordingKernel()
    monkeypatch.setattr(cuda, "_kernel_obj", [kernel])
    monkeypatch.setattr(cuda, "_launches", LaunchCache())
    batch = random_paged_batch([40, 20], 4, 2, 64, 64, 16, mx.float16, kv_bits=8)
    slots = batch.view.cold.blob.shape[1]
    for layer in (1, 2, 0, 2):
        view = batch.view._replace(cold=batch.view.cold._replace(layer=layer))
        paged_decode_cuda(batch.queries, view, 0.125, None)
    assert kernel.scalars == [{"cold_base": layer * slots} for layer in (1, 2, 0)]  # traced once
    assert len(cuda._launches.fns) == 1
    paged_decode_cuda(batch.queries, batch.view._replace(cold=None), 0.125, None)
    assert kernel.scalars[-1] is None  # a batch without cold blocks passes no scalar


@pytest.fixture
def kernel_path():
    """Path ``kernel``: eligible decode calls meet the kernels, never an in-place read."""
    set_attention_path("kernel")
    yield
    set_attention_path("auto")


def cuda_only(test):
    """Run ``test`` on a CUDA GPU; skip it elsewhere."""
    test = pytest.mark.skipif(not mx.cuda.is_available(), reason="needs a CUDA GPU")(test)
    return pytest.mark.gpu(test)


@cuda_only
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"L{c[0]}-d{c[3]}-w{c[6]}-s{c[7]}")
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
@pytest.mark.parametrize("splits", [1, 3])
def test_cuda_kernel_matches_reference(config, dtype, splits):
    lengths, hq, hkv, dk, dv, bs, window, sinks, first = config
    batch = random_paged_batch(lengths, hq, hkv, dk, dv, bs, dtype, window, sinks, first)
    scale = dk**-0.5
    with mx.stream(mx.cpu):
        want = reference_paged_decode(batch.queries, batch.view, scale, batch.sinks)
        want = want.astype(mx.float32)
    got = paged_decode_cuda(batch.queries, batch.view, scale, batch.sinks, splits)
    assert max_diff(got.astype(mx.float32), want) <= dispatch.TOLERANCE[dtype]


@cuda_only
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
@pytest.mark.parametrize("heads_dims", [(8, 64, 8, 64), (2, 256, 2, 256), (1, 192, 1, 128)])
@pytest.mark.parametrize("bs", [8, 16])
@pytest.mark.parametrize("batch, tokens", [(1, 1), (1, 77), (3, 1029)])
def test_cuda_block_read_copies_exactly(dtype, heads_dims, bs, batch, tokens):
    hk, dk, hv, dv = heads_dims
    nb = batch * tokens // bs + 5
    keys = mx.random.normal((nb, bs, hk, dk)).astype(dtype)
    values = mx.random.normal((nb, bs, hv, dv)).astype(dtype)
    slots = mx.random.randint(0, nb * bs, (batch, tokens)).astype(mx.int32)
    got = dispatch.cuda_block_read(keys, values, slots)
    assert got is not None
    for g, w in zip(got, take_blocks(keys, values, slots), strict=True):
        assert g.shape == w.shape and g.dtype == dtype and mx.array_equal(g, w).item()


@cuda_only
def test_cuda_split_launches_evaluated_together_keep_their_own_counters():
    # Independent launches may run concurrently in one CUDA graph; each must zero and
    # use its own split counters, or merges would read other launches' partials.
    batches = [
        random_paged_batch([900, 300], 16, 4, 128, 128, 16, mx.float16, seed=s) for s in range(12)
    ]
    outs = [paged_decode_cuda(b.queries, b.view, 128**-0.5, None, 5) for b in batches]
    mx.eval(outs)
    for b, got in zip(batches, outs, strict=True):
        with mx.stream(mx.cpu):
            want = reference_paged_decode(b.queries, b.view, 128**-0.5, None)
        assert max_diff(got.astype(mx.float32), want.astype(mx.float32)) <= 4e-3


@cuda_only
@pytest.mark.parametrize("family", ["llama", "gemma3_text", "gpt_oss"])
def test_models_through_the_cuda_kernels_match_dense(family, kernel_path):
    """mlx-lm's generate_step on the GPU: every prefill read and decode attention call goes
    through the CUDA kernels, and the logits match mlx-lm's dense cache on the same GPU.
    (Path ``kernel``: under ``auto`` a fresh cache's consecutive blocks are read in place.)"""
    model = tiny_model(family)
    prompt = prompt_tokens(45)
    gpu = mx.new_stream(mx.gpu)
    decodes, reads = path_counts["cuda_paged_decode"], attention.read_counts["cuda_block_read"]
    dense_tokens, dense = run_generate_step(model, prompt, make_prompt_cache(model), stream=gpu)
    cache = make_paged_cache(model, BLOCK)
    tokens, paged = run_generate_step(model, prompt, cache, stream=gpu)
    layers = len(cache)
    assert path_counts["cuda_paged_decode"] - decodes == layers * (DECODE_STEPS + 1)
    assert attention.read_counts["cuda_block_read"] - reads == layers * 3  # 16 + 16 + 12 tokens
    assert tokens == dense_tokens
    assert max_diff(dense, paged) <= TOL  # conftest turns TF32 off


@cuda_only
@pytest.mark.parametrize(
    "family, config, decode",
    [
        ("llama", {"head_dim": 64}, "in_place"),
        ("qwen3", {"head_dim": 64}, "in_place"),
        ("qwen3", {"head_dim": 32}, "cuda_paged_decode"),
        ("gemma3_text", {"head_dim": 64}, None),  # sliding layers take the kernel
        ("deepseek_v3", {}, None),
    ],
)
def test_in_place_reads_on_the_gpu_match_dense(family, config, decode):
    """Under ``auto``, a fresh cache's decode reads views of the pool with MLX's own SDPA
    on the GPU (strided K/V: token stride ``H * D``) where MLX's vector attention takes the
    head dim, and goes to the CUDA kernel where it would copy the views; the logits match
    mlx-lm's dense cache on the same GPU."""
    set_attention_path("auto")
    model = tiny_model(family, **config)
    prompt = prompt_tokens(45)
    gpu = mx.new_stream(mx.gpu)
    dense_tokens, dense = run_generate_step(model, prompt, make_prompt_cache(model), stream=gpu)
    before = dict(path_counts)
    cache = make_paged_cache(model, BLOCK)
    tokens, paged = run_generate_step(model, prompt, cache, stream=gpu)
    assert path_counts["in_place"] > before.get("in_place", 0)  # the prompt's chunks
    if decode is not None:
        assert path_counts[decode] - before.get(decode, 0) >= len(cache) * DECODE_STEPS
    assert tokens == dense_tokens
    assert max_diff(dense, paged) <= TOL


@cuda_only
@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_engine_through_the_cuda_kernels_matches_solo_dense(family):
    """Batched suffix prefill and decode through the CUDA kernels give each request the
    tokens it gets alone on mlx-lm's dense cache, on the same GPU."""
    set_attention_path("auto")
    model = tiny_model(family)
    prompts = mixed_prompts(seed=2)
    decodes, reads = path_counts["cuda_paged_decode"], attention.read_counts["cuda_block_read"]
    engine = PagedEngine(model, block_size=BLOCK, max_batch_size=6, prefill_step_size=16)
    outputs = run_all(engine, prompts)
    assert path_counts["cuda_paged_decode"] > decodes
    assert attention.read_counts["cuda_block_read"] > reads
    gpu = mx.new_stream(mx.gpu)
    for prompt, got in zip(prompts, outputs, strict=True):
        solo = generate_step(
            mx.array(prompt),
            model,
            prompt_cache=make_prompt_cache(model),
            max_tokens=MAX_TOKENS,
            stream=gpu,
        )
        assert got == [tok for tok, _ in solo]
