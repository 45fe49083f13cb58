"""Request bodies of the OpenAI-compatible endpoints, checked by pydantic at the boundary."""

from __future__ import annotations

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
    seed: int | None = None
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

    def text(self) -> dict[str, Any]:
        """The message as a chat template reads it: text parts joined."""
        content = self.content
        if isinstance(content, list):
            content = "".join(p.get("text", "") for p in content if p.get("type") == "text")
        out = self.model_dump(exclude_none=True)
        out["content"] = content or ""
        return out


class ChatRequest(SamplingParams):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)

    @model_validator(mode="after")
    def _limits(self) -> ChatRequest:
        if self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self
