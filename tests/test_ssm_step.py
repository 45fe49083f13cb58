"""mlx-lm's Mamba2 decode step through the CUDA kernel (``mlx_paged.attention.mamba``),
against mlx-lm's own ``ssm_update`` (``ssm_attn`` wherever Metal is not available)."""

from __future__ import annotations

import importlib
import shutil
import subprocess

import mlx.core as mx
import pytest
from mlx_lm.models import nemotron_h, ssm
from mlx_lm.models.cache import make_prompt_cache
from test_gated_delta import cuda_only
from tiny_models import tiny_model

from mlx_paged.attention import mamba
from mlx_paged.attention.kernels import ssm_step
from mlx_paged.attention.kernels.cubin import render
from mlx_paged.attention.kernels.ssm_step import ssm_step_reason

ORIGINAL = mamba._original_update
LIMIT = (0.0, 0.1)


def inputs(n, h, dh, g, ds, dtype, masked=False, seed=0):
    """One token's arguments of ``ssm_update`` for ``n`` sequences; with ``masked`` the
    second sequence's token is masked out."""
    r = mx.random.split(mx.random.key(seed), 8)
    x = mx.random.normal((n, 1, h, dh), key=r[0]).astype(dtype)
    a_log = mx.random.uniform(-1.0, 1.0, (h,), key=r[1]).astype(dtype)
    b = mx.random.normal((n, 1, g, ds), key=r[2]).astype(dtype)
    c = mx.random.normal((n, 1, g, ds), key=r[3]).astype(dtype)
    d = mx.random.normal((h,), key=r[4]).astype(dtype)
    dt = mx.random.normal((n, 1, h), key=r[5]).astype(dtype)
    dt_bias = mx.random.normal((h,), key=r[6]).astype(dtype)
    state = mx.random.normal((n, h, dh, ds), key=r[7])
    mask = mx.array([[i != 1] for i in range(n)]) if masked else None
    return x, a_log, b, c, d, dt, dt_bias, state, mask


