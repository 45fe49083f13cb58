"""The FastAPI app: OpenAI-compatible endpoints over an ``EngineWorker``.

Handlers never call MLX: they tokenize, check, hand ``Job``s to the engine
thread and wait on an ``asyncio.Queue`` that the thread feeds through
``loop.call_soon_threadsafe``. A client that disconnects, or a request that
runs past its timeout, has its jobs aborted; their blocks are freed or parked.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p
from mlx_lm.tokenizer_utils import TokenizerWrapper
from starlette.exceptions import HTTPException

from .metrics import metrics_registry, render
from .schemas import ChatRequest, CompletionRequest, SamplingParams
from .worker import EngineWorker, Job, Output


@dataclass
class ServerConfig:
    """What the app needs besides the worker."""

    model_id: str
    context_length: int | None = None  # the model's; None: unknown, not checked
    default_max_tokens: int = 512
    max_queue: int = 256  # jobs waiting for admission beyond which requests get 429
    request_timeout: float | None = None  # seconds; None: no limit
    chat_template_args: dict[str, Any] = field(default_factory=dict)


class APIError(Exception):
    """An error returned as an OpenAI-style JSON body."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", **extra):
        super().__init__(message)
        self.status, self.message, self.kind, self.extra = status, message, kind, extra

    def response(self) -> JSONResponse:
        body = {"message": self.message, "type": self.kind, "param": None, "code": None}
        body.update(self.extra)
        return JSONResponse({"error": body}, status_code=self.status)


def make_request_sampler(
    temperature: float, top_p: float, top_k: int, min_p: float, seed: int | None
) -> Callable[[mx.array], mx.array] | None:
    """A sampler over log-probs ``(1, V)`` with its own random stream when ``seed`` is given.

    ``None`` (greedy) at temperature 0. MLX work happens only when the engine
    thread calls it.
    """
    if temperature == 0:
        return None
    key: list[mx.array] = []

    def sample(logprobs: mx.array) -> mx.array:
        x = logprobs
        if top_k > 0:
            x = apply_top_k(x, top_k)
        if top_p < 1.0:
            x = apply_top_p(x, top_p)
        if min_p > 0.0:
            x = apply_min_p(x, min_p)
        if seed is None:
            return mx.random.categorical(x * (1.0 / temperature))
        if not key:
            key.append(mx.random.key(seed))
        key[0], sub = mx.random.split(key[0])
        return mx.random.categorical(x * (1.0 / temperature), key=sub)

    return sample


def create_app(worker: EngineWorker, config: ServerConfig) -> FastAPI:
    """The server's FastAPI app over a started ``worker`` (the caller stops it)."""
    app = FastAPI(title="mlx_paged.server")
    tokenizer = worker.tokenizer
    registry = metrics_registry(lambda: worker.stats, lambda: worker.queued)
    app.state.accepting = True

    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError) -> JSONResponse:
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, e: RequestValidationError) -> JSONResponse:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc'][1:]) or 'body'}: {err['msg']}"
            for err in e.errors()
        )
        return APIError(400, f"invalid request: {problems}").response()

    @app.exception_handler(HTTPException)
    async def _http(_: Request, e: HTTPException) -> JSONResponse:
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return APIError(e.status_code, str(e.detail), kind).response()

    @app.get("/health")
    async def health() -> Response:
        if not worker.ready.is_set() or worker.load_error is not None:
            return JSONResponse({"status": "loading"}, status_code=503)
        return JSONResponse({"status": "ok", "model": config.model_id})

    @app.get("/v1/models")
    async def models() -> dict:
        card = {"id": config.model_id, "object": "model", "created": 0, "owned_by": "mlx_paged"}
        return {"object": "list", "data": [card]}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(render(registry), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        if isinstance(body.prompt, str):
            tokens = tokenizer.encode(body.prompt)
        else:
            tokens = list(body.prompt)
        return await _serve(request, body, tokens, "text_completion", body.logprobs)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request) -> Response:
        messages = [m.text() for m in body.messages]
        try:
            tokens = tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True, **config.chat_template_args
            )
        except Exception as e:  # a template that rejects these messages
            raise APIError(400, f"the chat template rejected the messages: {e}") from e
        if isinstance(tokens, dict):  # some tokenizers return a BatchEncoding
            tokens = tokens["input_ids"]
        top = (body.top_logprobs or 0) if body.logprobs else None
        return await _serve(request, body, list(tokens), "chat.completion", top)

    async def _serve(
        request: Request, body: SamplingParams, tokens: list[int], kind: str, logprobs: int | None
    ) -> Response:
        if body.model is not None and body.model != config.model_id:
            raise APIError(
                404,
                f"the model {body.model!r} does not exist; this server serves {config.model_id!r}.",
                "not_found_error",
                code="model_not_found",
            )
        max_tokens = _check_lengths(tokens, body.max_tokens, config)
        if not app.state.accepting:
            raise APIError(503, "the server is shutting down.", "service_unavailable")
        if worker.queued + body.n > config.max_queue:
            raise APIError(
                429,
                f"{worker.queued} requests are already waiting (limit {config.max_queue}); "
                "retry later.",
                "rate_limit_exceeded",
            )
        run = Run(worker, tokens, body, max_tokens, logprobs)
        await run.start()
        if body.stream:
            return StreamingResponse(
                _stream(run, request, body, kind, config, tokenizer),
                media_type="text/event-stream",
            )
        try:
            await run.collect(request, config.request_timeout)
        finally:
            run.abort()
        return JSONResponse(_response(run, kind, config, tokenizer, body, logprobs is not None))

    return app


