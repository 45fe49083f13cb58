"""Single-sequence decode speed: make_paged_cache against mlx-lm's default cache.

A llama-1B-shaped random model (hidden 2048, 16 layers, 32 heads, 8 KV heads,
vocab 128256). The context is filled with random K/V written through each
cache's ``update_and_fetch`` (decode speed does not depend on the values), then
decode steps run the way ``mlx_lm.generate_step`` runs them: the next step is
queued with ``async_eval`` before the current token is read.

Usage:
    python benchmarks/decode.py                      # CPU, float32
    python benchmarks/decode.py --dtype float16 --steps 100 --repeats 3   # on a GPU
    python benchmarks/decode.py --contexts 1024 --steps 8 --layers 2   # quick look
"""

from __future__ import annotations

import argparse
import gc
import json
import time

import mlx.core as mx
from mlx_lm.models import llama
from mlx_lm.models.cache import make_prompt_cache

from mlx_paged import make_paged_cache
from mlx_paged.attention import path_counts


def llama_1b(dtype: mx.Dtype, layers: int) -> llama.Model:
    args = llama.ModelArgs(
        model_type="llama",
        hidden_size=2048,
        num_hidden_layers=layers,
        intermediate_size=8192,
        num_attention_heads=32,
        num_key_value_heads=8,
        rms_norm_eps=1e-5,
        vocab_size=128256,
        rope_theta=500000.0,
        tie_word_embeddings=True,
    )
    model = llama.Model(args)
    model.set_dtype(dtype)
    mx.eval(model.parameters())
    return model


def fill(cache: list, context: int, dtype: mx.Dtype, chunk: int = 2048) -> None:
    """Write ``context`` random tokens of K/V into every layer."""
    for c in cache:
        for start in range(0, context, chunk):
            n = min(chunk, context - start)
            k = mx.random.normal((1, 8, n, 64)).astype(dtype)
            v = mx.random.normal((1, 8, n, 64)).astype(dtype)
            c.update_and_fetch(k, v)
            mx.eval(c.state)


def decode_seconds_per_step(model, cache: list, steps: int, warmup: int = 3) -> float:
    def step(y: mx.array) -> mx.array:
        logits = model(y[None], cache=cache)[:, -1, :]
        return mx.argmax(logits, axis=-1)

    y = step(mx.array([1]))
    mx.async_eval(y)
    for i in range(warmup + steps):
        if i == warmup:
            tic = time.perf_counter()
        nxt = step(y)
        mx.async_eval(nxt)
        y.item()
        y = nxt
    y.item()
    return (time.perf_counter() - tic) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument(
        "--capacity-context",
        type=int,
        default=4096,
        help="context for the 1x vs 8x pool-capacity comparison (0 skips it)",
    )
    parser.add_argument(
        "--capacities",
        type=int,
        nargs="+",
        default=[1, 8],
        help="pool capacities, as multiples of what the capacity context needs",
    )
    parser.add_argument(
        "--repeats", type=int, default=1, help="time each case this often, in turn; keep the best"
    )
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    dtype = getattr(mx, args.dtype)
    model = llama_1b(dtype, args.layers)
    print(
        f"device={mx.default_device()} dtype={args.dtype} layers={args.layers} "
        f"block_size={args.block_size} steps={args.steps}"
    )
    results = []

    def time_one(context: int, make) -> float:
        cache = make()
        fill(cache, context, dtype)
        s = decode_seconds_per_step(model, cache, args.steps)
        del cache
        gc.collect()
        mx.clear_cache()
        return s

    def run_cases(context: int, cases: dict) -> dict[str, float]:
        """Best seconds per step of each case, timing them in turn ``repeats`` times."""
        best = {name: float("inf") for name in cases}
        for _ in range(args.repeats):
            for name, make in cases.items():
                best[name] = min(best[name], time_one(context, make))
        for name, s in best.items():
            results.append(dict(case=name, context=context, ms_per_step=s * 1e3, tok_s=1 / s))
        return best

    for context in args.contexts:
        best = run_cases(
            context,
            {
                "dense": lambda: make_prompt_cache(model),
                "paged": lambda: make_paged_cache(model, args.block_size),
            },
        )
        dense, paged = best["dense"], best["paged"]
        print(
            f"context={context:6d} dense {1 / dense:8.2f} tok/s  paged {1 / paged:8.2f} tok/s  "
            f"paged/dense speed {dense / paged:.3f}"
        )

    if args.capacity_context:
        ctx = args.capacity_context
        need = -(-(ctx + args.steps + 16) // args.block_size)  # context plus decoded tokens
        best = run_cases(
            ctx,
            {
                f"paged_capacity_{m}x": (
                    lambda m=m: make_paged_cache(model, args.block_size, num_blocks=need * m)
                )
                for m in args.capacities
            },
        )
        for m in args.capacities:
            s = best[f"paged_capacity_{m}x"]
            print(
                f"context={ctx:6d} pool capacity {m}x ({need * m} blocks): {s * 1e3:8.2f} ms/step"
            )
    print(f"attention calls by path: {dict(path_counts)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
