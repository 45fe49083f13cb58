"""What the recurrent-state snapshot interval costs and saves, on a hybrid model.

For each ``--intervals`` value, one ``PagedEngine`` prefills ``--prompt`` tokens
(prefill forwards end at every multiple of the interval, where the state is
snapshotted), then a second request sharing a prefix of ``--shared`` tokens
adopts the last snapshot inside it. Reports the first prefill's time (cutting
forwards shorter and copying states costs time), the snapshots and their bytes,
and the second request's prefix hit and time to first token (a longer interval
leaves more of the shared prefix to recompute). Same model as
``benchmarks/engine.py --shape qwen3_5``.

Usage:
    python benchmarks/snapshots.py --dtype float16                      # on a GPU
    python benchmarks/snapshots.py --hidden 128 --layers 4 --vocab 1000 --prompt 512 --shared 300
"""

from __future__ import annotations

import argparse
import random
import time

import mlx.core as mx
from engine import build_model

from mlx_paged import PagedEngine


def first_token_s(engine: PagedEngine, prompt: list[int]) -> float:
    """Seconds from adding ``prompt`` to its first token."""
    start = time.perf_counter()
    engine.add_request(prompt, 1)
    while engine.waiting or engine.running:
        engine.step()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--hidden", type=int, default=1536)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--prompt", type=int, default=8192)
    parser.add_argument("--shared", type=int, default=6000, help="tokens the second prompt shares")
    parser.add_argument("--intervals", type=int, nargs="+", default=[256, 512, 1024, 2048, 4096])
    parser.add_argument("--prefill-step-size", type=int, default=2048)
    parser.add_argument("--repeat", type=int, default=2, help="runs per interval (best kept)")
    args = parser.parse_args()
    args.shape = "qwen3_5"
    model = build_model(args)
    rng = random.Random(0)
    prompt = [rng.randrange(args.vocab) for _ in range(args.prompt)]
    second = prompt[: args.shared] + [rng.randrange(args.vocab) for _ in range(64)]
    print(
        f"device={mx.default_device()} dtype={args.dtype} prompt={args.prompt} "
        f"shared={args.shared} prefill_step_size={args.prefill_step_size}",
        flush=True,
    )
    for interval in [None, *args.intervals]:  # None: warm-up
        best = None
        for _ in range(args.repeat if interval else 1):
            engine = PagedEngine(
                model,
                prefill_step_size=args.prefill_step_size,
                state_snapshot_interval=interval or args.prefill_step_size,
                num_state_snapshots=64,
            )
            t1 = first_token_s(engine, prompt)
            stats = engine.stats()
            uid = engine.add_request(second, 1)
            req = engine.request(uid)
            start = time.perf_counter()
            while engine.waiting or engine.running:
                engine.step()
            t2 = time.perf_counter() - start
            row = (t1, t2, req.prefix_hit, stats.state_snapshots, stats.state_snapshot_bytes)
            best = row if best is None or row[0] + row[1] < best[0] + best[1] else best
        if interval is None:
            continue
        t1, t2, hit, n, nbytes = best
        print(
            f"interval {interval:5d}: prefill {args.prompt} tokens {t1 * 1e3:8.1f} ms, "
            f"{n:3d} snapshots {nbytes / 1e6:8.1f} MB ({nbytes / max(n, 1) / 1e6:.2f} MB each); "
            f"second request hit {hit:5d} of {args.shared}, TTFT {t2 * 1e3:7.1f} ms",
            flush=True,
        )


if __name__ == "__main__":
    main()
