"""Packed kernel images: a cubin in a compressed fatbin where nvFatbin is found and the driver
loads it, the cubin itself elsewhere; on a GPU, packed kernels against their cubins."""

from __future__ import annotations

import mlx.core as mx
import pytest
from test_kernels import cuda_only

from mlx_paged.attention.kernels import cubin, cuda, fatbin, libs
from mlx_paged.attention.kernels.cuda import paged_decode_cuda
from mlx_paged.attention.kernels.reference import reference_paged_decode
from mlx_paged.attention.kernels.synthetic import random_paged_batch


def _launch_one(kernel):
    a, b = mx.zeros((4,), dtype=mx.float16), mx.zeros((2, 3), dtype=mx.int32)
    kernel(
        inputs=[a, b, None],
        template=[("T", mx.float16)],
        grid=(32, 1, 1),
        threadgroup=(32, 1, 1),
        output_shapes=[(1,)],
        output_dtypes=[mx.float16],
    )


@pytest.mark.parametrize("packs", [True, False])
def test_a_call_launches_the_packed_image_kept_beside_the_cubin(
    kernel_cache, monkeypatch, launched, packs
):
    """With nvFatbin found, a template set's cubin is packed once per machine, the image kept
    beside the cubin and launched; each process checks that it loads. Where nothing packs
    or the driver refuses the kept image, the cubin itself is launched."""
    folder, calls, compile_fn = kernel_cache
    monkeypatch.setattr(cubin, "available", lambda: True)
    monkeypatch.setattr(cubin, "nvrtc_compile", compile_fn)
    monkeypatch.setattr(fatbin, "enabled", lambda: True)
    monkeypatch.setattr(fatbin, "version", lambda: "13.0")
    packed, checked, driver_loads = [], [], [True]

    def pack(data, arch, name):
        packed.append((data, arch, name))
        return b"packed " + data if packs else None

    def loads(image, name):
        checked.append((image, name))
        return driver_loads[0]

    monkeypatch.setattr(fatbin, "pack", pack)
    monkeypatch.setattr(fatbin, "loads", loads)

    def new_process():
        monkeypatch.setattr(cubin, "_cubins", {})
        kernel = cubin.CudaKernel("k", ["a", "b", "opt"], ["out"], "x", "", {"opt": "T"})
        for _ in range(2):
            _launch_one(kernel)
        return launched[-1]["compiled_source"]

    first = new_process()
    name = launched[0]["name"]
    data = f"cubin of {name} for --gpu-architecture=sm_90".encode()
    image = b"packed " + data
    assert packed == [(data, "sm_90", name)]  # once for the template set
    assert [kw["compiled_source"] for kw in launched] == [image if packs else data] * 2
    assert [p.read_bytes() for p in folder.glob("*.cubin")] == [data]
    assert [p.read_bytes() for p in folder.glob("*.fatbin")] == ([image] if packs else [])
    assert first == (image if packs else data)
    checked.clear()
    assert new_process() == first and len(calls) == 1  # nothing compiled again
    assert len(packed) == (1 if packs else 2)  # an image is kept, a failure is not
    assert checked == ([(image, name)] if packs else [])  # the kept image checked once
    driver_loads[0] = False  # a driver that refuses the kept image
    assert new_process() == data


def test_pack_takes_the_first_options_whose_smaller_image_loads(monkeypatch):
    made, checked = [], []

    def make(data, arch, options):
        made.append(options)
        if options == fatbin.OPTIONS[0]:
            raise RuntimeError("nvFatbinCreate failed: unrecognized option")
        return b"image of " + arch.encode()

    monkeypatch.setattr(fatbin, "fatbin", make)
    monkeypatch.setattr(fatbin, "loads", lambda image, kernel: checked.append(kernel) or True)
    cubin_data = b"x" * 64
    assert fatbin.pack(cubin_data, "sm_90", "k") == b"image of sm_90"
    assert made == list(fatbin.OPTIONS) and checked == ["k"]

    def old_driver(image, kernel):
        raise AttributeError("cuCtxPushCurrent")

    monkeypatch.setattr(fatbin, "loads", old_driver)  # a driver without an entry point
    assert fatbin.pack(cubin_data, "sm_90", "k") is None
    monkeypatch.setattr(fatbin, "loads", lambda image, kernel: False)  # the driver refuses it
    assert fatbin.pack(cubin_data, "sm_90", "k") is None
    monkeypatch.setattr(fatbin, "loads", lambda image, kernel: True)
    assert fatbin.pack(b"tiny", "sm_90", "k") is None  # no smaller than the cubin


