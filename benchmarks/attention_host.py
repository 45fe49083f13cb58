"""One attention layer's host time a decode step: mlx-lm's cache against the paged one.

Times the graph building of ``--calls`` one-token calls of one layer at a ``--context``
of random K/V (each call evaluated after its timing, so the step's work does not pile
up): ``dense`` is mlx-lm's ``KVCache.update_and_fetch`` and MLX's
``scaled_dot_product_attention``; ``paged`` is ``PagedKVCache.update_and_fetch`` (one
layer of ``make_paged_cache``) and ``paged_attention``, which takes whichever path the
device and head dim give (``path_counts``). Prints the median microseconds a call per
round; ``--profile`` then prints a ``cProfile`` of one more paged round. Each call of
the loop is a new step, so the view's arrays a model's layers share are made at every
call here.

Usage:
    python benchmarks/attention_host.py                          # CPU, float32
    python benchmarks/attention_host.py --dtype float16 --heads 8 --kv-heads 2 \\
        --head-dim 256 --profile                                 # Qwen3.5's layer, on a GPU
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time

import mlx.core as mx
from mlx_lm.models import llama
from mlx_lm.models.cache import KVCache

from mlx_paged import make_paged_cache
from mlx_paged.attention import paged_attention, path_counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    dtype = getattr(mx, args.dtype)
    h, hkv, d = args.heads, args.kv_heads, args.head_dim
    config = dict(model_type="llama", hidden_size=h * d, num_hidden_layers=1, head_dim=d)
    config |= dict(intermediate_size=64, num_attention_heads=h, num_key_value_heads=hkv)
    model = llama.Model(llama.ModelArgs(rms_norm_eps=1e-5, vocab_size=64, **config))
    model.set_dtype(dtype)
    queries = mx.random.normal((1, h, 1, d)).astype(dtype)
    scale = d**-0.5

    def kv(n: int) -> mx.array:
        return mx.random.normal((1, hkv, n, d)).astype(dtype)

    def dense(cache, k, v):
        keys, values = cache.update_and_fetch(k, v)
        return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale)

    def paged(cache, k, v):
        keys, values = cache.update_and_fetch(k, v)
        return paged_attention(queries, keys, values, cache, scale, None)

    def median_us(cache, call, profile: cProfile.Profile | None = None) -> float:
        cache.update_and_fetch(kv(args.context), kv(args.context))
        mx.eval(cache.state)
        warmup = 20
        steps = [(kv(1), kv(1)) for _ in range(warmup + args.calls)]
        mx.eval(steps)
        times = []
        for i, (k, v) in enumerate(steps):
            timed = i >= warmup
            if profile is not None and timed:
                profile.enable()
            tic = time.perf_counter()
            out = call(cache, k, v)
            toc = time.perf_counter()
            if profile is not None and timed:
                profile.disable()
            mx.eval(out)
            if timed:
                times.append(toc - tic)
        return statistics.median(times) * 1e6

    print(f"device={mx.default_device()} dtype={args.dtype} heads={h} ({hkv}) x {d}")
    for _ in range(args.rounds):
        d_us = median_us(KVCache(), dense)
        p_us = median_us(make_paged_cache(model)[0], paged)
        print(f"host us a call: dense {d_us:.1f}  paged {p_us:.1f}  paths {dict(path_counts)}")
    if args.profile:
        profile = cProfile.Profile()
        median_us(make_paged_cache(model)[0], paged, profile)
        pstats.Stats(profile).sort_stats("tottime").print_stats(22)


if __name__ == "__main__":
    main()
