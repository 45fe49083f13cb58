"""OpenAI-shaped bodies: whole responses, SSE chunks and log-probs."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from mlx_lm.tokenizer_utils import TokenizerWrapper

from .config import ServerConfig
from .run import Run
from .schemas import SamplingParams


def _token_text(tokenizer: TokenizerWrapper, token: int) -> str:
    return tokenizer.decode([token])


def _chat_logprobs(tokenizer: TokenizerWrapper, tokens: list[int], logprobs: list) -> dict:
    content = []
    for t, (lp, top) in zip(tokens, logprobs, strict=False):
        text = _token_text(tokenizer, t)
        content.append(
            {
                "token": text,
                "logprob": lp,
                "bytes": list(text.encode()),
                "top_logprobs": [
                    {
                        "token": (s := _token_text(tokenizer, i)),
                        "logprob": v,
                        "bytes": list(s.encode()),
                    }
                    for i, v in top
                ],
            }
        )
    return {"content": content}


def _completion_logprobs(tokenizer: TokenizerWrapper, tokens: list[int], logprobs: list) -> dict:
    texts = [_token_text(tokenizer, t) for t in tokens[: len(logprobs)]]
    offsets, at = [], 0
    for s in texts:
        offsets.append(at)
        at += len(s)
    return {
        "tokens": texts,
        "token_logprobs": [lp for lp, _ in logprobs],
        "top_logprobs": [{_token_text(tokenizer, i): v for i, v in top} for _, top in logprobs],
        "text_offset": offsets,
    }


def response_body(
    run: Run,
    kind: str,
    config: ServerConfig,
    tokenizer: TokenizerWrapper,
    body: SamplingParams,
    want_logprobs: bool,
) -> dict:
    choices = []
    for i in range(len(run.jobs)):
        lp, calls = None, []
        if kind == "chat.completion":
            if want_logprobs:
                lp = _chat_logprobs(tokenizer, run.tokens[i], run.logprobs[i])
            calls = openai_calls(run.tool_calls[i])
            message = {"role": "assistant", "content": run.text[i]}
            if run.reasoning[i]:
                message["reasoning_content"] = run.reasoning[i]
            if calls:
                message["tool_calls"] = calls
                message["content"] = message["content"] or None
            choice = {"index": i, "message": message}
        else:
            if want_logprobs:
                lp = _completion_logprobs(tokenizer, run.tokens[i], run.logprobs[i])
            text = run.text[i]
            if getattr(body, "echo", False):
                prompt = body.prompt
                text = (prompt if isinstance(prompt, str) else tokenizer.decode(prompt)) + text
            choice = {"index": i, "text": text}
        reason = _finish_reason(run.finish[i])
        if reason == "stop" and calls:
            reason = "tool_calls"
        choice.update(logprobs=lp, finish_reason=reason)
        choices.append(choice)
    return {
        "id": ("chatcmpl-" if kind == "chat.completion" else "cmpl-") + run.id,
        "object": kind,
        "created": run.created,
        "model": config.model_id,
        "choices": choices,
        "usage": run.usage(),
    }


def openai_calls(calls: list[tuple[str, str]], start: int | None = None) -> list[dict]:
    """OpenAI ``tool_calls`` entries for ``(name, arguments JSON)`` pairs; a stream's
    entries carry their ``index`` from ``start``."""
    out = []
    for k, (name, arguments) in enumerate(calls):
        call = {
            "id": f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {"name": name, "arguments": arguments},
        }
        if start is not None:
            call = {"index": start + k, **call}
        out.append(call)
    return out


def _finish_reason(reason: str | None) -> str | None:
    # An aborted choice (a timeout) ended early: OpenAI's nearest reason is "length".
    return "length" if reason == "abort" else reason


async def stream_chunks(
    run: Run,
    request: Request,
    body: SamplingParams,
    kind: str,
    config: ServerConfig,
    tokenizer: TokenizerWrapper,
) -> AsyncIterator[str]:
    """SSE chunks as the jobs produce them; aborts the jobs if the client goes away."""
    chat = kind == "chat.completion"
    base = {
        "id": ("chatcmpl-" if chat else "cmpl-") + run.id,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": run.created,
        "model": config.model_id,
    }
    head = _sse_head(base)
    want_logprobs = run.jobs[0].logprobs is not None
    calls_made = [0] * len(run.jobs)
    deadline = None if config.request_timeout is None else time.monotonic() + config.request_timeout
    try:
        if chat:
            for i in range(len(run.jobs)):
                delta = {"role": "assistant", "content": ""}
                yield _sse(
                    base, [{"index": i, "delta": delta, "logprobs": None, "finish_reason": None}]
                )
        while not run.done():
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                error = {"message": "the request ran past its timeout.", "type": "timeout"}
                yield f"data: {_json({'error': error})}\n\n"
                break
            try:
                i, out = await run.next(min(1.0, left) if left is not None else 1.0)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    return
                continue
            run.add(i, out)
            if out.error is not None:
                error = {"message": f"generation failed: {out.error}", "type": "server_error"}
                yield f"data: {_json({'error': error})}\n\n"
                continue
            lp = None
            if want_logprobs and out.tokens:
                lp = (_chat_logprobs if chat else _completion_logprobs)(
                    tokenizer, list(out.tokens), list(out.logprobs)
                )
            finish = _finish_reason(out.finish_reason)
            if chat:
                delta = {"content": out.text} if out.text else {}
                if out.reasoning:
                    delta["reasoning_content"] = out.reasoning
                if out.tool_calls:
                    calls = openai_calls(list(out.tool_calls), start=calls_made[i])
                    delta["tool_calls"] = calls
                    calls_made[i] += len(calls)
                if finish == "stop" and calls_made[i]:
                    finish = "tool_calls"
                choice = {"index": i, "delta": delta}
            else:
                choice = {"index": i, "text": out.text}
            choice.update(logprobs=lp, finish_reason=finish)
            if choice.get("delta") or out.text or finish is not None or lp is not None:
                yield f"{head}{_json([choice])}}}\n\n"
        if body.stream_options is not None and body.stream_options.include_usage:
            yield _sse(base, [], usage=run.usage())
        yield "data: [DONE]\n\n"
    finally:
        run.abort()


def _sse(base: dict, choices: list, **extra) -> str:
    return f"data: {_json({**base, 'choices': choices, **extra})}\n\n"


def _sse_head(base: dict) -> str:
    """What ``_sse(base, choices)`` writes before its choices' JSON, which a closing
    brace and the blank line then end: one stream's chunks share it, encoded once."""
    return f"data: {_json({**base, 'choices': None})[: -len('null}')]}"


def _json(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
