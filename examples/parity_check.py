"""Dense vs paged logits on any model: prefill in chunks, then decode token by token.

Feeds the same tokens through mlx-lm's own cache and through a paged cache, and
compares the logits of every step. Exits 1 if the largest absolute difference is
above --tol.

    python examples/parity_check.py                          # embedded SmolLM2-135M
    python examples/parity_check.py --model mlx-community/Qwen3-0.6B-4bit --tokens 600
    python examples/parity_check.py --tokens 24 --decode 4   # quick
"""

from __future__ import annotations

import argparse
import sys

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from mlx_paged import make_paged_cache
from mlx_paged.embedded import load_model

TEXT = (
    "The paged cache keeps each layer's keys and values in fixed-size blocks. Sequences that "
    "share a prefix point at the same blocks, and a write into a shared block copies it first. "
    "This check runs the same tokens through both caches and compares what the model predicts. "
)


def logits_per_step(model, cache: list, tokens: list[int], chunk: int, decode: int) -> mx.array:
    """Prefill ``tokens[:-decode]`` in chunks, then feed the rest one at a time.

    Returns the last-position logits of every forward, stacked: ``(steps, vocab)``.
    """
    out = []
    body = len(tokens) - decode
    for lo in range(0, body, chunk):
        out.append(model(mx.array(tokens[lo : min(body, lo + chunk)])[None], cache=cache)[0, -1])
    for t in tokens[body:]:
        out.append(model(mx.array([[t]]), cache=cache)[0, -1])
    logits = mx.stack(out).astype(mx.float32)
    mx.eval(logits)
    return logits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", default=None, help="mlx-lm model path or repo (default: embedded)"
    )
    parser.add_argument("--tokens", type=int, default=200, help="tokens to run (text repeats)")
    parser.add_argument("--decode", type=int, default=16, help="of which fed one at a time")
    parser.add_argument("--chunk", type=int, default=64, help="prefill chunk size")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--tol", type=float, default=1e-3, help="largest allowed |dense - paged|")
    args = parser.parse_args()
    if not 0 < args.decode < args.tokens or args.chunk <= 0:
        parser.error("need 0 < --decode < --tokens and a positive --chunk.")

    model, tokenizer = load_model(args.model)
    ids = tokenizer.encode(TEXT)
    tokens = (ids * (args.tokens // len(ids) + 1))[: args.tokens]
    dense = logits_per_step(model, make_prompt_cache(model), tokens, args.chunk, args.decode)
    paged_cache = make_paged_cache(model, block_size=args.block_size)
    paged = logits_per_step(model, paged_cache, tokens, args.chunk, args.decode)
    diff = mx.abs(dense - paged).max().item()
    same = (mx.argmax(dense, -1) == mx.argmax(paged, -1)).all().item()
    print(
        f"tokens: {len(tokens)} ({len(tokens) - args.decode} prefilled in chunks of "
        f"{args.chunk}, {args.decode} decoded), block size {args.block_size}"
    )
    print(f"max |dense - paged| logit difference: {diff:.3g} (tolerance {args.tol:g})")
    print(f"same greedy token at every step: {same}")
    if diff > args.tol:
        print("FAIL: paged logits differ from dense beyond the tolerance", file=sys.stderr)
        sys.exit(1)
    print("OK")


if __name__ == "__main__":
    main()
