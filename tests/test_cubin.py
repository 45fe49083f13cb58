"""CUDA kernels compiled once per machine: the rendered source, the disk cache and, on a GPU,
kernels loaded from it matching the reference."""

from __future__ import annotations

import re

import mlx.core as mx
from test_kernels import cuda_only

from mlx_paged.attention.kernels import cubin, cuda, read, source
from mlx_paged.attention.kernels.cuda import paged_decode_cuda
from mlx_paged.attention.kernels.read import read_blocks
from mlx_paged.attention.kernels.reference import reference_paged_decode
from mlx_paged.attention.kernels.synthetic import random_paged_batch
from mlx_paged.storage import take_blocks

DECODE_DTYPES = [mx.float16] * 3 + [mx.int32] * 3 + [mx.float32, mx.int32]
DECODE_DTYPES += [mx.uint32] + [mx.float16] * 2 + [mx.float32]
DECODE_NDIMS = [4, 4, 4, 2] + [1] * 4 + [3] + [4, 4] + [1]
OUTPUT_DTYPES = [mx.float16, mx.float32, mx.float32, mx.float32]


def render_decode(template):
    return cubin.render(
        "k",
        cuda.HEADER,
        cuda.DECODE_SOURCE,
        cuda._INPUTS,
        DECODE_DTYPES,
        DECODE_NDIMS,
        cuda._OUTPUTS,
        OUTPUT_DTYPES,
        template,
    )


def test_render_writes_mlxs_signature_with_shapes_as_trailing_ints():
    src, shaped = render_decode([("T", mx.float16), ("DK", 64), ("SINKS", False), ("NEG", -3)])
    assert shaped == [cuda._INPUTS.index("block_tables")]  # the only shape the body reads
    params = re.search(r'extern "C" __global__ void k\(([^)]*)\)', src).group(1)
    names = [p.split()[-1].lstrip("*") for p in params.split(",")]
    want = [*cuda._INPUTS, *cuda._OUTPUTS, "block_tables_shape_0", "block_tables_shape_1"]
    assert names == want
    assert "const __half* queries" in params and "const unsigned int* cold," in params
    assert "float* part_out" in params and "const float* sinks" in params
    assert "const __half* new_keys" in params and "const __half* new_values" in params
    assert "const float* rope_freqs" in params
    for line in [
        "const int block_tables_shape[] = {block_tables_shape_0, block_tables_shape_1};",
        "using T = __half;",
        "constexpr int DK = 64;",
        "constexpr bool SINKS = false;",
        "constexpr int NEG = -3;",
    ]:
        assert line in src
    assert src.endswith(f"\n{cuda.DECODE_SOURCE}\n}}\n")  # the body, unchanged, closes it


def test_render_passes_scalars_after_the_shapes_or_declares_them_zero():
    template = [("T", mx.float16)]
    args = ("k", "", "out[0] = a[n] + b_shape[0];", ["a", "b"], [mx.float16, mx.int32], [1, 2])
    src, shaped = cubin.render(*args, ["out"], [mx.float16], template, None, {"n": True})
    params = re.search(r'extern "C" __global__ void k\(([^)]*)\)', src).group(1)
    names = [p.split()[-1].lstrip("*") for p in params.split(",")]
    assert names == ["a", "b", "out", "b_shape_0", "b_shape_1", "n"] and shaped == [1]
    assert "int n" in params and "constexpr int n" not in src
    src, _ = cubin.render(*args, ["out"], [mx.float16], template, None, {"n": False})
    params = re.search(r'extern "C" __global__ void k\(([^)]*)\)', src).group(1)
    assert "n" not in [p.split()[-1] for p in params.split(",")]
    assert "  constexpr int n = 0;" in src


