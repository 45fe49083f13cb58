"""A busy engine's MLX buffer cache over waves of requests that never let it rest.

``PagedEngine(model)`` is warmed up, then takes waves of requests sharing a
``--system``-token prompt, each with 40–87 tokens of its own and ``--max-tokens``
out. A wave is added once the one before is down to a quarter of its requests,
so the engine never rests (an idle server hands its cache back; a busy one does
not). After each wave: its tokens/s, and MLX's live, cached and peak bytes.
``--limit`` sets ``mx.set_cache_limit`` first (``mlx_paged.server`` sets it with
``--mlx-cache-limit``).

Usage:
    python benchmarks/buffer_cache.py --model /root/l1b
    python benchmarks/buffer_cache.py --model /root/l1b --limit 1GB
"""

from __future__ import annotations

import argparse
import time

import mlx.core as mx
from mlx_lm import load

from mlx_paged import PagedEngine
from mlx_paged.cache.memory import parse_memory
from mlx_paged.engine.warmup import warm_up

GB = 1 << 30


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="mlx-lm model directory")
    ap.add_argument("--limit", default=None, help="MLX's cache limit, e.g. 1GB (default: MLX's)")
    ap.add_argument("--waves", type=int, nargs="+", default=[32, 64, 32, 64, 16, 64, 32, 64])
    ap.add_argument("--system", type=int, default=1024)
    ap.add_argument("--max-tokens", type=int, default=128)
    args = ap.parse_args()
    model, tokenizer = load(args.model)
    if args.limit is not None:
        mx.set_cache_limit(parse_memory(args.limit))
    engine = PagedEngine(model)
    warm_up(engine)
    vocab = engine.vocab_size or len(tokenizer.vocab)
    system = [(5 * i + 1) % vocab for i in range(args.system)]
    uid = 0
    for wave, n in enumerate(args.waves):
        start, tokens = time.perf_counter(), 0
        for _ in range(n):
            uid += 1
            own = [(uid * 131 + 7 * j) % vocab for j in range(40 + (uid * 17) % 48)]
            engine.add_request(system + own, args.max_tokens)
        while len(engine.running) + len(engine.waiting) > n // 4:
            tokens += len(engine.step())
        print(
            f"limit {args.limit} wave {wave + 1} n={n}: "
            f"{tokens / (time.perf_counter() - start):.0f} tok/s, "
            f"active {mx.get_active_memory() / GB:.2f} GB, cached {mx.get_cache_memory() / GB:.2f} "
            f"GB, peak {mx.get_peak_memory() / GB:.2f} GB",
            flush=True,
        )
    for _ in engine.stream():
        pass


if __name__ == "__main__":
    main()
