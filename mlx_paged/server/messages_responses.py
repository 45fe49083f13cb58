"""Anthropic-shaped bodies: a whole message, its streamed events, and errors."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from .config import ServerConfig
from .messages import tool_input
from .run import Run

# Anthropic's error type for each HTTP status the server returns.
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def error_response(status: int, message: str) -> JSONResponse:
    """``{"type": "error", "error": {"type", "message"}}`` with its status."""
    kind = ERROR_TYPES.get(status, "api_error")
    body = {"type": "error", "error": {"type": kind, "message": message}}
    return JSONResponse(body, status_code=status)


def usage(run: Run) -> dict[str, int]:
    """Anthropic's usage: ``input_tokens`` are those not read from the prefix index."""
    cached = run.cached[0]
    return {
        "input_tokens": run.prompt_tokens - cached,
        "output_tokens": len(run.tokens[0]),
        "cache_read_input_tokens": cached,
        "cache_creation_input_tokens": 0,
    }


def stop_reason(run: Run) -> tuple[str | None, str | None]:
    """``(stop_reason, stop_sequence)`` of the run's one job."""
    finish = run.finish[0]
    if finish in ("length", "abort"):
        return "max_tokens", None
    if run.tool_calls[0]:
        return "tool_use", None
    if run.stop_sequence[0] is not None:
        return "stop_sequence", run.stop_sequence[0]
    return ("end_turn" if finish is not None else None), None


def message_body(run: Run, config: ServerConfig) -> dict[str, Any]:
    """The whole ``message`` of a finished run."""
    content: list[dict[str, Any]] = []
    if run.reasoning[0]:
        content.append({"type": "thinking", "thinking": run.reasoning[0], "signature": ""})
    if run.text[0]:
        content.append({"type": "text", "text": run.text[0]})
    content += [_tool_use(name, arguments) for name, arguments in run.tool_calls[0]]
    reason, sequence = stop_reason(run)
    return {
        **_head(run, config),
        "content": content,
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": usage(run),
    }


async def message_events(run: Run, request: Request, config: ServerConfig) -> AsyncIterator[str]:
    """Anthropic's stream: ``message_start``, content blocks (``text_delta``,
    ``thinking_delta``, ``input_json_delta``), ``message_delta`` with the stop reason
    and usage, ``message_stop``. Aborts the run if the client goes away."""
    blocks = _Blocks()
    deadline = None if config.request_timeout is None else time.monotonic() + config.request_timeout
    try:
        start = {**_head(run, config), "content": [], "stop_reason": None, "stop_sequence": None}
        start["usage"] = {"input_tokens": run.prompt_tokens, "output_tokens": 0}
        yield _event("message_start", {"message": start})
        while not run.done():
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                yield _event("error", _error("api_error", "the request ran past its timeout."))
                return
            try:
                i, out = await run.next(min(1.0, left) if left is not None else 1.0)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    return
                continue
            run.add(i, out)
            if out.error is not None:
                yield _event("error", _error("api_error", f"generation failed: {out.error}"))
                return
            if out.reasoning:
                for e in blocks.delta(
                    "thinking", {"type": "thinking_delta", "thinking": out.reasoning}
                ):
                    yield e
            if out.text:
                for e in blocks.delta("text", {"type": "text_delta", "text": out.text}):
                    yield e
            for name, arguments in out.tool_calls:
                for e in blocks.tool_use(name, arguments):
                    yield e
        for e in blocks.close():
            yield e
        reason, sequence = stop_reason(run)
        delta = {"stop_reason": reason, "stop_sequence": sequence}
        yield _event("message_delta", {"delta": delta, "usage": usage(run)})
        yield _event("message_stop", {})
    finally:
        run.abort()


class _Blocks:
    """The stream's content blocks: which one is open, and the next index."""

    def __init__(self):
        self.index = 0
        self.open: str | None = None

    def delta(self, kind: str, delta: dict[str, Any]) -> list[str]:
        events = []
        if self.open != kind:
            events += self.close()
            empty = {"type": kind, kind: ""}
            if kind == "thinking":
                empty["signature"] = ""
            events.append(self._start(empty))
            self.open = kind
        events.append(_event("content_block_delta", {"index": self.index, "delta": delta}))
        return events

    def tool_use(self, name: str, arguments: str) -> list[str]:
        events = self.close()
        block = _tool_use(name, arguments)
        events.append(self._start({**block, "input": {}}))
        partial = {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}
        events.append(_event("content_block_delta", {"index": self.index, "delta": partial}))
        self.open = "tool_use"
        return events + self.close()

    def close(self) -> list[str]:
        if self.open is None:
            return []
        self.open = None
        self.index += 1
        return [_event("content_block_stop", {"index": self.index - 1})]

    def _start(self, block: dict[str, Any]) -> str:
        return _event("content_block_start", {"index": self.index, "content_block": block})


def _head(run: Run, config: ServerConfig) -> dict[str, Any]:
    return {"id": f"msg_{run.id}", "type": "message", "role": "assistant", "model": config.model_id}


def _tool_use(name: str, arguments: str) -> dict[str, Any]:
    return {
        "type": "tool_use",
        "id": f"toolu_{uuid.uuid4().hex[:24]}",
        "name": name,
        "input": tool_input(arguments),
    }


def _error(kind: str, message: str) -> dict[str, Any]:
    return {"error": {"type": kind, "message": message}}


def _event(kind: str, data: dict[str, Any]) -> str:
    body = json.dumps({"type": kind, **data}, ensure_ascii=False, separators=(",", ":"))
    return f"event: {kind}\ndata: {body}\n\n"