def test_render_of_the_block_read_passes_the_slots_shape():
    header, body = source.block_read_source("cuda")
    src, shaped = cubin.render(
        "r",
        header,
        body,
        ["keys", "values", "slots"],
        [mx.bfloat16, mx.bfloat16, mx.int32],
        [4, 4, 2],
        ["k_out", "v_out"],
        [mx.bfloat16, mx.bfloat16],
        [("HK", 8), ("U", 4)],
    )
    assert shaped == [2]
    assert "const __nv_bfloat16* keys" in src and "int slots_shape_1" in src


def test_cubins_are_compiled_once_then_read_from_disk(kernel_cache, monkeypatch):
    folder, calls, compile_fn = kernel_cache
    data = cubin.cubin("source A", "ka", compile_fn)
    assert data == b"cubin of ka for --gpu-architecture=sm_90"
    assert [c[0] for c in calls] == ["ka"] and "--std=c++17" in calls[0][1]
    (path,) = folder.glob("ka-*.cubin")
    assert path.read_bytes() == data
    assert cubin.cubin("source A", "ka", compile_fn) == data and len(calls) == 1  # memo
    monkeypatch.setattr(cubin, "_cubins", {})  # a new process
    assert cubin.cubin("source A", "ka", compile_fn) == data and len(calls) == 1  # disk
    # Another source, architecture or NVRTC version is another file.
    cubin.cubin("source B", "ka", compile_fn)
    monkeypatch.setattr(cubin, "architecture", lambda: "sm_80")
    cubin.cubin("source A", "ka", compile_fn)
    monkeypatch.setattr(cubin, "_nvrtc_version", lambda: "12.9")
    cubin.cubin("source A", "ka", compile_fn)
    assert len(calls) == 4 and len(list(folder.glob("ka-*.cubin"))) == 4
    assert not [p for p in folder.iterdir() if not p.name.endswith(".cubin")]  # no temp files


def test_an_unwritable_cache_keeps_cubins_for_the_process(kernel_cache, monkeypatch):
    folder, calls, compile_fn = kernel_cache
    blocked = folder / "file"
    blocked.write_text("not a folder")
    monkeypatch.setenv("MLX_PAGED_KERNEL_CACHE", str(blocked / "sub"))
    assert cubin.cubin("source", "k", compile_fn) == b"cubin of k for --gpu-architecture=sm_90"
    assert cubin.cubin("source", "k", compile_fn) and len(calls) == 1


def test_the_cache_folder_and_off(monkeypatch, tmp_path):
    monkeypatch.setenv("MLX_PAGED_KERNEL_CACHE", "off")
    assert cubin.cache_dir() is None and not cubin.available()
    monkeypatch.delenv("MLX_PAGED_KERNEL_CACHE")
    monkeypatch.setenv("MLX_PAGED_CACHE", str(tmp_path))
    assert cubin.cache_dir() == tmp_path / "cuda-kernels"


# ---- on a GPU ------------------------------------------------------------------------


@cuda_only
def test_kernels_from_the_disk_cache_match_the_reference(tmp_path, monkeypatch):
    """A fresh process's kernels (no memo, no MLX module) are read from the cache folder,
    compiled by nobody, and still match the reference and ``mx.take``."""
    monkeypatch.setenv("MLX_PAGED_KERNEL_CACHE", str(tmp_path))
    assert cubin.available()

    def fresh_process():  # forget every compiled kernel this process holds
        monkeypatch.setattr(cubin, "_cubins", {})
        monkeypatch.setattr(cuda, "_kernel_obj", [])
        monkeypatch.setattr(cuda, "_launches", cuda.LaunchCache())
        monkeypatch.setattr(read, "_kernels", {})

    fresh_process()
    batch = random_paged_batch([300, 17], n_heads=8, n_kv_heads=2, dk=64, dv=64, block_size=16)
    want = reference_paged_decode(batch.queries, batch.view, 0.125, None)
    got = paged_decode_cuda(batch.queries, batch.view, 0.125, None, num_splits=2)
    assert mx.allclose(got, want, atol=2e-3).item()
    slots = mx.array([[5, 3, 40, 41]], dtype=mx.int32)
    want_kv = take_blocks(batch.view.keys, batch.view.values, slots)
    got_kv = read_blocks("cuda", batch.view.keys, batch.view.values, slots)
    assert all(mx.array_equal(g, w).item() for g, w in zip(got_kv, want_kv, strict=True))
    assert len(list(tmp_path.glob("*.cubin"))) == 2  # the decode template set and the read

    def no_compile(*args):
        raise AssertionError("compiled again instead of reading the cache")

    monkeypatch.setattr(cubin, "nvrtc_compile", no_compile)
    fresh_process()
    got = paged_decode_cuda(batch.queries, batch.view, 0.125, None, num_splits=2)
    assert mx.allclose(got, want, atol=2e-3).item()
    got_kv = read_blocks("cuda", batch.view.keys, batch.view.values, slots)
    assert all(mx.array_equal(g, w).item() for g, w in zip(got_kv, want_kv, strict=True))


