"""A scripted model and tool-calling tokenizer for the server's protocol tests.

The model's logits force a reply token by token: it counts the tokens it has
seen in a recurrent-state slot (an ``ArraysCache``, so the engine keeps the
count per request) and answers position ``p`` with ``reply[p - len(prompt)]``.
The tokenizer is the embedded SmolLM2's with ``<tool_call>``/``</tool_call>``
and a chat template that shows tools, which mlx-lm reads as the ``json_tools``
format.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import ArraysCache

TEMPLATE = (
    "{%- if note %}<|im_start|>system\n{{ note }}<|im_end|>\n{% endif %}"
    "{%- if tools %}<|im_start|>system\nTools: {{ tools | tojson }}\n"
    'Call one as <tool_call>{"name": ..., "arguments": ...}</tool_call><|im_end|>\n{% endif %}'
    "{%- for message in messages %}<|im_start|>{{ message.role }}\n"
    "{%- if message.tool_calls %}{%- for call in message.tool_calls %}"
    "{%- set tool_call = call.function %}"
    '<tool_call>{"name": "{{ tool_call.name }}", "arguments": {{ tool_call.arguments | tojson }}}'
    "</tool_call>{%- endfor %}{%- else %}{{ message.content }}{%- endif %}<|im_end|>\n"
    "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


class Scripted(nn.Module):
    """Answers the prompt of ``length`` tokens with ``reply``, then EOS."""

    def __init__(self, vocab: int, eos: int):
        super().__init__()
        self.layers = []
        self.args = SimpleNamespace(vocab_size=vocab)
        self.vocab, self.eos = vocab, eos
        self.length, self.reply = 0, []

    def make_cache(self) -> list:
        return [ArraysCache(1)]  # tokens seen, per request

    def __call__(self, inputs: mx.array, cache=None) -> mx.array:
        b, n = inputs.shape
        seen = cache[0][0] if cache[0][0] is not None else mx.zeros((b, 1), mx.int32)
        cache[0][0] = seen + n
        nxt = []
        for p in (seen[:, 0] + n).tolist():
            k = p - self.length
            nxt.append(self.reply[k] if 0 <= k < len(self.reply) else self.eos)
        logits = mx.full((b, n, self.vocab), -30.0)
        logits[:, -1] = mx.where(mx.arange(self.vocab)[None] == mx.array(nxt)[:, None], 30.0, -30.0)
        return logits


@contextmanager
def scripted_app(path: Path) -> Iterator[tuple]:
    """(TestClient, tokenizer, model) of one in-process app over the scripted model."""
    from fastapi.testclient import TestClient
    from mlx_lm.tokenizer_utils import load as load_tokenizer
    from transformers import AutoTokenizer

    from mlx_paged import PagedEngine
    from mlx_paged.embedded import embedded_model_path
    from mlx_paged.server.app import create_app
    from mlx_paged.server.config import ServerConfig
    from mlx_paged.server.worker import EngineWorker

    hf = AutoTokenizer.from_pretrained(embedded_model_path(progress=False))
    hf.add_tokens(["<tool_call>", "</tool_call>"])
    hf.chat_template = TEMPLATE
    hf.save_pretrained(path)
    tokenizer = load_tokenizer(Path(path))
    assert tokenizer.has_tool_calling and tokenizer.tool_call_start == "<tool_call>"
    model = Scripted(len(hf), tokenizer.eos_token_id)
    worker = EngineWorker(lambda: (PagedEngine(model, block_size=8, max_batch_size=2), tokenizer))
    worker.start(60)
    try:
        with TestClient(create_app(worker, ServerConfig(model_id="scripted"))) as http:
            yield http, tokenizer, model
    finally:
        worker.stop(30)


def script(tokenizer, model, messages, reply: str, tools=(WEATHER,), **template) -> None:
    """Make ``reply`` the model's answer to ``messages`` (with ``tools``); the scripted
    model answers only a prompt of exactly that length."""
    extra = {"tools": list(tools), **template} if tools else template
    model.length = len(tokenizer.apply_chat_template(messages, add_generation_prompt=True, **extra))
    model.reply = tokenizer.encode(reply, add_special_tokens=False)
