"""A hybrid model's served waves in process: how its arrivals' prefills are cut, and first tokens.

``PagedEngine`` on a Qwen3.5-shaped hybrid (``engine.py``'s ``--shape qwen3_5``, or
``--model DIR``) takes the serving table's load without HTTP: chat-templated prompts
of one ``--system``-token system prompt and ``Question i: ...`` of ``--question``
tokens (the embedded SmolLM2 tokenizer, as ``server.py`` writes them), ``--max-tokens``
out, greedy. Each level keeps ``c`` requests in flight, adding at most ``--per-step``
a step as earlier ones finish, after one request that caches the system prompt.

Prompts that share their first digits share more tokens: the block holding
``Question 1`` is cached once ``Question 12`` has run, so ``Question 17`` finds cached
blocks past the snapshot it adopts. One line per level: the prefill forwards (alone,
batched), the tokens prefilled, and each request's first token from when it was added
(ms, p50 / p99).

Usage:
    python benchmarks/hybrid_waves.py --dtype float16 --hidden 1536 --layers 24   # GPU
    python benchmarks/hybrid_waves.py --hidden 256 --layers 4 --system 1024      # CPU
"""

from __future__ import annotations

import argparse
import random
import time

import mlx.core as mx
import mlx.nn as nn
from engine import build_model
from mlx_lm import load
from transformers import AutoTokenizer

from mlx_paged import PagedEngine
from mlx_paged.embedded import embedded_model_path


def prompts(
    n: int, system_tokens: int, question_tokens: int, block: int, tokenizer: str
) -> list[list[int]]:
    """``n`` chat-templated prompts as ``benchmarks/server.py`` writes them (``tokenizer``:
    a model directory), the system
    prompt lengthened by a few words until the prompts part one token before a block
    ends (so the question's first digit is that block's last token)."""
    tok = AutoTokenizer.from_pretrained(tokenizer)
    rng = random.Random(0)
    words = sorted(w for w in tok.get_vocab() if w.isalpha() and len(w) > 3)

    def text(k: int) -> str:
        out: list[str] = []
        while len(tok.encode(" ".join(out))) < k:
            out.append(rng.choice(words))
        return " ".join(out)

    def encode(system: str, i: int, question: str) -> list[int]:
        chat = [{"role": "user", "content": f"{system}\nQuestion {i}: {question}"}]
        ids = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    system = text(system_tokens)
    for _ in range(2 * block):
        a, b = encode(system, 10, "x"), encode(system, 20, "x")
        parted = next(i for i, (s, t) in enumerate(zip(a, b, strict=False)) if s != t)
        if parted % block == block - 1:
            break
        system += " the"
    return [encode(system, i, text(question_tokens)) for i in range(n)]


class Forwards:
    """Counts the engine's prefill forwards, alone and batched, while ``on``."""

    def __init__(self, engine: PagedEngine):
        self.alone = self.batched = 0
        runner = engine.runner
        prefill, forward = runner.prefill, runner.forward

        def alone(*args, **kwargs):
            self.alone += 1
            return prefill(*args, **kwargs)

        def batched(*args, **kwargs):
            self.batched += 1
            return forward(*args, **kwargs)

        runner.prefill, runner.forward = alone, batched


def level(engine: PagedEngine, ids: list[list[int]], c: int, per_step: int, max_tokens: int):
    """Run ``ids`` with ``c`` in flight; return each request's ms from add to first token."""
    pending, added, first = list(ids), {}, {}
    while pending or engine.waiting or engine.running:
        k = 0
        while pending and len(engine.waiting) + len(engine.running) < c and k < per_step:
            added[engine.add_request(pending.pop(0), max_tokens)] = time.perf_counter()
            k += 1
        for event in engine.step():
            first.setdefault(event.uid, time.perf_counter())
    return sorted(1e3 * (first[u] - added[u]) for u in added)


def model_flags(description: str) -> argparse.ArgumentParser:
    """A parser with the model's flags (``--model``, else a random qwen3_5 shape) and the
    prompts' sizes."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--model", help="mlx-lm model directory (default: a random qwen3_5 shape)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--hidden", type=int, default=1536)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--system", type=int, default=1024, help="system prompt tokens")
    ap.add_argument("--question", type=int, default=32, help="question tokens")
    return ap


def model_of(args: argparse.Namespace) -> tuple[nn.Module, str]:
    """The model ``model_flags`` name, and the directory of its tokenizer."""
    args.shape = "qwen3_5"
    model = load(args.model)[0] if args.model else build_model(args)
    return model, args.model or str(embedded_model_path())


def main() -> None:
    ap = model_flags(__doc__.split("\n")[0])
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[8, 32, 32])
    ap.add_argument("--per-step", type=int, default=3, help="arrivals a step at most")
    ap.add_argument("--block-size", type=int, default=16)
    args = ap.parse_args()
    model, tokenizer = model_of(args)
    ids = prompts(
        1 + 2 * sum(args.concurrency), args.system, args.question, args.block_size, tokenizer
    )
    engine = PagedEngine(model, block_size=args.block_size, max_batch_size=max(args.concurrency))
    forwards = Forwards(engine)
    level(engine, ids[:1], 1, 1, args.max_tokens)  # caches the system prompt
    start = 1
    print(f"device={mx.default_device()} prompts of {len(ids[0])} tokens", flush=True)
    for c in args.concurrency:
        before = (forwards.alone, forwards.batched, engine.stats().prefilled_tokens)
        tic = time.perf_counter()
        ms = level(engine, ids[start : start + 2 * c], c, args.per_step, args.max_tokens)
        wall = time.perf_counter() - tic
        start += 2 * c
        alone, batched = forwards.alone - before[0], forwards.batched - before[1]
        filled = engine.stats().prefilled_tokens - before[2]
        print(
            f"c={c:3d} n={len(ms):3d}: forwards {alone} alone, {batched} batched; "
            f"{filled} tokens prefilled; first token p50 {ms[len(ms) // 2]:.1f} ms "
            f"p99 {ms[min(len(ms) - 1, int(0.99 * len(ms)))]:.1f} ms; wall {wall:.2f} s",
            flush=True,
        )


if __name__ == "__main__":
    main()
