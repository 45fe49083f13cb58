"""A multi-turn chat on PagedEngine: each turn adopts the blocks of the turns before it.

Turn k's prompt is turn k-1's prompt + its answer + the new user message. When
turn k-1 finished, its blocks were parked in the prefix index, so turn k adopts
them by reference and prefills only the new message: watch prefix-hit tokens grow.

    python examples/multi_turn_chat.py                    # embedded SmolLM2-135M
    python examples/multi_turn_chat.py --turns 2 --max-tokens 4   # quick
"""

from __future__ import annotations

import argparse
import time

from mlx_paged import PagedEngine
from mlx_paged.embedded import load_model

USER_TURNS = [
    "Hi! I want to plan a short trip to Lisbon.",
    "What should I see on the first day?",
    "And where could I eat in the evening?",
    "Thanks. Can you summarise the plan in one sentence?",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", default=None, help="mlx-lm model path or repo (default: embedded)"
    )
    parser.add_argument("--turns", type=int, default=len(USER_TURNS), help="user turns to run")
    parser.add_argument("--max-tokens", type=int, default=48, help="tokens per answer")
    parser.add_argument("--block-size", type=int, default=16)
    args = parser.parse_args()
    if not 0 < args.turns <= len(USER_TURNS) or args.max_tokens <= 0:
        parser.error(f"--turns must be 1..{len(USER_TURNS)} and --max-tokens positive.")

    model, tokenizer = load_model(args.model)
    engine = PagedEngine(model, block_size=args.block_size)
    stops = set(tokenizer.eos_token_ids)
    messages: list[dict] = []
    previous: list[int] = []  # last turn's prompt + answer tokens
    for turn, user in enumerate(USER_TURNS[: args.turns], 1):
        messages.append({"role": "user", "content": user})
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        common = next(
            (i for i, (a, b) in enumerate(zip(prompt, previous, strict=False)) if a != b),
            min(len(prompt), len(previous)),
        )
        before = engine.stats()
        start = time.perf_counter()
        (answer,) = engine.generate([prompt], max_tokens=args.max_tokens, stop_tokens=stops)
        elapsed = time.perf_counter() - start
        after = engine.stats()
        text = tokenizer.decode([t for t in answer if t not in stops]).strip()
        messages.append({"role": "assistant", "content": text})
        previous = prompt + answer
        hit = after.prefix_hit_tokens - before.prefix_hit_tokens
        prefilled = after.prefilled_tokens - before.prefilled_tokens
        print(f"--- turn {turn}: prompt {len(prompt)} tokens ({common} shared with the last turn)")
        print(f"user: {user}")
        print(f"assistant: {text}")
        print(
            f"prefix-hit tokens this turn: {hit}, prefilled: {prefilled}, total prefix hits: "
            f"{after.prefix_hit_tokens}, {elapsed:.2f}s"
        )
    s = engine.stats()
    print(f"pool: {s.live_blocks} live, {s.cached_blocks} cached, {s.free_blocks} free blocks")


if __name__ == "__main__":
    main()
