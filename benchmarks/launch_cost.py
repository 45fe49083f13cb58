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

With ``--kv-bits 8|4``, ``compiled launch, cold`` is the same call over a batch whose
blocks lie in a quantized cold tier (two of every three, as ``random_paged_batch``
leaves them), the cold tier's records (one array) a further input. Then, for the two
compiled launches, ``--chains`` chains of 16 calls (a model's layers) are built and dispatched with
``mx.async_eval``, each chain waited for outside the clock, and the median microseconds
per call of each part are printed: where a cold launch's host time goes, beside the
step around it.

Usage: ``python benchmarks/launch_cost.py [--context 1024] [--calls 2000] [--kv-bits 8]``
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


def build_and_dispatch_us(make_call, chains: int, layers: int = 16) -> tuple[float, float]:
    """Median microseconds per call to build a chain of ``layers`` calls and to dispatch
    it (``mx.async_eval``); each chain is waited for outside the clock."""
    build, dispatch = [], []
    for _ in range(chains):
        tic = time.perf_counter()
        outs = [make_call() for _ in range(layers)]
        built = time.perf_counter()
        mx.async_eval(outs)
        done = time.perf_counter()
        mx.synchronize()
        build.append((built - tic) / layers)
        dispatch.append((done - built) / layers)
    return statistics.median(build[1:]) * 1e6, statistics.median(dispatch[1:]) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--kv-bits", type=int, choices=[4, 8], help="also a cold-tier launch")
    ap.add_argument("--chains", type=int, default=200, help="with --kv-bits: chains of 16")
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
    if args.kv_bits:
        c = random_paged_batch([args.context], 32, 8, 64, 64, 16, mx.float16, kv_bits=args.kv_bits)
        cold = cuda.decode_launch(c.queries, c.view, scale, None)
        cases["compiled launch, cold"] = lambda: cold(c.queries, c.view, None)
    mx.eval([f() for f in cases.values()])  # compile and trace outside the clock
    print(f"device={mx.default_device()} context={args.context} splits={splits}")
    for _ in range(2):  # two rounds, taking turns
        for name, f in cases.items():
            print(f"{name:22s} {per_call_us(f, args.calls):7.2f} us per call", flush=True)
        if args.kv_bits:
            for name in ("compiled launch", "compiled launch, cold"):
                built, sent = build_and_dispatch_us(cases[name], args.chains)
                print(f"{name:22s} chained: build {built:6.2f}, dispatch {sent:6.2f} us a call")


if __name__ == "__main__":
    main()
