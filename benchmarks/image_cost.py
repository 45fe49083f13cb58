"""Host time of a precompiled CUDA launch against the bytes of its image (GPU only).

MLX names a precompiled kernel's module by a hash of its whole image and computes it at
every launch. A one-line kernel's cubin is padded with ``--pad-kib`` KiB of zeros (the
driver ignores bytes after the ELF's end); for each padding, 16 launches are chained as a
model's layers call them, through ``mx.compile`` (build, then dispatch with
``mx.async_eval``, each chain waited for outside the clock) and directly (build and
dispatch together). Prints the median microseconds per launch.

With ``--cache``, also lists the cubins in the kernel cache with their largest ELF
sections, and the size of each as a packed image (``attention/kernels/fatbin.py``).

Usage: ``python benchmarks/image_cost.py [--pad-kib 0 32 128 256 512 0] [--cache]``
"""

from __future__ import annotations

import argparse
import statistics
import struct
import time

import mlx.core as mx

from mlx_paged.attention.kernels import cubin, fatbin

SOURCE = (
    'extern "C" __global__ void k(const float* x, float* y) '
    "{ int i = threadIdx.x; y[i] = x[i] + 1.0f; }"
)


def sections(elf: bytes) -> list[tuple[str, int]]:
    """An ELF64 file's sections as (name, size), largest first."""
    shoff = struct.unpack_from("<Q", elf, 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", elf, 0x3A)
    headers = [struct.unpack_from("<IIQQQQIIQQ", elf, shoff + i * shentsize) for i in range(shnum)]
    names = headers[shstrndx][4]

    def name(offset: int) -> str:
        start = names + offset
        return elf[start : elf.index(b"\0", start)].decode()

    return sorted(((name(h[0]), h[5]) for h in headers), key=lambda t: -t[1])


def chained_us(launch, x: mx.array, chains: int, layers: int = 16) -> tuple[float, float]:
    """Median microseconds per launch to build a chain of ``layers`` and to dispatch it."""
    build, dispatch = [], []
    for i in range(chains):
        tic = time.perf_counter()
        y = x
        for _ in range(layers):
            y = launch(y)
        built = time.perf_counter()
        mx.async_eval(y)
        done = time.perf_counter()
        mx.eval(y)
        if i >= chains // 15:  # the first chains warm up
            build.append((built - tic) / layers)
            dispatch.append((done - built) / layers)
    return statistics.median(build) * 1e6, statistics.median(dispatch) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pad-kib", type=int, nargs="+", default=[0, 32, 128, 256, 512, 0])
    parser.add_argument("--chains", type=int, default=300)
    parser.add_argument("--cache", action="store_true", help="list the kernel cache's cubins")
    args = parser.parse_args()
    if not cubin.available():
        raise SystemExit("needs a CUDA GPU with NVRTC (and MLX_PAGED_KERNEL_CACHE not off)")
    arch = cubin.architecture()
    if args.cache:
        for path in sorted(cubin.cache_dir().glob("*.cubin"), key=lambda p: p.stat().st_size):
            data = path.read_bytes()
            packed = (
                fatbin.pack(data, arch, path.name.rsplit("-", 1)[0]) if fatbin.enabled() else None
            )
            top = ", ".join(f"{n} {s}" for n, s in sections(data)[:3])
            size = "not packed" if packed is None else f"packed {len(packed) / 1024:.1f} KiB"
            print(f"{len(data) / 1024:8.1f} KiB, {size}: {path.name[:40]} ({top})")
    data = cubin.nvrtc_compile(SOURCE, "k", [f"--gpu-architecture={arch}"])
    print(f"one-line kernel: a {len(data)}-byte cubin")
    x = mx.zeros((32,))
    mx.eval(x)
    for pad in args.pad_kib:
        image = data + b"\0" * (pad * 1024)

        def launch(y, image=image):
            return mx.fast.precompiled_cuda_kernel(
                name="k",
                compiled_source=image,
                inputs=[y],
                scalars=[],
                output_shapes=[(32,)],
                output_dtypes=[mx.float32],
                grid=(32, 1, 1),
                threadgroup=(32, 1, 1),
            )[0]

        build, dispatch = chained_us(mx.compile(launch), x, args.chains)
        direct = sum(chained_us(launch, x, args.chains // 3))
        print(
            f"pad {pad:4d} KiB: compiled build {build:6.2f} us, dispatch {dispatch:6.2f} us a "
            f"launch; direct build and dispatch {direct:6.2f} us",
            flush=True,
        )


if __name__ == "__main__":
    main()