def reference_step(x, A_log, B, C, D, dt, state, mask=None):
    """What the CUDA kernel computes, in MLX ops (``dt`` already through ``compute_dt``)."""
    n, _, h, dh = x.shape
    g = B.shape[2]
    xs, dts = x[:, 0].astype(mx.float32), dt[:, 0]  # (n, h, dh), (n, h)
    decay = mx.exp(-mx.exp(A_log.astype(mx.float32)) * dts)
    dtx = xs * dts[..., None]
    if mask is not None:
        keep = mask.reshape(n, 1)
        decay, dtx = mx.where(keep, decay, 1.0), mx.where(keep[..., None], dtx, 0.0)
    bs = mx.repeat(B[:, 0], h // g, axis=1).astype(mx.float32)  # (n, h, ds)
    cs = mx.repeat(C[:, 0], h // g, axis=1).astype(mx.float32)
    s = decay[..., None, None] * state + dtx[..., None] * bs[:, :, None]
    scan = (s * cs[:, :, None]).sum(-1).astype(x.dtype)  # as ssm_attn: then x D, promoted
    return (scan + x[:, 0] * D[:, None])[:, None], s


def test_route_rebinds_mlx_lms_name_everywhere_and_the_cpu_keeps_mlx_lms_path(monkeypatch):
    assert ssm.ssm_update is mamba.ssm_update and nemotron_h.ssm_update is mamba.ssm_update
    for module in (ssm, nemotron_h):
        monkeypatch.setattr(module, "ssm_update", ORIGINAL)
    monkeypatch.setenv("MLX_PAGED_SSM", "off")
    assert mamba.route_ssm_update() == 0 and nemotron_h.ssm_update is ORIGINAL
    monkeypatch.delenv("MLX_PAGED_SSM")
    assert mamba.route_ssm_update() >= 2 and nemotron_h.ssm_update is mamba.ssm_update
    assert ssm.ssm_update is mamba.ssm_update
    before = dict(mamba.ssm_counts)
    args = inputs(2, 4, 16, 2, 32, mx.float32, masked=True)
    got = mamba.ssm_update(*args[:8], LIMIT, args[8])
    want = ORIGINAL(*args[:8], LIMIT, args[8])
    assert all(mx.array_equal(a, b) for a, b in zip(got, want, strict=True))
    assert dict(mamba.ssm_counts) == before  # the CPU: mlx-lm's path, not counted


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize(
    "dtype, d_dtype",
    [(mx.float32, mx.float32), (mx.bfloat16, mx.bfloat16), (mx.bfloat16, mx.float32)],
)
def test_the_kernels_math_matches_ssm_attn(masked, dtype, d_dtype):
    """The kernel's formula (``reference_step``) against mlx-lm's ``ssm_attn`` for one token,
    a masked token included, and a ``D`` kept in float32 under bfloat16 activations (the
    output then float32): the spec the CUDA source follows."""
    x, a_log, b, c, d, dt, dt_bias, state, mask = inputs(3, 6, 8, 3, 32, dtype, masked)
    d = d.astype(d_dtype)
    got = reference_step(x, a_log, b, c, d, ssm.compute_dt(dt, dt_bias, LIMIT), state, mask)
    want = ORIGINAL(x, a_log, b, c, d, dt, dt_bias, state, LIMIT, mask)
    tol = 1e-5 if dtype == mx.float32 else 2e-2
    for a, w in zip(got, want, strict=True):
        assert a.dtype == w.dtype and a.shape == w.shape
        assert mx.allclose(a, w, atol=tol, rtol=tol).item(), float(mx.abs(a - w).max())


def test_one_token_steps_replay_a_compiled_launch_decided_once_per_shape(monkeypatch):
    """On CUDA (stood in here, the kernel by ``reference_step``) a one-token step goes to the
    compiled launch, traced and checked once per shape; prompts, calls with ``lengths`` and
    shapes the kernel does not take keep mlx-lm's path."""
    traces, checks = [], []

    def kernel(*args):
        traces.append(args[0].shape)
        return reference_step(*args)

    real_check = mamba._check

    def check(arrays, limit):
        checks.append(arrays[0].shape)
        return real_check(arrays, limit)

    monkeypatch.setattr(mamba, "_on_cuda", lambda: True)
    monkeypatch.setattr(mamba, "cuda_ssm_step", kernel)
    monkeypatch.setattr(mamba, "_launch", mx.compile(mamba._step))
    monkeypatch.setattr(mamba, "_check", check)
    monkeypatch.setattr(mamba, "_runs", {})
    before = dict(mamba.ssm_counts)
    for seed in range(3):
        args = inputs(2, 4, 16, 2, 32, mx.float32, masked=True, seed=seed)
        got = mamba.ssm_update(*args[:8], LIMIT, args[8])
        want = ORIGINAL(*args[:8], LIMIT, args[8])
        assert all(mx.allclose(a, b, atol=1e-5).item() for a, b in zip(got, want, strict=True))
    # One trace for the check's direct call, one for the compiled launch; one check.
    assert checks == [(2, 1, 4, 16)] and len(traces) == 2
    x, a_log, b, c, d, dt, dt_bias, state, _ = inputs(2, 4, 16, 2, 32, mx.float32)
    prompt = (mx.concatenate([x, x], 1), a_log, mx.concatenate([b, b], 1))
    mamba.ssm_update(*prompt, mx.concatenate([c, c], 1), d, mx.concatenate([dt, dt], 1), dt_bias)
    mamba.ssm_update(x, a_log, b, c, d, dt, dt_bias, state, LIMIT, None, mx.array([1, 1]))
    narrow = inputs(1, 4, 16, 2, 16, mx.float32)  # a state dim of 16: not the kernel's
    assert "state dim" in ssm_step_reason(*narrow[:6], narrow[7], None)
    mamba.ssm_update(*narrow[:8], LIMIT)
    assert len(traces) == 2 and len(checks) == 1
    counts = {k: v - before.get(k, 0) for k, v in mamba.ssm_counts.items()}
    assert counts == {"kernel": 3, "ops": 1}


def test_the_kernel_declines_shapes_it_does_not_take():
    x, a_log, b, c, d, dt, _, state, _ = inputs(2, 4, 16, 2, 32, mx.float16)
    assert ssm_step_reason(x, a_log, b, c, d, dt, state, None) is None
    assert "one token" in ssm_step_reason(
        mx.concatenate([x, x], 1), a_log, b, c, d, dt, state, None
    )
    b3, c3 = mx.repeat(b[:, :, :1], 3, axis=2), mx.repeat(c[:, :, :1], 3, axis=2)
    assert "heads" in ssm_step_reason(x, a_log, b3, c3, d, dt, state, None)  # 4 heads, 3 groups
    assert "B/C" in ssm_step_reason(x, a_log, b3, c, d, dt, state, None)
    assert "state shape" in ssm_step_reason(x, a_log, b, c, d, dt, state[:, :2], None)
    assert "mask" in ssm_step_reason(x, a_log, b, c, d, dt, state, mx.ones((2, 2), mx.bool_))
    assert "dtypes" in ssm_step_reason(x, a_log, b.astype(mx.float32), c, d, dt, state, None)
    assert ssm_step_reason(x, a_log, b, c, d.astype(mx.float32), dt, state, None) is None


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_the_cuda_source_compiles_for_each_dtype_and_mask(tmp_path):
    """nvcc builds the kernel as ``CudaKernel`` renders it, for every activation dtype, a
    ``D`` of the same dtype or float32, with and without a mask (no GPU needed)."""
    names = ["x", "A_log", "B", "C", "Dd", "dt", "state_in", "mask"]
    code = ""
    for i, dtype in enumerate([mx.float32, mx.float16, mx.bfloat16]):
        for d_dtype in {dtype, mx.float32}:
            for masked in (False, True):
                template = [("InT", dtype), ("OutT", mx.result_type(dtype, d_dtype))]
                template += [("StT", mx.float32), ("Dh", 64), ("Ds", 128), ("H", 8), ("G", 2)]
                template += [("MASK", masked)]
                dtypes = [dtype, dtype, dtype, dtype, d_dtype, mx.float32, mx.float32]
                source, _ = render(
                    f"ssm_step_{i}_{d_dtype.size}_{int(masked)}",
                    "",
                    ssm_step._SOURCE,
                    names,
                    [*dtypes, mx.int32 if masked else None],
                    [4, 1, 4, 4, 1, 3, 4, 2],
                    ["y", "state_out"],
                    [mx.result_type(dtype, d_dtype), mx.float32],
                    template,
                    {"mask": "int"},
                )
                code += source.split("\n", 2)[2] if code else source  # one preamble
    path = tmp_path / "ssm_step.cu"
    path.write_text(code)
    cmd = ["nvcc", "-arch=sm_90", "-std=c++17", "-c", str(path), "-o", str(tmp_path / "k.o")]
    done = subprocess.run(cmd, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]


@cuda_only
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
@pytest.mark.parametrize(
    "shape", [(1, 8, 64, 1, 128), (3, 6, 16, 3, 32), (2, 128, 64, 8, 128), (1, 4, 40, 2, 256)]
)
@pytest.mark.parametrize("masked", [False, True], ids=["", "masked"])
@pytest.mark.parametrize("d_float32", [False, True], ids=["", "d_float32"])
def test_the_cuda_kernel_matches_ssm_attn(dtype, shape, masked, d_float32):
    from mlx_paged.attention.kernels.ssm_step import cuda_ssm_step

    x, a_log, b, c, d, dt, dt_bias, state, mask = inputs(*shape, dtype, masked and shape[0] > 1)
    d = d.astype(mx.float32) if d_float32 else d  # then y is float32, as ssm_attn gives it
    got = cuda_ssm_step(x, a_log, b, c, d, ssm.compute_dt(dt, dt_bias, LIMIT), state, mask)
    want = ORIGINAL(x, a_log, b, c, d, dt, dt_bias, state, LIMIT, mask)
    tol = 1e-4 if dtype == mx.float32 else 3e-2
    for a, w in zip(got, want, strict=True):
        assert a.dtype == w.dtype and a.shape == w.shape
        assert mx.allclose(a, w, atol=tol, rtol=tol).item(), float(mx.abs(a - w).max())


@cuda_only
@pytest.mark.parametrize("family", ["nemotron_h", "granitemoehybrid", "falcon_h1", "mamba2"])
def test_a_models_decode_steps_match_mlx_lms_path(family, monkeypatch):
    """Every one-token step of a model's decode, through the kernel and mlx-lm's path on the
    same inputs. (Whole-model logits of these tiny random models are not comparable on the
    GPU: two runs of mlx-lm's own path can differ there.)"""
    state = {"mamba2": "state_size", "nemotron_h": "ssm_state_size"}.get(family, "mamba_d_state")
    model = tiny_model(family, **{state: 32})
    diffs, before = [], mamba.ssm_counts["kernel"]

    def both(*args, **kwargs):
        got = mamba.ssm_update(*args, **kwargs)
        want = ORIGINAL(*args, **kwargs)
        # Relative to the output's size: float32 sums of 32 state products, in another order.
        diffs.extend(
            float(mx.abs(a - b).max() / (1 + mx.abs(b).max()))
            for a, b in zip(got, want, strict=True)
        )
        return want

    for module in (ssm, importlib.import_module(f"mlx_lm.models.{family}")):
        monkeypatch.setattr(module, "ssm_update", both)
    cache = make_prompt_cache(model)
    tokens = mx.array([[(7 * i) % 200 for i in range(24)]])
    mx.eval(model(tokens[:, :20], cache=cache))
    for i in range(20, 24):
        mx.eval(model(tokens[:, i : i + 1], cache=cache))
    assert mamba.ssm_counts["kernel"] - before > 0
    assert max(diffs) < 1e-4, diffs