def test_packing_is_on_where_nvfatbin_is_found_unless_turned_off(monkeypatch):
    monkeypatch.setattr(fatbin, "_nvfatbin", lambda: None)
    monkeypatch.delenv("MLX_PAGED_KERNEL_COMPRESS", raising=False)
    assert not fatbin.enabled()
    monkeypatch.setattr(fatbin, "_nvfatbin", lambda: object())
    assert fatbin.enabled()
    monkeypatch.setenv("MLX_PAGED_KERNEL_COMPRESS", "off")
    assert not fatbin.enabled()


@cuda_only
@pytest.mark.parametrize("bits", [None, 8])
def test_packed_kernels_are_smaller_and_match_the_cubins(tmp_path, monkeypatch, bits):
    """On a GPU with nvFatbin: the decode kernel launched from its packed image gives the
    cubin's output bit for bit, and the image is smaller than the cubin kept on disk; a
    later process launches the image kept beside it without packing again."""
    monkeypatch.setenv("MLX_PAGED_KERNEL_CACHE", str(tmp_path))
    if not fatbin.enabled():
        pytest.skip("libnvfatbin not found")
    batch = random_paged_batch(
        [300, 17], n_heads=8, n_kv_heads=2, dk=64, dv=64, block_size=16, kv_bits=bits
    )
    outs = []
    for setting in ("on", "off", "kept"):
        monkeypatch.setenv("MLX_PAGED_KERNEL_COMPRESS", "off" if setting == "off" else "on")
        if setting == "kept":  # what a later process finds: the files alone
            monkeypatch.setattr(cubin, "_cubins", {})
            monkeypatch.setattr(fatbin, "pack", lambda *a: pytest.fail("packed again"))
        monkeypatch.setattr(cuda, "_kernel_obj", [])
        monkeypatch.setattr(cuda, "_launches", cuda.LaunchCache())
        outs.append(paged_decode_cuda(batch.queries, batch.view, 0.125, None, num_splits=2))
        ((name, image, _),) = cuda._kernel()._built.values()
        (path,) = tmp_path.glob(f"{name}-*.cubin")
        if setting == "off":
            assert image == path.read_bytes()
        else:
            assert image[:4] == bytes.fromhex("50ed55ba")  # a fatbin
            assert len(image) < path.stat().st_size / 2
            (kept,) = tmp_path.glob(f"{name}-*.fatbin")
            assert image == kept.read_bytes()
    assert mx.array_equal(outs[0], outs[1]).item()
    assert mx.array_equal(outs[2], outs[1]).item()
    want = reference_paged_decode(batch.queries, batch.view, 0.125, None)
    assert mx.allclose(outs[0], want, atol=2e-3).item()


def test_a_library_is_found_beside_the_cuda_libraries_mlx_mapped(tmp_path, monkeypatch):
    """pip's layout: ``nvidia/<package>/lib`` folders side by side."""
    nvrtc = tmp_path / "nvidia" / "cuda_nvrtc" / "lib" / "libnvrtc.so.12"
    fatbin_lib = tmp_path / "nvidia" / "nvfatbin" / "lib" / "libnvfatbin.so.12"
    for path in (nvrtc, fatbin_lib):
        path.parent.mkdir(parents=True)
        path.write_bytes(b"")
    monkeypatch.setattr(libs, "loaded_library", lambda stem: str(nvrtc))
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    found = libs._nearby("libnvfatbin.so")
    assert found[0] == str(fatbin_lib) and all("libnvfatbin.so" in p for p in found)
