"""The server's settings and its OpenAI-style errors."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fastapi.responses import JSONResponse


@dataclass
class ServerConfig:
    """What the app needs besides the worker."""

    model_id: str
    context_length: int | None = None  # the model's; None: unknown, not checked
    default_max_tokens: int = 512
    max_queue: int = 256  # jobs waiting for admission beyond which requests get 429
    request_timeout: float | None = None  # seconds; None: no limit
    chat_template_args: dict[str, Any] = field(default_factory=dict)
    # Sampling settings for requests that leave them out: temperature, top_p, top_k, min_p.
    sampling: dict[str, float] = field(default_factory=dict)


class APIError(Exception):
    """An error returned as an OpenAI-style JSON body."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", **extra):
        super().__init__(message)
        self.status, self.message, self.kind, self.extra = status, message, kind, extra

    def response(self) -> JSONResponse:
        body = {"message": self.message, "type": self.kind, "param": None, "code": None}
        body.update(self.extra)
        return JSONResponse({"error": body}, status_code=self.status)
