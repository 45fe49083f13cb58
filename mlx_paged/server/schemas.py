"""Request bodies of the OpenAI-compatible endpoints, checked by pydantic at the boundary."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, field_validator, model_validator


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingParams(BaseModel):
    """Fields shared by both endpoints. Unknown fields are ignored, as OpenAI's are."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    # OpenAI's seeds are int64s; the sampler takes them modulo 2**64 (``make_request_sampler``).
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**64)
    stop: str | list[str] | None = None
    n: int = Field(default=1, ge=1, le=16)
    stream: bool = False
    stream_options: StreamOptions | None = None
    # mlx_lm.server's logits processors and XTC sampling, under its names and defaults.
    logit_bias: dict[StrictInt, float] | None = None
    repetition_penalty: float = Field(default=0.0, ge=0.0)
    repetition_context_size: int = Field(default=20, ge=0)
    presence_penalty: float = 0.0
    presence_context_size: int = Field(default=20, ge=0)
    frequency_penalty: float = 0.0
    frequency_context_size: int = Field(default=20, ge=0)
    xtc_probability: float = Field(default=0.0, ge=0.0, le=1.0)
    xtc_threshold: float = Field(default=0.1, ge=0.0, le=1.0)
    # mlx_lm.server's per-request model switches: refused, not ignored.
    draft_model: str | None = None
    adapters: str | None = None
    num_draft_tokens: int | None = None

    @model_validator(mode="after")
    def _one_model(self) -> SamplingParams:
        for name in ("draft_model", "adapters"):
            if getattr(self, name) not in (None, "default_model"):
                raise ValueError(
                    f"{name}: mlx_paged.server serves one model without adapters or a draft "
                    "model; leave it out"
                )
        return self

    def apply_defaults(self, defaults: dict[str, float]) -> None:
        """Set the sampling fields the request left out to the server's ``defaults``."""
        for name, value in defaults.items():
            if name not in self.model_fields_set:
                setattr(self, name, value)

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _bias(cls, v: object) -> object:
        if not isinstance(v, dict):
            return v
        try:  # JSON keys are strings: "50256": -100
            bias = {int(k): float(x) for k, x in v.items()}
        except (TypeError, ValueError):
            raise ValueError('logit_bias maps token ids to numbers, e.g. {"50256": -100}') from None
        if any(t < 0 for t in bias):
            raise ValueError("logit_bias keys are token ids: ints >= 0")
        return bias

    def logits_settings(self) -> dict[str, Any]:
        """``mlx_lm.sample_utils.make_logits_processors``' arguments."""
        return {
            "logit_bias": self.logit_bias,
            "repetition_penalty": self.repetition_penalty,
            "repetition_context_size": self.repetition_context_size,
            "presence_penalty": self.presence_penalty,
            "presence_context_size": self.presence_context_size,
            "frequency_penalty": self.frequency_penalty,
            "frequency_context_size": self.frequency_context_size,
        }

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> list[str]:
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("stop takes up to 4 non-empty strings")
        return stops


class CompletionRequest(SamplingParams):
    """``POST /v1/completions``: ``prompt`` is a string or a list of token ids."""

    prompt: str | list[StrictInt]
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v: str | list[int]) -> str | list[int]:
        if not v:
            raise ValueError("prompt is empty")
        return v


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None

    @field_validator("content")
    @classmethod
    def _text_parts(cls, v: object) -> object:
        # mlx_lm.server refuses other parts for a text model too: an image dropped in
        # silence would get an answer to a question never asked.
        for part in v if isinstance(v, list) else ():
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type")
                raise ValueError(f"only text content parts are served (got type {kind!r})")
        return v

    def text(self) -> dict[str, Any]:
        """The message as a chat template reads it: text parts joined."""
        content = self.content
        if isinstance(content, list):
            content = "".join(p.get("text", "") for p in content if p.get("type") == "text")
        out = self.model_dump(exclude_none=True)
        out["content"] = content or ""
        for call in out.get("tool_calls") or []:
            # Templates read a call's arguments as an object; OpenAI sends a JSON string.
            function = call.get("function") if isinstance(call, dict) else None
            if isinstance(function, dict) and isinstance(function.get("arguments"), str):
                try:
                    function["arguments"] = json.loads(function["arguments"])
                except json.JSONDecodeError as e:
                    raise ValueError(f"a tool call's arguments are not JSON: {e}") from None
        return out


class Function(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(BaseModel):
    """One entry of ``tools``: ``{"type": "function", "function": {...}}``."""

    type: Literal["function"] = "function"
    function: Function


class FunctionName(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    """``tool_choice`` naming one function."""

    type: Literal["function"] = "function"
    function: FunctionName


class JSONSchemaFormat(BaseModel):
    """``response_format.json_schema``: a named JSON schema."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """``response_format``: free text, any JSON object, or JSON valid under a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _needs_schema(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError('type \'json_schema\' needs a json_schema: {"name", "schema"}')
        return self


class ChatRequest(SamplingParams):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    response_format: ResponseFormat | None = None

    @model_validator(mode="after")
    def _limits(self) -> ChatRequest:
        if self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice):
            names = [t.function.name for t in self.tools or []]
            if choice.function.name not in names:
                raise ValueError(
                    f"tool_choice names {choice.function.name!r}, which is not among the "
                    f"tools ({', '.join(names) or 'none given'})"
                )
        elif choice == "required" and not self.tools:
            raise ValueError("tool_choice 'required' needs tools")
        return self

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools the chat template shows the model (none under tool_choice 'none')."""
        if not self.tools or self.tool_choice == "none":
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]

    @property
    def forced_tool(self) -> bool:
        """Whether tool_choice demands a call ('required' or a named function)."""
        return self.tool_choice == "required" or isinstance(self.tool_choice, NamedToolChoice)

    @property
    def forced_name(self) -> str | None:
        """The function a named tool_choice forces, or ``None``."""
        choice = self.tool_choice
        return choice.function.name if isinstance(choice, NamedToolChoice) else None
