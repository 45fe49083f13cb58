"""Kernel images that cost the host less per launch: a cubin inside a compressed fatbin.

MLX finds a precompiled kernel's module by a hash of its whole image, and computes that
hash at every launch. On the H200's host that is about 0.23 us a KiB: 18 us for each
launch of a 77 KiB decode cubin and 31 us for a 134 KiB cold-tier one, 16 launches a
decode step (BENCHMARKS.md, runs 436-437). nvFatbin's compressed fatbin of the same cubin
is a quarter to a fifth of its size, and the driver loads it as it loads the cubin.

``pack`` makes one where libnvfatbin (CUDA 12.4 or later) is found, and uses it only
once the driver has loaded it and found the kernel in it; elsewhere, where that fails,
or with ``MLX_PAGED_KERNEL_COMPRESS=off``, kernels launch from their cubins as before.
"""

from __future__ import annotations

import ctypes
import logging
import os
from functools import cache

from .libs import driver, open_library

logger = logging.getLogger("mlx_paged.kernels")

# Tried in order: the smallest images first, then the compression older drivers read.
OPTIONS = (("-64", "-compress-all", "-compress-mode=size"), ("-64", "-compress-all"))


@cache
def _nvfatbin() -> ctypes.CDLL | None:
    lib = open_library("libnvfatbin.so", "nvfatbin")
    if lib is None or not hasattr(lib, "nvFatbinAddCubin"):
        return None
    lib.nvFatbinGetErrorString.restype = ctypes.c_char_p
    return lib


def enabled() -> bool:
    """Whether kernels are packed here: libnvfatbin found and the setting not ``off``."""
    return os.environ.get("MLX_PAGED_KERNEL_COMPRESS") != "off" and _nvfatbin() is not None


@cache
def version() -> str:
    """nvFatbin's version, such as ``"13.0"`` (images are kept per version)."""
    major, minor = ctypes.c_uint(), ctypes.c_uint()
    _nvfatbin().nvFatbinVersion(ctypes.byref(major), ctypes.byref(minor))
    return f"{major.value}.{minor.value}"


def _check(lib: ctypes.CDLL, result: int, what: str) -> None:
    if result:
        raise RuntimeError(f"{what} failed: {lib.nvFatbinGetErrorString(result).decode()}")


def fatbin(cubin: bytes, arch: str, options: tuple[str, ...]) -> bytes:
    """A fatbin holding ``cubin`` (built for ``arch``, such as ``"sm_90"``), made with
    nvFatbin's ``options``; ``RuntimeError`` where nvFatbin refuses them."""
    lib, handle = _nvfatbin(), ctypes.c_void_p()
    opts = (ctypes.c_char_p * len(options))(*(o.encode() for o in options))
    _check(lib, lib.nvFatbinCreate(ctypes.byref(handle), opts, len(options)), "nvFatbinCreate")
    try:
        sm = arch.removeprefix("sm_").encode()
        size = ctypes.c_size_t(len(cubin))
        _check(lib, lib.nvFatbinAddCubin(handle, cubin, size, sm, b"kernel"), "nvFatbinAddCubin")
        _check(lib, lib.nvFatbinSize(handle, ctypes.byref(size)), "nvFatbinSize")
        out = ctypes.create_string_buffer(size.value)
        _check(lib, lib.nvFatbinGet(handle, out), "nvFatbinGet")
        return out.raw
    finally:
        lib.nvFatbinDestroy(ctypes.byref(handle))


def _entry(lib: ctypes.CDLL, name: str):
    return getattr(lib, f"{name}_v2", None) or getattr(lib, name)


def loads(image: bytes, kernel: str) -> bool:
    """Whether the CUDA driver loads ``image`` on GPU 0 and finds ``kernel`` in it."""
    drv = driver()
    if drv is None:
        return False
    dev, ctx, module, fn = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
    if drv.cuInit(0) or drv.cuDeviceGet(ctypes.byref(dev), 0):
        return False
    if drv.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev):
        return False
    try:
        if _entry(drv, "cuCtxPushCurrent")(ctx):
            return False
        try:
            if drv.cuModuleLoadData(ctypes.byref(module), image):
                return False
            found = not drv.cuModuleGetFunction(ctypes.byref(fn), module, kernel.encode())
            drv.cuModuleUnload(module)
            return found
        finally:
            _entry(drv, "cuCtxPopCurrent")(ctypes.byref(ctypes.c_void_p()))
    finally:
        _entry(drv, "cuDevicePrimaryCtxRelease")(dev)


def pack(cubin: bytes, arch: str, kernel: str) -> bytes | None:
    """The smallest packed image of ``cubin`` that loads here and holds ``kernel``, or
    ``None`` (launch the cubin itself)."""
    for options in OPTIONS:
        try:
            image = fatbin(cubin, arch, options)
            if len(image) < len(cubin) and loads(image, kernel):
                return image
        except (RuntimeError, OSError, AttributeError) as e:  # a refusal or an old library
            logger.info("mlx_paged: nvFatbin %s: %s", " ".join(options), e)
    return None
