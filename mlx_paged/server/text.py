"""Text out of tokens: stop strings held back as they form, reasoning markers, and tool calls
parsed by the tokenizer's own parser."""

from __future__ import annotations

import json

from mlx_lm.generate import TextStateMachine
from mlx_lm.tokenizer_utils import TokenizerWrapper


class TextStream:
    """Incremental detokenization that never shows a stop string or text that may begin one."""

    def __init__(self, tokenizer: TokenizerWrapper, stop: tuple[str, ...]):
        self.detokenizer = tokenizer.detokenizer
        self.detokenizer.reset()
        self.stop = stop
        self.held = ""  # text withheld: it may be the start of a stop string
        self.matched: str | None = None  # the stop string that ended the text

    def add(self, token: int) -> tuple[str, bool]:
        """Feed a token; return the text now safe to show and whether a stop string ended it."""
        self.detokenizer.add_token(token)
        return self._cut(self.held + self.detokenizer.last_segment)

    def finish(self) -> str:
        """Flush at the end of generation: the rest of the text, up to any stop string."""
        self.detokenizer.finalize()
        text, _ = self._cut(self.held + self.detokenizer.last_segment, final=True)
        return text

    def _cut(self, text: str, final: bool = False) -> tuple[str, bool]:
        hits = [(i, s) for i, s in ((text.find(s), s) for s in self.stop) if i >= 0]
        if hits:
            self.held = ""
            at, self.matched = min(hits, key=lambda h: h[0])
            return text[:at], True
        keep = 0 if final else _prefix_overlap(text, self.stop)
        self.held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep], False


def _prefix_overlap(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest end of ``text`` that is a proper start of a stop string."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best


def thinking_machine(tokenizer: TokenizerWrapper) -> TextStateMachine | None:
    """mlx-lm's text state machine for a thinking model's reasoning markers, or ``None``
    when the tokenizer has none. Tool-call markers are left in the text."""
    if not tokenizer.has_thinking:
        return None
    return TextStateMachine(
        {
            "normal": [(tokenizer.think_start, "reasoning")],
            "reasoning": [(tokenizer.think_end, "normal")],
        }
    )


def initial_state(tokenizer: TokenizerWrapper, prompt: list[int]) -> str:
    """``"reasoning"`` when the prompt leaves the model inside a thinking block (a chat
    template that opens it), as mlx_lm.server decides."""
    state = "normal"
    if tokenizer.has_thinking and tokenizer.rfind_think_start(prompt) > tokenizer.rfind_think_end(
        prompt
    ):
        state = "reasoning"
    return tokenizer.response_initial_state or state


def parse_call(
    tokenizer: TokenizerWrapper, text: str, tools: list[dict] | None
) -> list[tuple[str, str]] | None:
    """A generated call's ``(name, arguments JSON)`` pairs, parsed by the tokenizer's own
    mlx-lm parser; ``None`` when it does not parse (it stays text)."""
    try:
        parsed = tokenizer.tool_parser(text, tools)
        parsed = parsed if isinstance(parsed, list) else [parsed]
        return [(c["name"], json.dumps(c.get("arguments", {}), ensure_ascii=False)) for c in parsed]
    except Exception:  # the model's text, in any shape: never a 500
        return None