def test_inputs_a_template_set_does_not_read_are_left_out_of_the_signature():
    dtypes = [*DECODE_DTYPES[:6]] + [None] * 6
    src, shaped = cubin.render(
        "k",
        cuda.HEADER,
        cuda.DECODE_SOURCE,
        cuda._INPUTS,
        dtypes,
        DECODE_NDIMS,
        cuda._OUTPUTS,
        OUTPUT_DTYPES,
        [("T", mx.float16)],
        {n: cubin.CTYPES.get(t, t) for n, t in cuda._ABSENT.items()},
    )
    params = re.search(r'extern "C" __global__ void k\(([^)]*)\)', src).group(1)
    assert "sinks" not in params and "counters" not in params and "cold" not in params
    assert "new_" not in params and "rope_freqs" not in params
    assert shaped == [3]
    for line in [
        "const float* sinks = nullptr;",
        "const int* counters = nullptr;",
        "const unsigned int* cold = nullptr;",
        "const T* new_keys = nullptr;",
        "const float* rope_freqs = nullptr;",
    ]:
        assert line in src
    assert src.index("using T = __half;") < src.index("const T* new_keys = nullptr;")


def test_a_call_launches_the_cached_cubin_with_only_the_inputs_it_reads(
    kernel_cache, monkeypatch, launched
):
    """``CudaKernel.__call__`` without a GPU: MLX's launch replaced by a recorder."""
    folder, calls, compile_fn = kernel_cache
    monkeypatch.setattr(cubin, "available", lambda: True)
    monkeypatch.setattr(cubin, "nvrtc_compile", compile_fn)
    kernel = cubin.CudaKernel(
        "k", ["a", "b", "opt"], ["out"], "out[0] = a[b_shape[1]];", "", {"opt": "T"}
    )
    a, b = mx.zeros((4,), dtype=mx.float16), mx.zeros((2, 3), dtype=mx.int32)
    for _ in range(2):
        kernel(
            inputs=[a, b, None],
            template=[("T", mx.float16), ("X", 2)],
            grid=(32, 1, 1),
            threadgroup=(32, 1, 1),
            output_shapes=[(1,)],
            output_dtypes=[mx.float16],
        )
    kernel(
        inputs=[a, b, a],
        template=[("T", mx.float16), ("X", 2)],
        grid=(32, 1, 1),
        threadgroup=(32, 1, 1),
        output_shapes=[(1,)],
        output_dtypes=[mx.float16],
    )
    assert len(calls) == 2  # two template sets (without and with ``opt``), each compiled once
    first, again, other = launched
    assert [id(x) for x in first["inputs"]] == [id(a), id(b)]
    assert [id(x) for x in other["inputs"]] == [id(a), id(b), id(a)]
    assert first["scalars"] == [2, 3] and first["name"] == again["name"] != other["name"]
    assert (
        first["compiled_source"]
        == f"cubin of {first['name']} for --gpu-architecture=sm_90".encode()
    )
    assert first["ensure_row_contiguous"] and first["grid"] == first["threadgroup"] == (32, 1, 1)
    assert first["output_shapes"] == [(1,)] and first["output_dtypes"] == [mx.float16]