def _check_lengths(tokens: list[int], max_tokens: int | None, config: ServerConfig) -> int:
    """``max_tokens`` to use; raise APIError when the prompt and it overflow the context."""
    context = config.context_length
    if context is None:
        return max_tokens or config.default_max_tokens
    if len(tokens) >= context:
        raise APIError(
            400,
            f"the prompt has {len(tokens)} tokens; the model's context is {context}.",
            code="context_length_exceeded",
        )
    if max_tokens is None:
        return min(config.default_max_tokens, context - len(tokens))
    if len(tokens) + max_tokens > context:
        raise APIError(
            400,
            f"the prompt's {len(tokens)} tokens plus max_tokens={max_tokens} exceed the model's "
            f"context of {context}.",
            code="context_length_exceeded",
        )
    return max_tokens


class Run:
    """The ``n`` jobs of one HTTP request and what they have produced so far."""

    def __init__(
        self,
        worker: EngineWorker,
        tokens: list[int],
        body: SamplingParams,
        max_tokens: int,
        logprobs: int | None,
    ):
        self.worker = worker
        self.id = f"{uuid.uuid4().hex[:24]}"
        self.created = int(time.time())
        self.prompt_tokens = len(tokens)
        self.queue: asyncio.Queue[tuple[int, Output]] = asyncio.Queue()
        loop = asyncio.get_running_loop()
        self.jobs = []
        for i in range(body.n):
            seed = None if body.seed is None else body.seed + i
            sampler = make_request_sampler(
                body.temperature, body.top_p, body.top_k, body.min_p, seed
            )

            def deliver(out: Output, i: int = i) -> None:
                loop.call_soon_threadsafe(self.queue.put_nowait, (i, out))

            job = Job(list(tokens), max_tokens, deliver, sampler, logprobs=logprobs)
            job.stop = tuple(body.stop or ())
            self.jobs.append(job)
        self.text = [""] * body.n
        self.tokens: list[list[int]] = [[] for _ in range(body.n)]
        self.logprobs: list[list] = [[] for _ in range(body.n)]
        self.finish: list[str | None] = [None] * body.n
        self.cached = [0] * body.n
        self.error: str | None = None
        self.early: list[tuple[int, Output]] = []

    async def start(self) -> None:
        """Submit the jobs; raise APIError (aborting the rest) if the engine refuses one.

        Each job's first output says whether the engine took it; outputs that
        follow it before every job has answered are kept for ``next``.
        """
        for job in self.jobs:
            self.worker.submit(job)
        pending = set(range(len(self.jobs)))
        error = None
        while pending:
            i, out = await self.queue.get()
            if i not in pending:
                self.early.append((i, out))
                continue
            pending.discard(i)
            if out.error is not None:
                error = error or out.error
                self.finish[i] = "error"
        if error is not None:
            self.abort()
            raise APIError(400, error)

    def done(self) -> bool:
        return all(f is not None for f in self.finish)

    def add(self, i: int, out: Output) -> None:
        """Record one output of job ``i``."""
        if out.error is not None:
            self.finish[i] = "error"
            self.error = out.error
            return
        self.text[i] += out.text
        self.tokens[i] += out.tokens
        self.logprobs[i] += out.logprobs
        if out.finish_reason is not None:
            self.finish[i] = out.finish_reason
            self.cached[i] = out.cached_tokens

    async def next(self, timeout: float | None) -> tuple[int, Output]:
        """The next output of any job (TimeoutError after ``timeout`` seconds)."""
        if self.early:
            return self.early.pop(0)
        return await asyncio.wait_for(self.queue.get(), timeout)

    async def collect(self, request: Request, timeout: float | None) -> None:
        """Wait for every job to finish, aborting on a client disconnect or the timeout.

        The client is checked about once a second, whether or not tokens are
        arriving: a request that keeps generating must not outlive its client.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        check = time.monotonic() + 1.0
        while not self.done():
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise APIError(504, f"the request ran past its {timeout} s timeout.", "timeout")
            try:
                i, out = await self.next(min(1.0, left) if left is not None else 1.0)
            except asyncio.TimeoutError:
                pass
            else:
                self.add(i, out)
            if time.monotonic() >= check:
                if await request.is_disconnected():
                    return
                check = time.monotonic() + 1.0
        if "error" in self.finish:
            raise APIError(500, f"generation failed: {self.error}", "server_error")

    def abort(self) -> None:
        """Abort the jobs still running (a no-op for finished ones)."""
        for job, f in zip(self.jobs, self.finish, strict=True):
            if f is None:
                self.worker.abort(job)

    def usage(self) -> dict:
        completion = sum(len(t) for t in self.tokens)
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": self.prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": min(self.cached)},
        }


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


def _response(
    run: Run,
    kind: str,
    config: ServerConfig,
    tokenizer: TokenizerWrapper,
    body: SamplingParams,
    want_logprobs: bool,
) -> dict:
    choices = []
    for i in range(len(run.jobs)):
        lp = None
        if kind == "chat.completion":
            if want_logprobs:
                lp = _chat_logprobs(tokenizer, run.tokens[i], run.logprobs[i])
            choice = {"index": i, "message": {"role": "assistant", "content": run.text[i]}}
        else:
            if want_logprobs:
                lp = _completion_logprobs(tokenizer, run.tokens[i], run.logprobs[i])
            text = run.text[i]
            if getattr(body, "echo", False):
                prompt = body.prompt
                text = (prompt if isinstance(prompt, str) else tokenizer.decode(prompt)) + text
            choice = {"index": i, "text": text}
        choice.update(logprobs=lp, finish_reason=_finish_reason(run.finish[i]))
        choices.append(choice)
    return {
        "id": ("chatcmpl-" if kind == "chat.completion" else "cmpl-") + run.id,
        "object": kind,
        "created": run.created,
        "model": config.model_id,
        "choices": choices,
        "usage": run.usage(),
    }


def _finish_reason(reason: str | None) -> str | None:
    # An aborted choice (a timeout) ended early: OpenAI's nearest reason is "length".
    return "length" if reason == "abort" else reason


async def _stream(
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
    want_logprobs = run.jobs[0].logprobs is not None
    deadline = None if config.request_timeout is None else time.monotonic() + config.request_timeout
    started = [False] * len(run.jobs)
    try:
        if chat:
            for i in range(len(run.jobs)):
                delta = {"role": "assistant", "content": ""}
                yield _sse(
                    base, [{"index": i, "delta": delta, "logprobs": None, "finish_reason": None}]
                )
                started[i] = True
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
                choice = {"index": i, "delta": {"content": out.text} if out.text else {}}
            else:
                choice = {"index": i, "text": out.text}
            choice.update(logprobs=lp, finish_reason=finish)
            if out.text or finish is not None or lp is not None:
                yield _sse(base, [choice])
        if body.stream_options is not None and body.stream_options.include_usage:
            yield _sse(base, [], usage=run.usage())
        yield "data: [DONE]\n\n"
    finally:
        run.abort()


def _sse(base: dict, choices: list, **extra) -> str:
    return f"data: {_json({**base, 'choices': choices, **extra})}\n\n"


def _json(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
