"""Batched decode and suffix prefill: the paged cache against mlx-lm's dense caches.

Decode: B sequences with contexts spread over ``--contexts LO HI``, one token each
per step, the paged cache run the way ``PagedEngine`` runs it (block tables,
per-sequence lengths, the fused kernel where it runs) against mlx-lm's
``BatchKVCache`` (left-padded, as ``BatchGenerator`` holds it).

Prefill: one sequence holding ``--prefix`` tokens takes a ``--suffix``-token
chunk: mlx-lm's ``KVCache`` against the paged cache, which reads its blocks into
contiguous K/V for MLX's SDPA (the path for queries > 1) with the device's
block-read kernel (``paged``) or with portable MLX ops (``paged-portable``). The
cases take turns for ``--repeats`` rounds; each keeps its best time, and the
host time to build the step's graph is shown beside it.

Usage:
    python benchmarks/batch_decode.py --dtype float16                 # on a GPU
    python benchmarks/batch_decode.py --layers 2 --batch 4 --contexts 64 256 --prefix 256
"""

from __future__ import annotations

import argparse
import time

import mlx.core as mx
from decode import llama_1b
from mlx_lm.models.cache import BatchKVCache, KVCache

from mlx_paged import make_paged_cache
from mlx_paged.attention import path_counts, read_counts, set_attention_path
from mlx_paged.cache import DecodeBatch, PagedLayout, StepPagedKVCache
from mlx_paged.storage import KVPool

KV_HEADS, HEAD_DIM = 8, 64


def random_kv(n: int, dtype: mx.Dtype) -> tuple[mx.array, mx.array]:
    shape = (1, KV_HEADS, n, HEAD_DIM)
    return mx.random.normal(shape).astype(dtype), mx.random.normal(shape).astype(dtype)


def dense_batch(model, lengths: list[int], dtype: mx.Dtype) -> list[BatchKVCache]:
    caches = []
    for _ in model.layers:
        per_seq = []
        for n in lengths:
            c = KVCache()
            c.update_and_fetch(*random_kv(n, dtype))
            per_seq.append(c)
        caches.append(BatchKVCache.merge(per_seq))
        mx.eval(caches[-1].keys, caches[-1].values)
    return caches


def paged_batch(model, lengths: list[int], dtype: mx.Dtype, block_size: int):
    layout = PagedLayout.of(model)
    pools = {kind: KVPool(n, block_size) for kind, n in layout.counts.items()}
    (kind,) = pools  # a llama has one (full-attention) group
    pool = pools[kind]
    tables = [pool.new_table() for _ in lengths]
    for layer in range(pool.num_layers):
        for t, n in zip(tables, lengths, strict=True):
            pool.write_prefill(t, layer, *random_kv(n, dtype))
        mx.eval(pool.keys[layer], pool.values[layer])
    return layout, pools, kind, tables


def time_steps(step, steps: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        step()
    tic = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - tic) / steps


def decode(model, args, dtype) -> None:
    lo, hi = args.contexts
    lengths = [lo + (hi - lo) * i // max(1, args.batch - 1) for i in range(args.batch)]
    y = mx.zeros((args.batch, 1), dtype=mx.int32)

    dense = dense_batch(model, lengths, dtype)

    def dense_step():
        logits = model(y, cache=dense)[:, -1, :]
        mx.eval(mx.argmax(logits, axis=-1))

    t_dense = time_steps(dense_step, args.steps)

    layout, pools, kind, tables = paged_batch(model, lengths, dtype, args.block_size)
    pool = pools[kind]

    def paged_step():
        for t in tables:
            pool.reserve(t, t.lengths[0], t.lengths[0] + 1)
        batch = DecodeBatch(pool, tables, None)
        caches = layout.bind(pools, {kind: batch}, StepPagedKVCache)
        logits = model(y, cache=caches)[:, -1, :]
        mx.eval(mx.argmax(logits, axis=-1))
        batch.finish()

    t_paged = time_steps(paged_step, args.steps)
    b = args.batch
    print(
        f"decode B={b} contexts {lo}-{hi}: dense BatchKVCache {b / t_dense:8.1f} tok/s "
        f"({t_dense * 1e3:.2f} ms/step)  paged {b / t_paged:8.1f} tok/s "
        f"({t_paged * 1e3:.2f} ms/step)  paged/dense speed {t_dense / t_paged:.3f}",
        flush=True,
    )


def prefill(model, args, dtype) -> None:
    suffix = mx.random.randint(0, 1000, (1, args.suffix))

    def filled(cache: list) -> list:
        for c in cache:
            c.update_and_fetch(*random_kv(args.prefix, dtype))
        mx.eval([c.state for c in cache])
        return cache

    cases = {
        "dense": ("auto", filled([KVCache() for _ in model.layers])),
        "paged": ("auto", filled(make_paged_cache(model, args.block_size))),
        "paged-portable": ("gather", filled(make_paged_cache(model, args.block_size))),
    }
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in cases}
    for r in range(args.repeats + 1):  # cases take turns; round 0 warms up
        for name, (path, cache) in cases.items():
            set_attention_path(path)
            mx.synchronize()
            tic = time.perf_counter()
            out = model(suffix, cache=cache)
            built = time.perf_counter()
            mx.eval(out, [c.state for c in cache])
            mx.synchronize()
            done = time.perf_counter()
            for c in cache:
                c.trim(args.suffix)
            if r:
                times[name].append((built - tic, done - tic))
    set_attention_path("auto")
    best = {name: (min(b for b, _ in t), min(d for _, d in t)) for name, t in times.items()}
    dense = best["dense"][1]
    for name, (build, total) in best.items():
        print(
            f"prefill {args.suffix} tokens after {args.prefix}: {name:14s} "
            f"{total * 1e3:8.2f} ms (build {build * 1e3:.2f} ms)  "
            f"/dense time {total / dense:.3f}",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--contexts", type=int, nargs=2, default=[1024, 4096])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--prefix", type=int, default=4096)
    parser.add_argument("--suffix", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    dtype = getattr(mx, args.dtype)
    model = llama_1b(dtype, args.layers)
    print(f"device={mx.default_device()} dtype={args.dtype} layers={args.layers}", flush=True)
    decode(model, args, dtype)
    prefill(model, args, dtype)
    print(f"attention calls by path: {dict(path_counts)}")
    print(f"prefill block reads by reader: {dict(read_counts)}")


if __name__ == "__main__":
    main()
