"""A prompt's first token with the head over its last position against the whole chunk.

``PagedEngine`` prefills one ``--tokens``-token prompt and samples its first
token, in chunks of ``--prefill-step-size``; then a burst of ``--n`` requests
that add ``--suffix`` tokens each to that prompt (cached) and are prefilled in
one batched forward. Each case runs twice in turn in one process, on a llama
model of random weights: ``cut`` (``engine/head.py``, the head over the sampled
position of each row) and ``full`` (the head over every position of the chunk,
as mlx-lm's forward gives it). Reports milliseconds per prompt and per burst
(device synchronized) and the peak memory of each (``mx.get_peak_memory``, the
weights included).

Usage:
    python benchmarks/prefill_head.py --dtype float16                    # llama-1B shape
    python benchmarks/prefill_head.py --hidden 256 --layers 4 --tokens 1024 --n 8  # CPU
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import mlx.core as mx
from engine import build_model

from mlx_paged import PagedEngine


def timed(fn) -> tuple[float, float]:
    """Seconds ``fn`` takes with the device synchronized, and the peak memory in GB."""
    mx.synchronize()
    mx.clear_cache()
    mx.reset_peak_memory()
    start = time.perf_counter()
    fn()
    mx.synchronize()
    return time.perf_counter() - start, mx.get_peak_memory() / 1e9


def run(model, args, cut: bool, seed: int) -> dict[str, tuple[float, float]]:
    rng = random.Random(seed)
    prompt = [rng.randrange(args.vocab) for _ in range(args.tokens)]
    suffix = args.suffix
    burst = [prompt + [rng.randrange(args.vocab) for _ in range(suffix)] for _ in range(args.n)]
    engine = PagedEngine(
        model, max_batch_size=max(args.n, 1), prefill_step_size=args.prefill_step_size
    )
    if not cut:
        engine.runner.head = None  # the head over every position
    out = {"prompt": timed(lambda: engine.generate([prompt], max_tokens=1))}
    out["burst"] = timed(lambda: engine.generate(burst, max_tokens=1))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--prefill-step-size", type=int, default=2048)
    parser.add_argument("--n", type=int, default=32, help="requests in the burst")
    parser.add_argument("--suffix", type=int, default=64, help="tokens each adds")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    print(
        f"llama {args.layers}x{args.hidden}, vocab {args.vocab}, {args.dtype}, "
        f"{mx.default_device()}; prompt {args.tokens} tokens in chunks of "
        f"{args.prefill_step_size}, burst {args.n} x {args.suffix}",
        flush=True,
    )
    model = build_model(args, tied=False)
    run(model, args, True, seed=-1)  # the process's first-use work for these shapes
    run(model, args, False, seed=-2)
    seen: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for r in range(args.rounds):
        for case in ("cut", "full"):
            for part, result in run(model, args, case == "cut", seed=r).items():
                seen.setdefault((case, part), []).append(result)
    for part in ("prompt", "burst"):
        for case in ("cut", "full"):
            got = seen[(case, part)]
            ms = statistics.median(t for t, _ in got) * 1e3
            peak = max(p for _, p in got)
            runs = ", ".join(f"{t * 1e3:.1f}" for t, _ in got)
            print(f"{part:6s} {case:4s}: {ms:8.1f} ms p50 ({runs}), peak {peak:6.2f} GB")


if __name__ == "__main__":
    main()
