"""Tokenizing resent prompts: ``PromptTokenizer`` against the tokenizer alone.

Two loads, each prompt tokenized both ways in the same process (the results must be equal):

- ``server``: ``benchmarks/server.py``'s prompts, one shared system prompt of ``--system``
  tokens and a question of ``--question`` tokens each;
- ``conversation``: a conversation of ``--turns`` turns that grows by one user turn at a time
  to about ``--context`` tokens, through the chat template (both times include rendering it).

    python benchmarks/prompt_tokens.py                      # the embedded model's tokenizer
    python benchmarks/prompt_tokens.py --model /path/to/model --context 32768
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

from mlx_lm.tokenizer_utils import load as load_tokenizer

from mlx_paged.embedded import embedded_model_path
from mlx_paged.server.prompt_tokens import PromptTokenizer


def timed(fn, *args, **kwargs):
    start = time.perf_counter()
    out = fn(*args, **kwargs)
    return out, time.perf_counter() - start


def report(name: str, whole: list[float], reused: list[float], tokens: int) -> None:
    w, r = statistics.median(whole) * 1e3, statistics.median(reused) * 1e3
    print(
        f"{name}: {tokens} tokens a prompt, {len(whole)} prompts; median ms a prompt: "
        f"tokenizer {w:.3f}, PromptTokenizer {r:.3f} ({w / r:.1f}x faster)"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="model directory (default: the embedded one)")
    ap.add_argument("--system", type=int, default=1024, help="shared system prompt tokens")
    ap.add_argument("--question", type=int, default=64, help="tokens of each question")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--context", type=int, default=32768, help="the conversation's last length")
    ap.add_argument("--turns", type=int, default=16)
    args = ap.parse_args()

    tokenizer = load_tokenizer(Path(args.model) if args.model else embedded_model_path(False))
    prompts = PromptTokenizer(tokenizer)
    print(f"reuse: {prompts.reuse}")
    rng = random.Random(0)
    words = [w for w in tokenizer._tokenizer.get_vocab() if w.isalpha() and len(w) > 3]

    def text(n: int) -> str:
        """About ``n`` tokens of random words (one or two tokens each)."""
        out: list[str] = []
        have = 0
        while have < n:
            out += [rng.choice(words) for _ in range(max(1, (n - have) // 3))]
            have = len(tokenizer.encode(" ".join(out), add_special_tokens=False))
        return " ".join(out)

    system = text(args.system)
    whole, reused = [], []
    for i in range(args.requests):
        prompt = f"{system}\nQuestion {i}: {text(args.question)}\nAnswer:"
        want, a = timed(tokenizer.encode, prompt)
        got, b = timed(prompts.encode, prompt)
        assert got == list(want), "PromptTokenizer differs from the tokenizer"
        whole.append(a)
        reused.append(b)
    report("server", whole[1:], reused[1:], len(want))

    messages = [{"role": "system", "content": text(args.context // args.turns)}]
    whole, reused = [], []
    for _ in range(args.turns):
        messages.append({"role": "user", "content": text(args.context // args.turns)})
        kw = {"add_generation_prompt": True}
        want, a = timed(tokenizer.apply_chat_template, messages, tokenize=True, **kw)
        got, b = timed(prompts.apply_chat_template, messages, **kw)
        assert got == list(want), "PromptTokenizer differs from the chat template's tokens"
        whole.append(a)
        reused.append(b)
        messages.append({"role": "assistant", "content": text(32)})
    report("conversation, last turn", whole[-1:], reused[-1:], len(want))
    report("conversation, every turn after the first", whole[1:], reused[1:], len(want))
    print(f"prompts that reused tokens: {prompts.hits}, tokens reused: {prompts.reused_tokens}")


if __name__ == "__main__":
    main()
