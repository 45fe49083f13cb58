import os
import sys
from pathlib import Path

# Full float32 matmuls on GPUs that would otherwise round them through TF32, so the GPU
# tests hold the same parity tolerances as the CPU ones. Set before MLX is imported.
os.environ.setdefault("MLX_ENABLE_TF32", "0")

import mlx.core as mx

# Before mlx-lm is imported (importing mlx_paged imports it): mlx-lm makes its generation
# stream on the default device then, and unmarked tests' generate_step runs on that stream.
mx.set_default_device(mx.cpu)

import pytest  # noqa: E402

from mlx_paged.attention import routing, set_attention_path  # noqa: E402
from mlx_paged.attention.kernels import cubin, fatbin  # noqa: E402
from mlx_paged.attention.kernels.reference import reference_paged_decode  # noqa: E402

# Make tests/tiny_models.py importable as a plain module.
sys.path.insert(0, str(Path(__file__).parent))

from stand_ins import store_new_rows  # noqa: E402


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: runs on the GPU (every other test runs on the CPU)")


@pytest.fixture(autouse=True)
def _device(request):
    """Run tests on the CPU unless marked ``gpu``.

    On a CUDA machine the GPU would otherwise be the default device for every test,
    and the CPU is where mlx-lm's dense reference runs by default.
    """
    before = mx.default_device()
    want = mx.gpu if request.node.get_closest_marker("gpu") else mx.cpu
    mx.set_default_device(want)
    yield
    mx.set_default_device(before)


@pytest.fixture
def kernel_cache(tmp_path, monkeypatch):
    """A cache folder of its own, an architecture and an NVRTC version without a GPU, and
    a compiler that records its calls."""
    monkeypatch.setenv("MLX_PAGED_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setattr(fatbin, "enabled", lambda: False)  # cubins launched as they are
    monkeypatch.setattr(cubin, "architecture", lambda: "sm_90")
    monkeypatch.setattr(cubin, "_nvrtc_version", lambda: "13.0")
    monkeypatch.setattr(cubin, "_cubins", {})
    calls = []

    def compile_fn(src, name, options):
        calls.append((name, options))
        return f"cubin of {name} for {options[0]}".encode()

    return tmp_path, calls, compile_fn


@pytest.fixture
def launched(monkeypatch):
    """The keyword arguments of each ``mx.fast.precompiled_cuda_kernel`` call, which returns
    zeros of the output shapes instead of launching anything."""
    calls = []

    def precompiled(**kw):
        calls.append(kw)
        shapes, dtypes = kw["output_shapes"], kw["output_dtypes"]
        return [mx.zeros(s, dtype=d) for s, d in zip(shapes, dtypes, strict=True)]

    monkeypatch.setattr(mx.fast, "precompiled_cuda_kernel", precompiled)
    return calls


@pytest.fixture
def writing(monkeypatch):
    """A ``KERNELS`` entry that stores the new rows then reads like the reference, or
    declines; it records the views it was offered."""
    calls = {"take": True, "views": [], "declined": 0}

    def entry(queries, view, scale, sinks):
        calls["views"].append(view)
        if not calls["take"]:
            calls["declined"] += 1
            return None
        if view.new_keys is not None:
            store_new_rows(view)
        return reference_paged_decode(queries, view, scale, sinks)

    entry.writes = True
    monkeypatch.setattr(routing, "KERNELS", [entry])
    routing._ready.clear()
    set_attention_path("kernel")
    yield calls
    set_attention_path("auto")
    routing._ready.clear()