def test_a_launchs_scalars_follow_its_shapes_and_share_one_binary(
    kernel_cache, monkeypatch, launched
):
    """A scalar's value is an argument of the launch, not part of the binary: launches
    with different values share one build; one that passes none is another build, which
    reads the scalar as 0."""
    folder, calls, compile_fn = kernel_cache
    monkeypatch.setattr(cubin, "available", lambda: True)
    monkeypatch.setattr(cubin, "nvrtc_compile", compile_fn)
    kernel = cubin.CudaKernel("k", ["a"], ["out"], "out[0] = a[a_shape[0] - 1 + n];", "", {}, ["n"])
    a = mx.zeros((4,), dtype=mx.float16)
    call = dict(
        inputs=[a],
        template=[("T", mx.float16)],
        grid=(32, 1, 1),
        threadgroup=(32, 1, 1),
        output_shapes=[(1,)],
        output_dtypes=[mx.float16],
    )
    for n in (5, 9):
        kernel(**call, scalars={"n": n})
    kernel(**call)
    assert len(calls) == 2
    five, nine, none = launched
    assert five["scalars"] == [4, 5] and nine["scalars"] == [4, 9] and none["scalars"] == [4]
    assert five["name"] == nine["name"] != none["name"]


def test_an_empty_cache_file_is_compiled_again(kernel_cache):
    folder, calls, compile_fn = kernel_cache
    data = cubin.cubin("source", "k", compile_fn)
    (path,) = folder.glob("k-*.cubin")
    path.write_bytes(b"")  # a file left empty (by a full disk, say)
    cubin._cubins.clear()
    assert cubin.cubin("source", "k", compile_fn) == data and len(calls) == 2
    assert path.read_bytes() == data


def test_a_failed_build_hands_the_kernel_to_mlx(kernel_cache, monkeypatch):
    """Where our NVRTC build fails, the body goes to ``mx.fast.cuda_kernel``, placeholders
    standing in for the inputs left out, and stays there."""
    monkeypatch.setattr(cubin, "available", lambda: True)

    def broken(*args):
        raise RuntimeError("NVRTC could not compile k: error")

    monkeypatch.setattr(cubin, "nvrtc_compile", broken)
    made, launched = [], []

    def cuda_kernel(name, input_names, output_names, source, header=""):
        made.append(name)

        def run(**kw):
            launched.append(kw)
            return [
                mx.zeros(s, dtype=d)
                for s, d in zip(kw["output_shapes"], kw["output_dtypes"], strict=True)
            ]

        return run

    monkeypatch.setattr(mx.fast, "cuda_kernel", cuda_kernel)
    kernel = cubin.CudaKernel("k", ["a", "opt"], ["out"], "out[0] = a[0];", "", {"opt": "T"})
    a = mx.zeros((4,), dtype=mx.float16)
    call = dict(
        template=[("T", mx.float16)],
        grid=(32, 1, 1),
        threadgroup=(32, 1, 1),
        output_shapes=[(1,)],
        output_dtypes=[mx.float16],
    )
    kernel(inputs=[a, None], **call)
    kernel(inputs=[a, None], **call)
    assert made == ["k"] and len(launched) == 2
    # Under mx.fast.cuda_kernel a scalar is a template constant, 0 where not passed.
    scalar = cubin.CudaKernel("s", ["a"], ["out"], "out[0] = a[n];", "", {}, ["n"])
    scalar(inputs=[a], **call, scalars={"n": 3})
    scalar(inputs=[a], **call)
    assert [kw["template"][-1] for kw in launched[2:]] == [("n", 3), ("n", 0)]
    opt = launched[0]["inputs"][1]
    assert opt.shape == (1,) and opt.dtype == mx.float16  # the placeholder, in T
