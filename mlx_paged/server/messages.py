"""Request bodies of the Anthropic Messages API, and their translation to chat messages.

``POST /v1/messages`` and ``POST /v1/messages/count_tokens`` take Anthropic's
shape: a ``system`` prompt apart, content as typed blocks (``text``,
``tool_use``, ``tool_result``), tools with an ``input_schema``. The app turns a
request into the OpenAI-style messages and tools that chat templates read, so
both APIs share one template path, one engine and one prefix index.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class TextBlock(BaseModel):
    type: Literal["text"]
    text: str


class ThinkingBlock(BaseModel):
    """A thinking model's earlier reasoning, sent back by the client (not shown again)."""

    model_config = ConfigDict(extra="allow")

    type: Literal["thinking", "redacted_thinking"]


class ToolUseBlock(BaseModel):
    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    input: dict[str, Any]


class ToolResultBlock(BaseModel):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: str | list[TextBlock] = ""
    is_error: bool = False

    def text(self) -> str:
        content = self.content
        text = content if isinstance(content, str) else "".join(b.text for b in content)
        return f"Error: {text}" if self.is_error else text


Block = Annotated[
    TextBlock | ThinkingBlock | ToolUseBlock | ToolResultBlock, Field(discriminator="type")
]


class Message(BaseModel):
    role: Literal["user", "assistant"]
    content: str | list[Block]

    def blocks(self) -> list:
        if isinstance(self.content, str):
            return [TextBlock(type="text", text=self.content)]
        return self.content


class AnthropicTool(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: str = Field(min_length=1)
    description: str | None = None
    input_schema: dict[str, Any]


class ToolChoice(BaseModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class CountTokensRequest(BaseModel):
    """``POST /v1/messages/count_tokens``. Unknown fields are ignored."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    system: str | list[TextBlock] | None = None
    messages: list[Message] = Field(min_length=1)
    tools: list[AnthropicTool] | None = None
    tool_choice: ToolChoice | None = None

    @model_validator(mode="after")
    def _choice(self) -> CountTokensRequest:
        choice, names = self.tool_choice, [t.name for t in self.tools or []]
        if choice is None:
            return self
        if choice.type == "tool" and choice.name not in names:
            raise ValueError(
                f"tool_choice names {choice.name!r}, which is not among the tools "
                f"({', '.join(names) or 'none given'})"
            )
        if choice.type == "any" and not names:
            raise ValueError("tool_choice 'any' needs tools")
        return self

    def chat_messages(self) -> list[dict[str, Any]]:
        """The conversation as chat-template messages (OpenAI's roles and tool calls).

        Raises:
            ValueError: for blocks in the wrong role, or a ``tool_result`` that
                answers no ``tool_use`` of the assistant turn before it.
        """
        out: list[dict[str, Any]] = []
        if self.system:
            system = self.system
            text = system if isinstance(system, str) else "".join(b.text for b in system)
            out.append({"role": "system", "content": text})
        calls: set[str] = set()  # tool_use ids of the last assistant turn
        for i, message in enumerate(self.messages):
            where = f"messages.{i}"
            if message.role == "assistant":
                out.append(_assistant(message, where))
                calls = {c["id"] for c in out[-1].get("tool_calls", [])}
                continue
            text = []
            for block in message.blocks():
                if isinstance(block, ToolResultBlock):
                    if block.tool_use_id not in calls:
                        raise ValueError(
                            f"{where}: tool_result answers {block.tool_use_id!r}, which is not "
                            "a tool_use of the assistant turn before it"
                        )
                    out.append(
                        {"role": "tool", "tool_call_id": block.tool_use_id, "content": block.text()}
                    )
                elif isinstance(block, TextBlock):
                    text.append(block.text)
                else:
                    raise ValueError(f"{where}: a user turn cannot hold {block.type} blocks")
            if text:
                out.append({"role": "user", "content": "".join(text)})
            calls = set()
        return out

    def chat_tools(self) -> list[dict[str, Any]] | None:
        """The tools as chat templates read them (none under ``tool_choice: none``)."""
        if not self.tools or (self.tool_choice and self.tool_choice.type == "none"):
            return None
        return [
            {
                "type": "function",
                "function": {
                    "name": t.name,
                    **({"description": t.description} if t.description else {}),
                    "parameters": t.input_schema,
                },
            }
            for t in self.tools
        ]

    @property
    def forced_tool(self) -> bool:
        """Whether tool_choice demands a call (``any`` or a named ``tool``)."""
        return self.tool_choice is not None and self.tool_choice.type in ("any", "tool")

    @property
    def forced_name(self) -> str | None:
        choice = self.tool_choice
        return choice.name if choice is not None and choice.type == "tool" else None

    @property
    def parallel_tool_calls(self) -> bool:
        return self.tool_choice is None or not self.tool_choice.disable_parallel_tool_use


class MessagesRequest(CountTokensRequest):
    """``POST /v1/messages``: ``max_tokens`` is required, as Anthropic's API requires it."""

    max_tokens: int = Field(ge=1)
    stop_sequences: list[Annotated[str, Field(min_length=1)]] | None = None
    stream: bool = False
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    metadata: dict[str, Any] | None = None

    def sampling(self) -> dict[str, Any]:
        """The sampling fields the client sent, under the OpenAI schema's names."""
        fields = {"max_tokens": self.max_tokens, "stream": self.stream}
        for name in ("temperature", "top_p", "top_k"):
            if getattr(self, name) is not None:
                fields[name] = getattr(self, name)
        return fields


def _assistant(message: Message, where: str) -> dict[str, Any]:
    text, calls = [], []
    for block in message.blocks():
        if isinstance(block, TextBlock):
            text.append(block.text)
        elif isinstance(block, ToolUseBlock):
            # Templates read a call's arguments as an object.
            function = {"name": block.name, "arguments": block.input}
            calls.append({"id": block.id, "type": "function", "function": function})
        elif isinstance(block, ToolResultBlock):
            raise ValueError(f"{where}: an assistant turn cannot hold tool_result blocks")
    out: dict[str, Any] = {"role": "assistant", "content": "".join(text)}
    if calls:
        out["tool_calls"] = calls
    return out


def tool_input(arguments: str) -> dict[str, Any]:
    """A generated call's arguments (JSON text) as a ``tool_use`` block's ``input``."""
    value = json.loads(arguments)
    return value if isinstance(value, dict) else {"value": value}
