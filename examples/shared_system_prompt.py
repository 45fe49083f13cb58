"""N chat requests that share a long system prompt, run together through PagedEngine.

The system prompt's K/V is computed once: every other request adopts its blocks
by reference and prefills only its own question. Prints each answer, its time to
first token, how many blocks were shared, and KV memory against dense caches.

    python examples/shared_system_prompt.py                 # embedded SmolLM2-135M
    python examples/shared_system_prompt.py --model mlx-community/Llama-3.2-1B-Instruct-4bit
    python examples/shared_system_prompt.py -n 2 --max-tokens 4 --system-sentences 2  # quick
"""

from __future__ import annotations

import argparse
import time

from mlx_paged import PagedEngine
from mlx_paged.cache.memory import fmt_bytes, probe_footprint
from mlx_paged.embedded import load_model

RULES = [
    "You are the help desk assistant of a small public library.",
    "Answer in one or two short sentences.",
    "The library opens at nine in the morning and closes at six in the evening.",
    "It is closed on Sundays and on public holidays.",
    "Members may borrow up to eight books at a time, for three weeks.",
    "A loan can be renewed twice, online or at the front desk.",
    "Late returns cost twenty cents per book per day.",
    "The reading room on the second floor is for quiet study only.",
    "Printing costs ten cents per page; scanning is free.",
    "Children under twelve need a parent's signature to join.",
    "Lost cards are replaced for two dollars at the front desk.",
    "If you do not know an answer, say so and suggest asking at the front desk.",
]
QUESTIONS = [
    "When does the library open?",
    "How many books can I borrow?",
    "Is the library open on Sunday?",
    "How much does printing cost?",
    "I lost my card. What should I do?",
    "Can my eight-year-old join?",
    "What happens if I return a book late?",
    "Can I renew a loan?",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", default=None, help="mlx-lm model path or repo (default: embedded)"
    )
    parser.add_argument("-n", "--num-requests", type=int, default=8, help="requests to run")
    parser.add_argument("--max-tokens", type=int, default=40, help="tokens per answer")
    parser.add_argument(
        "--system-sentences", type=int, default=len(RULES), help="length of the system prompt"
    )
    parser.add_argument("--block-size", type=int, default=16)
    args = parser.parse_args()
    if args.num_requests <= 0 or args.max_tokens <= 0 or args.system_sentences <= 0:
        parser.error("-n, --max-tokens and --system-sentences must be positive.")

    model, tokenizer = load_model(args.model)
    system = " ".join(RULES[: args.system_sentences])
    questions = [QUESTIONS[i % len(QUESTIONS)] for i in range(args.num_requests)]
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "system", "content": system}, {"role": "user", "content": q}],
            add_generation_prompt=True,
        )
        for q in questions
    ]

    engine = PagedEngine(model, block_size=args.block_size)
    stops = set(tokenizer.eos_token_ids)
    uids = [engine.add_request(p, args.max_tokens, stop_tokens=stops) for p in prompts]
    answers: dict[int, list[int]] = {u: [] for u in uids}
    ttft: dict[int, float] = {}
    most_shared = 0
    start = time.perf_counter()
    while engine.waiting or engine.running:
        for ev in engine.step():
            ttft.setdefault(ev.uid, time.perf_counter() - start)
            if ev.finish_reason != "stop":
                answers[ev.uid].append(ev.token)
        # Blocks held by more than one running request right now: shared, not copied.
        holders: dict[int, int] = {}
        for req in engine.running:
            for table in req.tables.values():
                for b in table.blocks:
                    holders[b] = holders.get(b, 0) + 1
        most_shared = max(most_shared, sum(1 for n in holders.values() if n > 1))
    elapsed = time.perf_counter() - start

    for uid, q in zip(uids, questions, strict=True):
        print(f"[{uid}] {q}  (TTFT {ttft[uid]:.2f}s)")
        print("    " + tokenizer.decode(answers[uid]).strip().replace("\n", "\n    "))
    s = engine.stats()
    fp = probe_footprint(model, args.block_size, None)
    dense = sum(
        fp.dense_bytes(len(p) + len(answers[u])) for p, u in zip(prompts, uids, strict=True)
    )
    paged = s.peak_live_blocks * fp.bytes_per_block
    shared = min(len(p) for p in prompts)
    for p in prompts[1:]:
        shared = next(
            (i for i, (a, b) in enumerate(zip(p, prompts[0], strict=False)) if a != b), shared
        )
    print(f"{len(prompts)} requests sharing a {shared}-token prompt prefix, {elapsed:.2f}s")
    print(
        f"prefix-hit tokens: {s.prefix_hit_tokens} of {sum(len(p) for p in prompts)} prompt "
        f"tokens; most blocks shared at once: {most_shared}"
    )
    print(
        f"KV memory: peak {s.peak_live_blocks} live blocks = {fmt_bytes(paged)}; "
        f"dense mlx-lm caches (one per request): {fmt_bytes(dense)}"
    )


if __name__ == "__main__":
    main()
