"""Host time to build one decode-attention call, by how the call is made (GPU only).

One llama-1B-shaped decode query (32 heads, 8 KV heads, head_dim 64, float16)
over ``--context`` tokens in 16-token blocks. For each way of making the call,
``--calls`` calls are built (no evaluation inside the clock), in groups of 100
evaluated between groups, and the median microseconds per call are printed:

- ``sdpa``: ``mx.fast.scaled_dot_product_attention`` on contiguous K/V (dense's call);
- ``compiled launch``: the paged decode kernel as layers call it (``decode_launch``:
  an ``mx.compile``'d function that replays the recorded kernel);
- ``precompiled, direct``: the same kernel through ``mx.fast.precompiled_cuda_kernel``
  without ``mx.compile`` (the cubin's bytes go through each call);
- ``compiled x + 1``: an ``mx.compile``'d function of six arrays with one op, the floor
  of a compiled replay.

Usage: ``python benchmarks/launch_cost.py [--context 1024] [--calls 2000]``
"""

from __future__ import annotations

import argparse
import statistics
import time

import mlx.core as mx

from mlx_paged.attention.kernels import cuda
from mlx_paged.attention.kernels.synthetic import random_paged_batch


def per_call_us(make_call, calls: int) -> float:
    """Median microseconds to build one call, over groups of 100 (each group evaluated after)."""
    times = []
    for _ in range(calls // 100):
        outs = []
        tic = time.perf_counter()
        for _ in range(100):
            outs.append(make_call())
        times.append((time.perf_counter() - tic) / 100)
        mx.eval(outs)
    return statistics.median(times[1:]) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--calls", type=int, default=2000)
    args = ap.parse_args()
    if not (mx.cuda.is_available() and mx.default_device() == mx.gpu):
        raise SystemExit("launch_cost.py needs MLX's CUDA backend on a GPU.")
    b = random_paged_batch([args.context], 32, 8, 64, 64, 16, mx.float16)
    q, view, scale = b.queries, b.view, 0.125
    k, v = b.dense_keys[0], b.dense_values[0]
    six = [mx.zeros((1,)) for _ in range(6)]
    plus_one = mx.compile(lambda a, *rest: a + 1)

    def uncompiled_launch(num_splits: int):
        """A launch made without ``mx.compile`` (``num_splits`` keeps it out of the cache)."""
        compiled = cuda.compiled_launch
        cuda.compiled_launch = lambda f: f
        try:
            return cuda.decode_launch(q, view, scale, None, num_splits)
        finally:
            cuda.compiled_launch = compiled

    splits = cuda.cuda_plan(q, view).num_splits
    launch = cuda.decode_launch(q, view, scale, None)  # splits chosen: the same number
    direct = uncompiled_launch(splits)
    cases = {
        "sdpa": lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=scale),
        "compiled launch": lambda: launch(q, view, None),
        "precompiled, direct": lambda: direct(q, view, None),
        "compiled x + 1": lambda: plus_one(*six),
    }
    mx.eval([f() for f in cases.values()])  # compile and trace outside the clock
    print(f"device={mx.default_device()} context={args.context} splits={splits}")
    for _ in range(2):  # two rounds, taking turns
        for name, f in cases.items():
            print(f"{name:22s} {per_call_us(f, args.calls):7.2f} us per call", flush=True)


if __name__ == "__main__":
    main()
