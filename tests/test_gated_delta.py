"""mlx-lm's GatedDeltaNet recurrence through the CUDA kernel, against mlx-lm's own loop of ops."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models import gated_delta
from mlx_lm.models.cache import make_prompt_cache
from tiny_models import tiny_model

from mlx_paged.attention import recurrent
from mlx_paged.attention.kernels.gated_delta import gated_delta_reason
from mlx_paged.attention.recurrent import gated_delta_counts, route_gated_delta

ORIGINAL = recurrent._original_ops


def inputs(b, t, hk, hv, dk, dv, dtype, vec=False, masked=False, seed=0):
    r = mx.random.split(mx.random.key(seed), 6)
    q = mx.random.normal((b, t, hk, dk), key=r[0])
    k = mx.random.normal((b, t, hk, dk), key=r[1])
    q = (q / mx.linalg.norm(q, axis=-1, keepdims=True) * dk**-0.5).astype(dtype)
    k = (k / mx.linalg.norm(k, axis=-1, keepdims=True)).astype(dtype)
    v = mx.random.normal((b, t, hv, dv), key=r[2]).astype(dtype)
    g = mx.random.uniform(0.6, 1.0, (b, t, hv, dk) if vec else (b, t, hv), key=r[3])
    beta = mx.random.uniform(0.0, 1.0, (b, t, hv), key=r[4]).astype(dtype)
    state = mx.random.normal((b, hv, dv, dk), key=r[5])
    mask = None
    if masked:  # the first sequence left-padded by 4 tokens, the second right-padded by 3
        rows = [[i >= 4 for i in range(t)], [i < t - 3 for i in range(t)]] + [[True] * t] * b
        mask = mx.array(rows[:b])
    return q, k, v, g, beta, state, mask


def test_route_gated_delta_rebinds_mlx_lms_name_and_the_cpu_keeps_the_ops(monkeypatch):
    assert route_gated_delta() and gated_delta.gated_delta_ops is recurrent.gated_delta_ops
    args = inputs(2, 7, 2, 4, 32, 32, mx.float32, masked=True)
    before = gated_delta_counts["ops"]
    got = recurrent.gated_delta_ops(*args)
    want = ORIGINAL(*args)
    assert gated_delta_counts["ops"] == before + 1
    assert all(mx.array_equal(a, b) for a, b in zip(got, want, strict=True))
    monkeypatch.setattr(gated_delta, "gated_delta_ops", ORIGINAL)
    monkeypatch.setenv("MLX_PAGED_GATED_DELTA", "off")
    assert not route_gated_delta() and gated_delta.gated_delta_ops is ORIGINAL


def test_one_token_calls_replay_a_compiled_launch_decided_once_per_shape(monkeypatch):
    """On CUDA (stood in here, with mlx-lm's loop as the kernel), a one-token call goes to the
    compiled launch, traced once per shapes and checked once; a prompt's call launches
    directly; shapes whose check failed keep mlx-lm's loop."""
    traces, checks = [], []

    def kernel(*args):
        traces.append(args[0].shape)
        return ORIGINAL(*args)

    def trusted(*arrays):
        checks.append(arrays[0].shape)
        return arrays[0].shape[2] != 3  # three key heads "failed" their check

    monkeypatch.setattr(recurrent, "_on_cuda", lambda: True)
    monkeypatch.setattr(recurrent, "_trusted", trusted)
    monkeypatch.setattr(recurrent, "cuda_gated_delta", kernel)
    monkeypatch.setattr(recurrent, "_one_token_launch", mx.compile(kernel))
    monkeypatch.setattr(recurrent, "_one_token", {})
    counts = dict(gated_delta_counts)
    for seed in range(3):
        args = inputs(2, 1, 2, 4, 32, 32, mx.float32, seed=seed)
        got = recurrent.gated_delta_ops(*args)
        want = ORIGINAL(*args)
        assert all(mx.allclose(a, b, atol=1e-6).item() for a, b in zip(got, want, strict=True))
    assert traces == [(2, 1, 2, 32)] and checks == [(2, 1, 2, 32)]
    recurrent.gated_delta_ops(*inputs(2, 5, 2, 4, 32, 32, mx.float32))  # a prompt: direct
    assert traces[-1] == (2, 5, 2, 32) and len(traces) == 2
    for _ in range(2):  # a shape that failed its check: the loop, checked once
        recurrent.gated_delta_ops(*inputs(1, 1, 3, 3, 32, 32, mx.float32))
    assert len(traces) == 2 and checks.count((1, 1, 3, 32)) == 1
    assert gated_delta_counts["kernel"] - counts.get("kernel", 0) == 4
    assert gated_delta_counts["ops"] - counts.get("ops", 0) == 2


def test_the_kernel_declines_shapes_it_does_not_take():
    q, k, v, g, beta, state, mask = inputs(1, 3, 2, 4, 32, 16, mx.float16)
    assert gated_delta_reason(q, k, v, g, beta, state, mask) is None
    assert "key dim" in gated_delta_reason(q[..., :16], k[..., :16], v, g, beta, state, None)
    assert "key dim" in gated_delta_reason(q, k, v[:, :, :3], g, beta, state[:, :3], None)
    assert "state" in gated_delta_reason(q, k, v, g, beta, state[:, :, :8], None)
    assert "gate" in gated_delta_reason(q, k, v, g[:, :2], beta, state, None)
    assert "mask" in gated_delta_reason(q, k, v, g, beta, state, mx.ones((1, 2), mx.bool_))
    assert "dtypes" in gated_delta_reason(q, k.astype(mx.float32), v, g, beta, state, None)


def cuda_only(test):
    test = pytest.mark.skipif(not mx.cuda.is_available(), reason="needs a CUDA GPU")(test)
    return pytest.mark.gpu(test)


@cuda_only
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
@pytest.mark.parametrize(
    "shape",
    [
        (1, 1, 2, 2, 64, 64),
        (2, 37, 2, 4, 128, 128),
        (3, 20, 1, 3, 32, 40),
        (1, 300, 4, 8, 128, 64),
        (1, 33, 1, 2, 256, 128),
    ],
    ids=lambda s: "b{}-t{}-hk{}-hv{}-dk{}-dv{}".format(*s),
)
@pytest.mark.parametrize("vec", [False, True], ids=["scalar_g", "vector_g"])
@pytest.mark.parametrize("masked", [False, True], ids=["", "masked"])
def test_the_cuda_kernel_matches_mlx_lms_ops(dtype, shape, vec, masked):
    from mlx_paged.attention.kernels.gated_delta import cuda_gated_delta

    args = inputs(*shape, dtype, vec=vec, masked=masked and shape[0] > 1)
    y, state = cuda_gated_delta(*args)
    y0, state0 = ORIGINAL(*args)
    if args[-1] is not None:  # the kernel writes 0 at masked tokens; nothing reads them
        keep = args[-1][..., None, None]
        y0 = mx.where(keep, y0, 0)
        assert not mx.any(mx.where(keep, 0, y)).item()
    tol = 1e-4 if dtype == mx.float32 else 2e-2
    assert y.dtype == y0.dtype and state.dtype == state0.dtype
    assert mx.allclose(y, y0, atol=tol, rtol=tol).item(), float(mx.abs(y - y0).max())
    assert mx.allclose(state, state0, atol=tol, rtol=tol).item()


@cuda_only
@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next"])
def test_a_models_calls_match_mlx_lms_loop(family, monkeypatch):
    """Every call a model's prefill and decode make, through the kernel and the loop on the
    same inputs. (Whole-model logits of these tiny random models are not comparable on the
    GPU: two runs of mlx-lm's own path can differ there.)"""
    model = tiny_model(family, linear_key_head_dim=32, linear_value_head_dim=32)
    diffs = []

    def both(q, k, v, g, beta, state=None, mask=None):
        got = recurrent.gated_delta_ops(q, k, v, g, beta, state, mask)
        want = ORIGINAL(q, k, v, g, beta, state, mask)
        diffs.extend(float(mx.abs(a - b).max()) for a, b in zip(got, want, strict=True))
        return want

    monkeypatch.setattr(gated_delta, "gated_delta_ops", both)
    before = gated_delta_counts["kernel"]
    cache = make_prompt_cache(model)
    tokens = mx.array([[(7 * i) % 200 for i in range(50)]])
    for lo, hi in ((0, 45), (45, 46), (46, 50)):
        mx.eval(model(tokens[:, lo:hi], cache=cache))
    assert gated_delta_counts["kernel"] - before == len(diffs) // 2 == 6  # 2 layers, 3 calls
    assert max(diffs) < 1e-4, diffs
