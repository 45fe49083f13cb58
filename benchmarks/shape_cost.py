"""What the first call of a new shape costs, op by op, against the same call repeated.

For each op, a few shapes this process has not run yet: the first call (synchronized)
and the best of three repeats, in milliseconds. The ops are the pieces of a paged
prefill forward: a projection matmul, attention in plain ops (``prefill.attention_by_ops``),
the block read (the device kernel, then the portable gather), and with ``--model`` a whole
paged prefill forward of a suffix over a cached prefix.

Usage:
    python benchmarks/shape_cost.py --model /root/l1b      # on the GPU
    python benchmarks/shape_cost.py --dtype float32 --sizes 8 16   # CPU smoke run
"""

from __future__ import annotations

import argparse
import time

import mlx.core as mx

from mlx_paged.attention import fused_read
from mlx_paged.attention.prefill import attention_by_ops
from mlx_paged.storage.read import take_blocks


def timed(fn, repeats: int = 3) -> tuple[float, float]:
    """Milliseconds of the first call and the best repeat, each evaluated and synchronized."""
    out = []
    for _ in range(1 + repeats):
        mx.synchronize()
        tic = time.perf_counter()
        mx.eval(fn())
        mx.synchronize()
        out.append(1e3 * (time.perf_counter() - tic))
    return out[0], min(out[1:])


def report(name: str, shape: str, times: tuple[float, float]) -> None:
    print(f"{name:11s} {shape:28s} first {times[0]:8.2f} ms  repeat {times[1]:7.2f} ms", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--sizes", type=int, nargs="+", default=[96, 160, 224], help="rows x 32")
    ap.add_argument("--model", default=None, help="mlx-lm model directory for whole forwards")
    args = ap.parse_args()
    dtype = getattr(mx, args.dtype)
    print(f"device={mx.default_device()} dtype={args.dtype}", flush=True)
    w = mx.random.normal((2048, 2048)).astype(dtype)
    pool_k = mx.random.normal((4096, 16, 8, 64)).astype(dtype)
    pool_v = mx.random.normal((4096, 16, 8, 64)).astype(dtype)
    mx.eval(w, pool_k, pool_v)
    for i, m in enumerate(args.sizes):
        x = mx.random.normal((m * 32 + i, 2048)).astype(dtype)
        report("matmul", f"({x.shape[0]}, 2048) @ W", timed(lambda x=x: x @ w))
    for i, m in enumerate(args.sizes):
        b, n, t = 8, 32 + 32 * (i % 2), 1024 + 16 * (m + i)
        q = mx.random.normal((b, 32, n, 64)).astype(dtype)
        k = mx.random.normal((b, 8, t, 64)).astype(dtype)
        mask = mx.ones((b, 1, n, t), dtype=mx.bool_)
        mx.eval(q, k, mask)
        call = lambda q=q, k=k, mask=mask: attention_by_ops(q, k, k, 0.125, mask)  # noqa: E731
        report("attn_ops", f"B={b} L={n} T={t}", timed(call))
    for i, m in enumerate(args.sizes):
        b, t = 8 + i, 1024 + 16 * (m + i)
        slots = mx.random.randint(0, 4096 * 16, (b, t)).astype(mx.int32)
        mx.eval(slots)
        read = lambda s=slots: fused_read(pool_k, pool_v, s) or (mx.array(0),)  # noqa: E731
        report("block_read", f"B={b} T={t}", timed(read))
        report("take", f"B={b} T={t}", timed(lambda s=slots: take_blocks(pool_k, pool_v, s)))
    if args.model:
        forwards(args)


def forwards(args) -> None:
    from mlx_lm import load

    from mlx_paged import make_paged_cache

    model, _ = load(args.model)
    cache = make_paged_cache(model, 16)
    mx.eval(model(mx.arange(1024)[None] % 1000, cache=cache), [c.state for c in cache])
    for i, m in enumerate(args.sizes):
        n = m // 2 + i
        x = mx.arange(n)[None] % 1000

        def step(x=x, n=n):
            out = model(x, cache=cache)[:, -1]
            mx.eval(out, [c.state for c in cache])
            for c in cache:
                c.trim(n)
            return out

        report("forward", f"1 x {n} over 1024", timed(step))


if __name__ == "__main__":
    main()
