"""Single-sequence decode speed: make_paged_cache against mlx-lm's default cache.

A llama-1B-shaped random model (hidden 2048, 16 layers, 32 heads, 8 KV heads,
vocab 128256), or with ``--shape`` another family's: ``smollm2`` (the embedded
model, SmolLM2-135M), ``qwen3-1.7b`` (q/k norms, 128-wide heads), ``gemma3-1b``
(256-wide heads, five sliding-window layers of 512 tokens to one global),
``qwen3_5-2b`` (a Qwen3.5-shaped hybrid: three GatedDeltaNet layers to one
attention layer, whose recurrent state does not grow with the context) or
``nemotron-h-4b`` (Nemotron-H 4B's shape: 24 Mamba2 layers, 4 attention layers
and 24 MLP blocks). The
context is filled with random K/V written through each cache's
``update_and_fetch`` (decode speed does not depend on the values), then
decode steps run the way ``mlx_lm.generate_step`` runs them: the next step is
queued with ``async_eval`` before the current token is read.

Usage:
    python benchmarks/decode.py                      # CPU, float32
    python benchmarks/decode.py --dtype float16 --steps 100 --repeats 3   # on a GPU
    python benchmarks/decode.py --contexts 1024 --steps 8 --layers 2   # quick look
    python benchmarks/decode.py --dtype float16 --steps 20 --interleave 15 --eager-read
    python benchmarks/decode.py --dtype float16 --steps 20 --interleave 10 --kernel-case --breakdown
    python benchmarks/decode.py --dtype float16 --steps 60 --interleave 7 --general-case --breakdown
    python benchmarks/decode.py --shape smollm2 --bits 4 --dtype float16   # the embedded model's
        # shape and 4-bit weights (random values)
    python benchmarks/decode.py --dtype float16 --shape qwen3_5-2b --steps 10 --interleave 41 \
        --views-case   # short rounds in turn: the lent host changes speed within seconds
    python benchmarks/decode.py --dtype float16 --shape gemma3-1b --steps 10 --interleave 41 \
        --write-first-case --breakdown
    python benchmarks/decode.py --dtype float16 --steps 50 --interleave 6 --kv-bits 8
        # also both caches as mlx-lm's kv_bits makes them
    python benchmarks/decode.py --dtype float16 --shape qwen3_5-2b --steps 10 --interleave 25 \
        --mlx-lm-recurrence-case --direct-recurrence-case --breakdown
        # the hybrid's GatedDeltaNet steps as mlx-lm runs them on CUDA, and launched directly
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time

import mlx.core as mx
import mlx.nn as nn
from engine import QWEN3_5
from mlx_lm.models import gated_delta, gemma3_text, llama, nemotron_h, qwen3, qwen3_5, ssm
from mlx_lm.models.cache import ArraysCache, make_prompt_cache

from mlx_paged import make_paged_cache
from mlx_paged.attention import mamba, path_counts, recurrent, routing, set_attention_path
from mlx_paged.attention.kernels import compiled_variants

KV_HEADS, HEAD_DIM = 8, 64  # of the model built (set in main)
_PASSED = ("model_type", "tie_word_embeddings", "rms_norm_eps")  # set in llama_1b
ALL_HEAD_DIMS = frozenset(range(1, 1025))


SHAPES = {
    "llama-1b": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        rope_theta=500000.0,
    ),
    # The embedded model's shape (SmolLM2-135M), random weights.
    "smollm2": dict(
        hidden_size=576,
        intermediate_size=1536,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        vocab_size=49152,
        rope_theta=100000.0,
        rope_traditional=True,
    ),
    "qwen3-1.7b": dict(
        hidden_size=2048,
        intermediate_size=6144,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
        rope_theta=1000000.0,
        max_position_embeddings=40960,
    ),
    # mlx-lm's gemma3_text defaults are Gemma 3 1B's shape.
    "gemma3-1b": dict(num_key_value_heads=1, head_dim=256),
    # benchmarks/engine.py's Qwen3.5 hybrid at Qwen3.5-2B's width and vocabulary.
    "qwen3_5-2b": {k: v for k, v in QWEN3_5.items() if k not in _PASSED}
    | dict(hidden_size=2048, intermediate_size=6144, vocab_size=248320),
    # Nemotron-H 4B's shape (M: Mamba2, *: attention, -: MLP), random weights.
    "nemotron-h-4b": dict(
        hidden_size=3072,
        intermediate_size=12288,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=131072,
        max_position_embeddings=8192,
        attention_bias=False,
        mamba_num_heads=112,
        mamba_head_dim=64,
        mamba_proj_bias=False,
        ssm_state_size=128,
        conv_kernel=4,
        n_groups=8,
        mlp_bias=False,
        layer_norm_epsilon=1e-5,
        use_bias=False,
        use_conv_bias=True,
        hybrid_override_pattern=list("M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-"),
    ),
}
LAYERS = {"llama-1b": 16, "smollm2": 30, "qwen3-1.7b": 28, "gemma3-1b": 26, "qwen3_5-2b": 24}
LAYERS["nemotron-h-4b"] = 52


def llama_1b(dtype: mx.Dtype, layers: int, shape: str = "llama-1b", bits: int = 0) -> nn.Module:
    """A random-weight model of ``shape``; ``bits`` quantizes its weights (groups of 32)."""
    common = dict(num_hidden_layers=layers, **SHAPES[shape])
    if shape not in ("gemma3-1b", "nemotron-h-4b"):  # gemma 3 always ties its head
        common["tie_word_embeddings"] = True
    if shape == "qwen3-1.7b":
        model = qwen3.Model(qwen3.ModelArgs(model_type="qwen3", rms_norm_eps=1e-6, **common))
    elif shape == "gemma3-1b":
        model = gemma3_text.Model(gemma3_text.ModelArgs(model_type="gemma3_text", **common))
    elif shape == "nemotron-h-4b":
        config = dict(common, model_type="nemotron_h")
        model = nemotron_h.Model(nemotron_h.ModelArgs.from_dict(config))
    elif shape == "qwen3_5-2b":
        config = dict(common, model_type="qwen3_5", rms_norm_eps=1e-6)
        model = qwen3_5.Model(qwen3_5.ModelArgs.from_dict(config))
    else:
        model = llama.Model(llama.ModelArgs(model_type="llama", rms_norm_eps=1e-5, **common))
    model.set_dtype(dtype)
    if bits:
        nn.quantize(model, group_size=32, bits=bits)
    mx.eval(model.parameters())
    return model


def fill(cache: list, context: int, dtype: mx.Dtype, chunk: int = 2048) -> None:
    """Write ``context`` random tokens of K/V into every attention layer (a recurrent
    layer's state stays zero: its size and step do not depend on the context). Each chunk
    goes to every layer before the next, as a model's forward writes them: a model's paged
    sliding-window layers share one block table, and each gives back for all of them the
    blocks behind its window."""
    for start in range(0, context, chunk):
        for c in cache:
            if isinstance(c, ArraysCache):
                continue
            n = min(chunk, context - start)
            k = mx.random.normal((1, KV_HEADS, n, HEAD_DIM)).astype(dtype)
            v = mx.random.normal((1, KV_HEADS, n, HEAD_DIM)).astype(dtype)
            c.update_and_fetch(k, v)
            mx.eval(c.state)


def decode_seconds_per_step(
    model, cache: list, steps: int, warmup: int = 3, parts: dict | None = None
) -> float:
    """Seconds per pipelined decode step; with ``parts``, add each step's seconds spent
    building the graph (``build``), in ``async_eval`` (``dispatch``) and waiting for the
    previous token (``wait``) to its lists."""

    def step(y: mx.array) -> mx.array:
        logits = model(y[None], cache=cache)[:, -1, :]
        return mx.argmax(logits, axis=-1)

    y = step(mx.array([1]))
    mx.async_eval(y)
    for i in range(warmup + steps):
        if i == warmup:
            tic = time.perf_counter()
        t0 = time.perf_counter()
        nxt = step(y)
        t1 = time.perf_counter()
        mx.async_eval(nxt)
        t2 = time.perf_counter()
        y.item()
        if parts is not None and i >= warmup:
            parts["build"].append(t1 - t0)
            parts["dispatch"].append(t2 - t1)
            parts["wait"].append(time.perf_counter() - t2)
        y = nxt
    y.item()
    return (time.perf_counter() - tic) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--layers", type=int, default=None, help="default: the shape's (LAYERS)")
    parser.add_argument("--shape", default="llama-1b", choices=sorted(SHAPES))
    parser.add_argument("--bits", type=int, default=0, help="quantize the weights (4 or 8)")
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
    parser.add_argument(
        "--interleave",
        type=int,
        default=0,
        help="instead of --repeats: fill each case's cache once, then time ROUNDS rounds of "
        "--steps steps per case in turn and report medians (steadier on a shared host)",
    )
    parser.add_argument(
        "--eager-read",
        action="store_true",
        help="also time a paged cache that builds the gathered K/V on every decode step "
        "(no deferred read)",
    )
    parser.add_argument(
        "--kernel-case",
        action="store_true",
        help="with --interleave: also time a paged cache whose decode attention is forced "
        "to the fused kernel (attention path 'kernel': no in-place read)",
    )
    parser.add_argument(
        "--views-case",
        action="store_true",
        help="with --interleave: also time a paged cache whose one-token steps read views of "
        "the pool at every head dim (on CUDA the default sends head dims MLX's vector "
        "attention does not take to the fused kernel: routing.CUDA_VIEW_HEAD_DIMS)",
    )
    parser.add_argument(
        "--write-first-case",
        action="store_true",
        help="with --interleave: also time a paged cache whose one-token steps that go to the "
        "fused kernel write the token first (by default the kernel stores it: "
        "routing.one_token_read's 'store')",
    )
    parser.add_argument(
        "--general-case",
        action="store_true",
        help="with --interleave: also time a paged cache whose one-token steps all take the "
        "general write and read (no KVPool.append_view)",
    )
    parser.add_argument(
        "--mlx-lm-recurrence-case",
        action="store_true",
        help="with --interleave: also time mlx-lm's cache with mlx-lm's own GatedDeltaNet "
        "recurrence and Mamba2 state update (its ops on CUDA), as mlx-lm runs without mlx_paged",
    )
    parser.add_argument(
        "--direct-recurrence-case",
        action="store_true",
        help="with --interleave: also time a paged cache whose one-token GatedDeltaNet calls "
        "launch the CUDA kernel directly (by default they replay a compiled launch)",
    )
    parser.add_argument(
        "--breakdown",
        action="store_true",
        help="with --interleave: also print each case's median host time per step building "
        "the graph, in async_eval, and waiting for the device",
    )
    parser.add_argument(
        "--kv-bits",
        type=int,
        choices=[4, 8],
        help="with --interleave: also time both caches quantized as mlx-lm's kv_bits makes "
        "them (mlx-lm's QuantizedKVCache against the paged cold tier)",
    )
    parser.add_argument("--kv-group-size", type=int, default=64, help="with --kv-bits")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    if args.breakdown and not args.interleave:
        parser.error("--breakdown needs --interleave ROUNDS")
    if args.kv_bits and not args.interleave:
        parser.error("--kv-bits needs --interleave ROUNDS")
    global KV_HEADS, HEAD_DIM
    dtype = getattr(mx, args.dtype)
    layers = args.layers or LAYERS[args.shape]
    model = llama_1b(dtype, layers, args.shape, args.bits)
    KV_HEADS = SHAPES[args.shape]["num_key_value_heads"]
    HEAD_DIM = SHAPES[args.shape].get("head_dim", 64)
    print(
        f"device={mx.default_device()} shape={args.shape} bits={args.bits} dtype={args.dtype} "
        f"layers={layers} block_size={args.block_size} steps={args.steps}"
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

    def quantized(cache: list) -> list:
        """``cache`` as mlx-lm's ``kv_bits`` makes it: each layer's ``to_quantized``."""
        return [c.to_quantized(group_size=args.kv_group_size, bits=args.kv_bits) for c in cache]

    def eager() -> list:
        cache = make_paged_cache(model, args.block_size)
        for c in cache:
            if hasattr(c, "pool"):
                c.pool.defer_reads = False
        return cache

    def general() -> list:
        cache = make_paged_cache(model, args.block_size)
        for c in cache:
            if hasattr(c, "pool"):
                c.pool.append_view = lambda *_: None  # declines: the general path runs
        return cache

    views, writes = routing.CUDA_VIEW_HEAD_DIMS, routing.kernels_write
    one_token_run = recurrent._one_token_run

    def direct_run(*arrays):  # the recurrence's one-token calls launched directly
        return recurrent.cuda_gated_delta if recurrent._takes(*arrays) else None

    def interleaved(context: int, cases: dict) -> dict[str, float]:
        """Median seconds per step of each case over ``--interleave`` rounds taken in turn
        (the first case alternating)."""
        caches = {}
        for name, make in cases.items():
            caches[name] = make()
            fill(caches[name], context, dtype)
        times = {name: [] for name in cases}
        parts = {name: {"build": [], "dispatch": [], "wait": []} for name in cases}
        for r in range(args.interleave):
            # The first case alternates, so a change of host speed within a round does not
            # always fall on the same case.
            order = list(caches.items())
            for name, cache in order if r % 2 == 0 else order[::-1]:
                set_attention_path("kernel" if name == "paged-kernel" else "auto")
                routing.CUDA_VIEW_HEAD_DIMS = ALL_HEAD_DIMS if name == "paged-views" else views
                routing.kernels_write = (lambda: False) if name == "paged-write-first" else writes
                routing._ready.clear()  # one_token_read's answers, kept per head dim
                mlx_lm_own = name == "dense-mlx-lm-recurrence"
                gated_delta.gated_delta_ops = (
                    recurrent._original_ops if mlx_lm_own else recurrent.gated_delta_ops
                )
                update = mamba._original_update if mlx_lm_own else mamba.ssm_update
                ssm.ssm_update = nemotron_h.ssm_update = update
                direct = name == "paged-direct-recurrence"
                recurrent._one_token_run = direct_run if direct else one_token_run
                try:
                    s = decode_seconds_per_step(
                        model, cache, args.steps, warmup=2, parts=parts[name]
                    )
                except RuntimeError as e:  # e.g. a quantized matmul MLX lacks for this shape
                    print(f"context={context:6d} {name}: {e}", flush=True)
                    del caches[name], parts[name]
                    continue
                times[name].append(s)
        set_attention_path("auto")
        routing.CUDA_VIEW_HEAD_DIMS, routing.kernels_write = views, writes
        routing._ready.clear()
        gated_delta.gated_delta_ops = recurrent.gated_delta_ops
        recurrent._one_token_run = one_token_run
        ssm.ssm_update = nemotron_h.ssm_update = mamba.ssm_update
        out = {name: statistics.median(t) for name, t in times.items() if t}
        if args.breakdown:
            for name, p in parts.items():
                line = ", ".join(f"{k} {statistics.median(v) * 1e3:.3f}" for k, v in p.items())
                print(f"context={context:6d} {name:17s} median ms per step: {line}")
        # Each round's ratio to the dense round beside it: steadier than the ratio of
        # medians while the host's speed drifts over the rounds.
        dense = times.get("dense", [])
        paired = {
            name: statistics.median(d / c for d, c in zip(dense, t, strict=True))
            for name, t in times.items()
            if name != "dense" and len(t) == len(dense)
        }
        if paired:
            line = "  ".join(f"{name} {r:.3f}" for name, r in paired.items())
            print(f"context={context:6d} median of each round's dense/case time: {line}")
        for name, s in out.items():
            row = dict(case=name, context=context, ms_per_step=s * 1e3, tok_s=1 / s)
            results.append(row | ({"paired": paired[name]} if name in paired else {}))
        return out

    if args.interleave:
        for context in args.contexts:
            cases = {
                "dense": lambda: make_prompt_cache(model),
                "paged": lambda: make_paged_cache(model, args.block_size),
            }
            if args.eager_read:
                cases["paged-eager-read"] = eager
            if args.kernel_case:
                cases["paged-kernel"] = cases["paged"]
            if args.views_case:
                cases["paged-views"] = cases["paged"]
            if args.write_first_case:
                cases["paged-write-first"] = cases["paged"]
            if args.general_case:
                cases["paged-general"] = general
            if args.mlx_lm_recurrence_case:
                cases["dense-mlx-lm-recurrence"] = cases["dense"]
            if args.direct_recurrence_case:
                cases["paged-direct-recurrence"] = cases["paged"]
            if args.kv_bits:
                cases["dense-kv"] = lambda: quantized(make_prompt_cache(model))
                cases["paged-kv"] = lambda: quantized(make_paged_cache(model, args.block_size))
            med = interleaved(context, cases)
            line = "  ".join(
                f"{name} {1 / s:7.1f} tok/s ({med['dense'] / s:.3f})" for name, s in med.items()
            )
            print(f"context={context:6d} median of {args.interleave} rounds: {line}", flush=True)
            if args.kv_bits and {"dense-kv", "paged-kv"} <= med.keys():
                print(
                    f"context={context:6d} {args.kv_bits}-bit KV: paged/dense tok/s "
                    f"{med['dense-kv'] / med['paged-kv']:.3f}",
                    flush=True,
                )
        args.contexts, args.capacity_context = [], 0

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
    counts = dict(gated_delta=dict(recurrent.gated_delta_counts), ssm=dict(mamba.ssm_counts))
    print(f"recurrent one-token calls by path: {counts}")
    print(f"compiled kernel variants: {compiled_variants()}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
