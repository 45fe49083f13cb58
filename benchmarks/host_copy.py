"""Ways to get host bytes (a disk-tier read) into MLX, and their GB/s on this backend.

Each case moves ``--mb`` megabytes, ``--chunks`` times, from a numpy buffer into
an array a GPU op then reads (a sum, evaluated), as the disk tier's load does:

- ``mx.array``: ``mx.array(numpy)`` per chunk (what the disk tier does);
- ``mx.array, one buffer``: the same, with the numpy buffer reused;
- ``into MLX memory``: one host-made MLX array, written in place through the
  buffer protocol (numpy's ``copyto``) before each use;
- ``whole``: one ``mx.array`` of every chunk at once;
- ``pinned``: the disk tier's staging buffers (``storage/pinned.py``), pinned
  with the CUDA driver and read by a kernel (CUDA only).

Usage:
    python benchmarks/host_copy.py --mb 32 --chunks 32
"""

from __future__ import annotations

import argparse
import time

import mlx.core as mx
import numpy as np

from mlx_paged.storage.pinned import Staging


def timed(label: str, total: int, fn) -> None:
    fn()  # first use outside the clock
    mx.synchronize()
    start = time.perf_counter()
    fn()
    mx.synchronize()
    seconds = time.perf_counter() - start
    print(f"{label}: {seconds:.3f} s, {total / 1e9 / seconds:.2f} GB/s", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mb", type=int, default=32)
    ap.add_argument("--chunks", type=int, default=32)
    args = ap.parse_args()
    size = args.mb << 20
    rng = np.random.default_rng(0)
    sources = [rng.integers(0, 255, size, dtype=np.uint8) for _ in range(args.chunks)]
    total = size * args.chunks
    print(f"{mx.default_device()}: {args.chunks} chunks of {args.mb} MB", flush=True)

    def per_chunk() -> None:
        for src in sources:
            mx.eval(mx.sum(mx.array(src).view(mx.uint32)))

    def reused() -> None:
        buf = np.empty(size, dtype=np.uint8)
        for src in sources:
            np.copyto(buf, src)
            mx.eval(mx.sum(mx.array(buf).view(mx.uint32)))

    staging = mx.array(np.zeros(size, dtype=np.uint8))
    mx.eval(staging)
    view = np.asarray(memoryview(staging))
    shared = view.ctypes.data == np.asarray(memoryview(staging)).ctypes.data

    def in_place() -> None:
        for src in sources:
            np.copyto(view, src)
            mx.eval(mx.sum(staging.view(mx.uint32)))

    def whole() -> None:
        mx.eval(mx.sum(mx.array(np.stack(sources)).view(mx.uint32)))

    timed("mx.array", total, per_chunk)
    timed("mx.array, one buffer", total, reused)
    np.copyto(view, sources[-1])
    agrees = int(mx.sum(staging.view(mx.uint32)).item()) == int(
        np.sum(sources[-1].view(np.uint32), dtype=np.uint32)
    )
    print(f"into MLX memory: writes seen by MLX ops: {agrees}, same buffer twice: {shared}")
    if agrees:
        timed("into MLX memory", total, in_place)
    timed("whole", total, whole)

    staging = Staging()
    mx.eval(staging.to_mlx(staging.buffer(0, 1, size)))  # pins and checks once, unclocked
    print(f"pinned staging buffers: {staging.pinned}", flush=True)

    def pinned() -> None:
        for i, src in enumerate(sources):
            buf = staging.buffer(i, 1, size)
            np.copyto(buf[0], src)
            mx.eval(mx.sum(staging.to_mlx(buf).view(mx.uint32)))

    if staging.pinned:
        buf = staging.buffer(0, 1, size)
        np.copyto(buf[0], sources[0])
        same = np.array_equal(np.array(staging.to_mlx(buf))[0], sources[0])
        print(f"pinned copy equals the host bytes: {same}", flush=True)
        timed("pinned, read by a kernel", total, pinned)


if __name__ == "__main__":
    main()
