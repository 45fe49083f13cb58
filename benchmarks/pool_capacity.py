"""The engine's decode step with its pools grown on demand against pools sized up front.

One process holds an engine whose pools grow on demand (the default) and one
per ``--kv-memory`` size, all decoding the same ``--batch`` requests of
``--context`` random tokens; the engines take turns for ``--rounds`` rounds of
``--steps`` steps, and each round prints each engine's step p50 and host
phases (``StepClock``) and its tokens/s as a ratio to the grown engine's in the
same round (the lent host changes speed between rounds). A pool sized up front
holds every layer's K and V in arrays of that size from the start, as
``mlx_paged.server --kv-memory`` sizes them. ``--whole-inputs`` hands the
decode kernel whole pool arrays however large (``NARROW_BYTES`` off), and
``--scatter-writes`` writes each step's K/V with a scatter a layer before the
kernel instead of letting the kernel store them, to compare against the
default in another process.

Usage:
    python benchmarks/pool_capacity.py --model /root/l1b --kv-memory 32GB 64GB
    python benchmarks/pool_capacity.py --model /root/l1b --kv-memory 32GB 64GB --whole-inputs
    python benchmarks/pool_capacity.py --model /root/l1b --kv-memory 32GB 64GB --scatter-writes
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import mlx.core as mx
from mlx_lm import load

from mlx_paged import PagedEngine
from mlx_paged.attention import path_counts
from mlx_paged.attention.kernels import cuda, dispatch
from mlx_paged.cache.memory import blocks_for_memory, parse_memory, probe_footprint


def ready(model, num_blocks: int | None, prompts: list[list[int]], tokens: int) -> PagedEngine:
    """An engine whose requests all decode, their step's shapes traced."""
    engine = PagedEngine(model, max_batch_size=len(prompts), num_blocks=num_blocks)
    for p in prompts:
        engine.add_request(p, tokens)
    while engine.waiting or any(not r.generated for r in engine.running):
        engine.step()
    for _ in range(10):
        engine.step()
    mx.synchronize()
    return engine


def largest_array(engine: PagedEngine) -> int:
    """Bytes of the engine's largest pool array."""
    arrays = [x for pool in engine.runner.pools.values() for x in (*pool.keys, *pool.values)]
    return max((x.nbytes for x in arrays if x is not None), default=0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="an mlx-lm model directory")
    ap.add_argument("--kv-memory", nargs="+", default=["32GB"], help="pool sizes, as the server's")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--whole-inputs", action="store_true", help="no first-row views")
    ap.add_argument(
        "--scatter-writes", action="store_true", help="K/V written before the kernel, not by it"
    )
    args = ap.parse_args()
    if args.whole_inputs:
        cuda.NARROW_BYTES = 1 << 62
    if args.scatter_writes:
        dispatch.cuda_paged_decode.writes = False
    model, _ = load(args.model)
    footprint = probe_footprint(model, 16, None)
    sizes = {"grown": None}
    sizes |= {m: blocks_for_memory(parse_memory(m), footprint) for m in args.kv_memory}
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 30000) for _ in range(args.context)] for _ in range(args.batch)]
    tokens = args.steps * (args.rounds + 1) + 64
    engines = {}
    for name, n in sizes.items():
        engines[name] = ready(model, n, prompts, tokens)
        size = largest_array(engines[name]) / 2**30
        print(f"{name}: {n or 'grown'} blocks, largest pool array {size:.3f} GiB", flush=True)
    ratios: dict[str, list[float]] = {name: [] for name in engines}
    for r in range(args.rounds):
        p50 = {}
        for name in list(engines) if r % 2 == 0 else list(reversed(engines)):
            engine = engines[name]
            engine.clock.reset()
            times = []
            for _ in range(args.steps):
                start = time.perf_counter()
                engine.step()
                times.append(time.perf_counter() - start)
            mx.synchronize()
            p50[name] = statistics.median(times)
            steps = engine.clock.decode_steps
            phases = {k: round(v / steps * 1e3, 3) for k, v in engine.clock.seconds.items() if v}
            print(f"round {r} {name}: step p50 {p50[name] * 1e3:.3f} ms; host ms/step {phases}")
        for name in engines:
            ratios[name].append(p50["grown"] / p50[name])
    for name, rs in ratios.items():
        each = " ".join(f"{x:.3f}" for x in rs)
        mid = statistics.median(rs)
        print(f"{name}: tok/s against grown pools, by round: {each}; median {mid:.3f}x")
    print(f"attention calls by path: {dict(path_counts)}; NARROW_BYTES {cuda.NARROW_BYTES}")


if __name__ == "__main__":
    main()
