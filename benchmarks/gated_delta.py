"""GatedDeltaNet prefill on CUDA: mlx_paged's kernel against mlx-lm's loop of ops.

Two measurements, each with the kernel (``mlx_paged.attention.recurrent``) and
with mlx-lm's ``gated_delta_ops``, in one process:

- the recurrence alone: one layer's ``gated_delta_ops`` call over T tokens, in
  the Qwen3.5 shape (16 key and 16 value heads of 128);
- a whole model: the time to the first token of a T-token prompt through
  ``mlx_lm``'s ``generate_step`` on mlx-lm's own caches, for the Qwen3.5-shaped
  hybrid of ``benchmarks/engine.py`` (about 1B parameters, float16).

Usage:
    python benchmarks/gated_delta.py                   # on the GPU
    python benchmarks/gated_delta.py --tokens 512 2048 --model-tokens 2048 8192
"""

from __future__ import annotations

import argparse
import random
import time

import mlx.core as mx
from engine import build_model
from mlx_lm.generate import generate_step
from mlx_lm.models import gated_delta
from mlx_lm.models.cache import make_prompt_cache

from mlx_paged.attention import recurrent


def timed(fn, repeat: int = 3) -> float:
    """The fastest of ``repeat`` calls, after one untimed call (first use)."""
    mx.eval(fn())
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        mx.eval(fn())
        best = min(best, time.perf_counter() - start)
    return best


def recurrence(t: int, dtype: mx.Dtype) -> None:
    b, h, d = 1, 16, 128
    q = mx.random.normal((b, t, h, d)).astype(dtype) * d**-0.5
    k = mx.random.normal((b, t, h, d)).astype(dtype) * d**-0.5
    v = mx.random.normal((b, t, h, d)).astype(dtype)
    g = mx.random.uniform(0.9, 1.0, (b, t, h))
    beta = mx.random.uniform(0.0, 1.0, (b, t, h)).astype(dtype)
    state = mx.zeros((b, h, d, d))
    args = (q, k, v, g, beta, state)
    kernel = timed(lambda: recurrent.gated_delta_ops(*args))
    ops = timed(lambda: recurrent._original_ops(*args), repeat=1)
    print(
        f"recurrence T={t}: kernel {kernel * 1e3:.2f} ms, mlx-lm's ops {ops * 1e3:.1f} ms "
        f"({ops / kernel:.0f}x)",
        flush=True,
    )


def model_prefill(model, t: int) -> None:
    rng = random.Random(0)
    prompt = mx.array([rng.randrange(151936) for _ in range(t)])

    def first() -> mx.array:
        cache = make_prompt_cache(model)
        return next(generate_step(prompt, model, prompt_cache=cache))[0]

    rows = {}
    for name, ops in (("kernel", recurrent.gated_delta_ops), ("ops", recurrent._original_ops)):
        gated_delta.gated_delta_ops = ops
        rows[name] = timed(first, repeat=1 if name == "ops" else 2)
    gated_delta.gated_delta_ops = recurrent.gated_delta_ops
    print(
        f"qwen3_5 1B prompt of {t}: first token {rows['kernel']:.3f} s with the kernel, "
        f"{rows['ops']:.3f} s with mlx-lm's ops ({rows['ops'] / rows['kernel']:.1f}x)",
        flush=True,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 512, 2048])
    ap.add_argument("--model-tokens", type=int, nargs="+", default=[2048, 8192])
    args = ap.parse_args()
    if not mx.cuda.is_available():
        ap.error("the kernel runs on MLX's CUDA backend only")
    recurrent.route_gated_delta()
    print(f"device={mx.default_device()}", flush=True)
    for t in args.tokens:
        recurrence(t, mx.float16)
    shape = dict(shape="qwen3_5", hidden=1536, layers=24, vocab=151936, dtype="float16")
    model = build_model(argparse.Namespace(**shape))
    for t in args.model_tokens:
        model_prefill(model, t)
    print(f"calls: {dict(recurrent.gated_delta_counts)}")


if __name__ == "__main__":
    main()
