"""PagedEngine alone under a closed loop: c requests in flight, a new one as each ends.

Each request is a shared ``--system`` token prompt plus ``--question`` tokens of
its own, generating ``--max-tokens`` tokens; a level runs ``2c`` requests at
concurrency c (the load of ``benchmarks/server.py --table``, without HTTP). For
each level it prints generated tok/s and the host milliseconds per decode step
of each ``StepClock`` phase. ``--modes overlap step`` runs every level with the
overlapped decode and then reading every step's tokens, in one process, on one
model (``PagedEngine(overlap=...)``); ``--temperature`` samples with the
server's samplers.

Usage:
    python benchmarks/engine_levels.py --model /root/l1b --levels 1 32 64 32 64 \
        --modes overlap step overlap step             # on a GPU
    python benchmarks/engine_levels.py --layers 2 --hidden 256 --levels 1 4 --max-tokens 16
        # quick look, random llama weights
"""

from __future__ import annotations

import argparse
import random
import time

import mlx.core as mx
from mlx_lm.models import llama

from mlx_paged import PagedEngine


def random_llama(layers: int, hidden: int, vocab: int, dtype: mx.Dtype):
    args = llama.ModelArgs(
        model_type="llama",
        hidden_size=hidden,
        num_hidden_layers=layers,
        intermediate_size=4 * hidden,
        num_attention_heads=max(1, hidden // 64),
        num_key_value_heads=max(1, hidden // 256),
        rms_norm_eps=1e-5,
        vocab_size=vocab,
        tie_word_embeddings=True,
    )
    model = llama.Model(args)
    model.set_dtype(dtype)
    mx.eval(model.parameters())
    return model


def level(engine: PagedEngine, c: int, system: list[int], args, rng: random.Random) -> str:
    """Run ``2c`` requests at concurrency ``c``; one line of results."""
    vocab = engine.vocab_size
    total, done, started, tokens = 2 * c, 0, 0, 0

    def add() -> None:
        nonlocal started
        question = [rng.randrange(vocab // 2, vocab) for _ in range(args.question)]
        sampler = None
        if args.temperature > 0:  # the server's sampler (needs the server extra)
            from mlx_paged.server.sampling import make_request_sampler

            sampler = make_request_sampler(args.temperature, 1.0, 0, 0.0, None)
        engine.add_request(system + question, args.max_tokens, sampler=sampler)
        started += 1

    engine.clock.reset()
    start = time.perf_counter()
    for _ in range(c):
        add()
    while done < total:
        for event in engine.step():
            tokens += 1
            if event.finish_reason is not None:
                done += 1
                if started < total:
                    add()
    wall = time.perf_counter() - start
    steps = max(engine.clock.decode_steps, 1)
    phases = " ".join(f"{k} {1e3 * v / steps:.2f}" for k, v in engine.clock.seconds.items())
    return f"c={c:3d}: {tokens / wall:8.1f} tok/s; per decode step, ms: {phases}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="mlx-lm model directory (default: random llama weights)")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--dtype", default="float16", choices=["float32", "float16", "bfloat16"])
    ap.add_argument("--levels", type=int, nargs="+", default=[1, 32, 64, 32])
    ap.add_argument("--modes", nargs="+", default=["overlap", "step"], choices=["overlap", "step"])
    ap.add_argument("--system", type=int, default=1024)
    ap.add_argument("--question", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--max-batch-size", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    args = ap.parse_args()
    if args.model:
        from mlx_lm import load

        model, _ = load(args.model)
    else:
        model = random_llama(args.layers, args.hidden, args.vocab, getattr(mx, args.dtype))
    rng = random.Random(0)
    for mode in args.modes:
        engine = PagedEngine(model, max_batch_size=args.max_batch_size, overlap=mode == "overlap")
        vocab = engine.vocab_size
        system = [rng.randrange(vocab // 2, vocab) for _ in range(args.system)]
        print(f"== {mode} (device {mx.default_device()}, temperature {args.temperature})")
        for c in args.levels:
            print(level(engine, c, system, args, rng), flush=True)


if __name__ == "__main__":
    main()
