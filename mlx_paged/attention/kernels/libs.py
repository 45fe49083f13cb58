"""The CUDA libraries the kernels call through ctypes, found without a toolkit on the path.

A library is taken from where this process already mapped it (MLX loads NVRTC), else
from the system loader's search, else from beside a CUDA library MLX mapped (pip's
``nvidia/<package>/lib`` folders are siblings) or from ``$CUDA_HOME/lib64``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from functools import cache
from pathlib import Path


def loaded_library(stem: str) -> str | None:
    """Path of a shared library this process already mapped (MLX's own NVRTC), if any."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.rsplit(" ", 1)[-1].strip()
                if os.path.basename(path).startswith(stem):
                    return path
    except OSError:
        pass
    return None


def _nearby(stem: str) -> list[str]:
    """Files named ``stem*`` beside the CUDA libraries this process mapped, or in the toolkit."""
    folders = []
    nvrtc = loaded_library("libnvrtc.so")
    if nvrtc:
        lib = Path(nvrtc).parent
        folders += [lib, *sorted(lib.parent.parent.glob("*/lib"))]
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            folders.append(Path(os.environ[var]) / "lib64")
    folders.append(Path("/usr/local/cuda/lib64"))
    return [str(p) for folder in folders for p in sorted(folder.glob(f"{stem}*"))]


def open_library(stem: str, name: str) -> ctypes.CDLL | None:
    """The library ``lib<name>.so`` (``stem`` is its file name's start), or ``None``."""
    found = [loaded_library(stem), ctypes.util.find_library(name), *_nearby(stem)]
    for path in found:
        if path:
            try:
                return ctypes.CDLL(path)
            except OSError:
                continue
    return None


@cache
def driver() -> ctypes.CDLL | None:
    """The CUDA driver library, or ``None`` where there is none."""
    return open_library("libcuda.so", "cuda")
