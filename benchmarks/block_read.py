"""Prefill block reads on the GPU: the block-read kernel against ``mx.take``.

For each (tokens T, KV heads H, head_dim D), float16, block_size 16, blocks in
shuffled order: the time to copy one layer's K and V for T tokens from the pool
into contiguous ``(1, H, T, D)`` arrays, as a prefill step does before SDPA.
Each timing evaluates ``--chain`` reads as one graph and keeps the best of
``--rounds`` (the paths take turns); an elementwise add that each read depends on
is timed alone and subtracted.

Run: ``python benchmarks/block_read.py`` on a machine with a CUDA (or Metal) GPU.
"""

from __future__ import annotations

import argparse
import time

import mlx.core as mx

from mlx_paged.attention.kernels.dispatch import backend_available
from mlx_paged.attention.kernels.read import read_blocks
from mlx_paged.storage import take_blocks

CASES = [(2048, 8, 128), (4608, 8, 64), (16384, 8, 128), (18432, 8, 64)]


def best_ms(make, chain: int, rounds: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        outs = make()
        mx.synchronize()
        tic = time.perf_counter()
        mx.eval(outs)
        mx.synchronize()
        best = min(best, time.perf_counter() - tic)
    return best / chain * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chain", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    backend = next((b for b in ("cuda", "metal") if backend_available(b)), None)
    if backend is None:
        raise SystemExit("needs a CUDA or Metal GPU")
    print(f"device={mx.default_device()} backend={backend} float16 block_size=16", flush=True)
    for T, H, D in CASES:
        t_take, t_kernel = time_case(backend, T, H, D, args.chain, args.rounds)
        gb = 2 * T * H * D * 2 / 1e9  # K and V bytes read (and written)
        print(
            f"T={T:6d} H={H} D={D:3d}: mx.take {t_take:.4f} ms  kernel {t_kernel:.4f} ms  "
            f"take/kernel {t_take / t_kernel:.2f}  kernel reads {gb / t_kernel:.2f} TB/s",
            flush=True,
        )


def time_case(backend: str, T: int, H: int, D: int, chain: int, rounds: int):
    """(mx.take ms, kernel ms) per read of T tokens, the dependent add subtracted."""
    nb = T // 16 + 64
    keys = mx.random.normal((nb, 16, H, D)).astype(mx.float16)
    values = mx.random.normal((nb, 16, H, D)).astype(mx.float16)
    blocks = mx.random.permutation(nb)[: -(-T // 16)].astype(mx.int32)
    slots = (blocks[:, None] * 16 + mx.arange(16, dtype=mx.int32)).reshape(1, -1)[:, :T]
    mx.eval(keys, values, slots)

    def take(i):
        return take_blocks(keys + i, values, slots)

    def kernel(i):
        return read_blocks(backend, keys + i, values, slots)

    def chained(read):
        return lambda: [read(i) for i in range(chain)]

    base = best_ms(chained(lambda i: keys + i), chain, rounds)
    t_take = t_kernel = float("inf")
    for _ in range(2):  # the paths take turns
        t_take = min(t_take, best_ms(chained(take), chain, rounds) - base)
        t_kernel = min(t_kernel, best_ms(chained(kernel), chain, rounds) - base)
    return t_take, t_kernel


if __name__ == "__main__":
    main()
