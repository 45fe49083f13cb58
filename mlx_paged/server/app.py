"""The FastAPI app: OpenAI- and Anthropic-compatible endpoints over an ``EngineWorker``.

Handlers never call MLX: they tokenize, check, hand ``Job``s to the engine
thread (``run.Run``) and wait on an ``asyncio.Queue`` that the thread feeds
through the loop's ``run.Mailbox``. A client that disconnects, or a request
that runs past its timeout, has its jobs aborted; their blocks are freed or
parked.
"""

from __future__ import annotations

import asyncio
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from .config import APIError, ServerConfig
from .grammar import Grammars, json_object_schema, tool_call_schema
from .messages import CountTokensRequest, MessagesRequest
from .messages_responses import error_response, message_body, message_events
from .metrics import metrics_registry, render
from .prompt_tokens import PromptTokenizer
from .responses import response_body, stream_chunks
from .run import ChatShape, Run
from .schemas import ChatRequest, CompletionRequest, SamplingParams
from .worker import EngineWorker

__all__ = ["APIError", "ServerConfig", "create_app"]


def create_app(worker: EngineWorker, config: ServerConfig) -> FastAPI:
    """The server's FastAPI app over a started ``worker`` (the caller stops it)."""
    app = FastAPI(title="mlx_paged.server")
    tokenizer = worker.tokenizer
    # What XTC never removes, as in mlx_lm.server: the newline and the end tokens.
    xtc_special = tokenizer.encode("\n") + list(tokenizer.eos_token_ids)
    grammars = Grammars(tokenizer, worker.engine.vocab_size or tokenizer.vocab_size)
    prompts = PromptTokenizer(tokenizer)  # resent prompts tokenize only what is new
    registry, first_tokens = metrics_registry(
        lambda: worker.stats,
        lambda: worker.queued,
        lambda: getattr(worker.engine, "clock", None),
        lambda: getattr(worker.engine, "disk", None),
        lambda: getattr(getattr(worker.engine, "runner", None), "compiled", None),
        lambda: worker.memory,
    )
    app.state.accepting = True

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError) -> JSONResponse:
        return _error(request, e)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, e: RequestValidationError) -> JSONResponse:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc'][1:]) or 'body'}: {err['msg']}"
            for err in e.errors()
        )
        return _error(request, APIError(400, f"invalid request: {problems}"))

    @app.exception_handler(HTTPException)
    async def _http(request: Request, e: HTTPException) -> JSONResponse:
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return _error(request, APIError(e.status_code, str(e.detail), kind))

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
        received = time.perf_counter()
        if isinstance(body.prompt, str):
            tokens = prompts.encode(body.prompt)
        else:
            tokens = list(body.prompt)
        run = await _start(body, tokens, body.logprobs, received=received)
        if body.stream:
            chunks = stream_chunks(run, request, body, "text_completion", config, tokenizer)
            return StreamingResponse(chunks, media_type="text/event-stream")
        await _collect(run, request)
        want = body.logprobs is not None
        return JSONResponse(response_body(run, "text_completion", config, tokenizer, body, want))

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request) -> Response:
        received = time.perf_counter()
        try:
            messages = [m.text() for m in body.messages]
        except ValueError as e:
            raise APIError(400, str(e), param="messages") from e
        tools = _tools(body.template_tools(), body.forced_tool)
        tokens = _template(messages, tools, body.chat_template_kwargs)
        top = (body.top_logprobs or 0) if body.logprobs else None
        shape = ChatShape(True, tools, None, body.forced_tool, body.forced_name)
        if body.forced_tool:
            shape.schema = tool_call_schema(tools, body.forced_name, body.parallel_tool_calls)
            shape.constraints = await _constraints(shape.schema, body.n, "tools")
        elif body.response_format is not None and body.response_format.type != "text":
            spec = body.response_format.json_schema
            shape.schema = spec.schema_ if spec is not None else json_object_schema()
            shape.constraints = await _constraints(shape.schema, body.n, "response_format")
        run = await _start(body, tokens, top, shape, received)
        if body.stream:
            chunks = stream_chunks(run, request, body, "chat.completion", config, tokenizer)
            return StreamingResponse(chunks, media_type="text/event-stream")
        await _collect(run, request)
        return JSONResponse(
            response_body(run, "chat.completion", config, tokenizer, body, top is not None)
        )

    @app.post("/v1/messages")
    async def messages(body: MessagesRequest, request: Request) -> Response:
        received = time.perf_counter()
        tokens, tools = _anthropic_prompt(body)
        shape = ChatShape(True, tools, None, body.forced_tool, body.forced_name)
        if body.forced_tool:
            shape.schema = tool_call_schema(tools, body.forced_name, body.parallel_tool_calls)
            shape.constraints = await _constraints(shape.schema, 1, "tools")
        params = SamplingParams(model=body.model, **body.sampling())
        params.stop = list(body.stop_sequences or [])  # no OpenAI limit of 4 here
        run = await _start(params, tokens, None, shape, received)
        if body.stream:
            events = message_events(run, request, config)
            return StreamingResponse(events, media_type="text/event-stream")
        await _collect(run, request)
        return JSONResponse(message_body(run, config))

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(body: CountTokensRequest) -> dict:
        _check_model(body.model)
        tokens, _ = _anthropic_prompt(body)
        return {"input_tokens": len(tokens)}

    def _anthropic_prompt(body: CountTokensRequest) -> tuple[list[int], list[dict] | None]:
        """The prompt's tokens and the tools the template showed, for both Anthropic routes."""
        try:
            messages = body.chat_messages()
        except ValueError as e:
            raise APIError(400, str(e)) from e
        tools = _tools(body.chat_tools(), body.forced_tool)
        return _template(messages, tools, None), tools

    def _tools(tools: list[dict] | None, forced: bool) -> list[dict] | None:
        """``tools`` unless the tokenizer cannot call them (a 400), forced calls excepted:
        the grammar makes those."""
        if tools and not tokenizer.has_tool_calling and not forced:
            raise APIError(
                400,
                "this model's tokenizer has no tool calling (mlx-lm found no tool-call format "
                "in its chat template); send the request without tools.",
                param="tools",
            )
        return tools

    def _template(messages: list[dict], tools: list[dict] | None, kwargs: dict | None) -> list:
        extra = {"tools": tools} if tools else {}
        try:
            return prompts.apply_chat_template(
                messages,
                add_generation_prompt=True,
                **extra,
                **{**config.chat_template_args, **(kwargs or {})},
            )
        except Exception as e:  # a template that rejects these messages
            raise APIError(400, f"the chat template rejected the messages: {e}") from e

    async def _constraints(schema: dict, n: int, param: str) -> list:
        """One grammar per choice; a schema the grammar engine rejects is a 400 with its
        message."""

        def compile_all() -> list:
            make = grammars.compile(schema)
            return [make() for _ in range(n)]

        try:  # compiling may take milliseconds: off the event loop
            return await asyncio.to_thread(compile_all)
        except ValueError as e:
            raise APIError(400, str(e), param=param) from e

    def _check_model(model: str | None) -> None:
        if model is not None and model != config.model_id:
            raise APIError(
                404,
                f"the model {model!r} does not exist; this server serves {config.model_id!r}.",
                "not_found_error",
                code="model_not_found",
            )

    async def _start(
        body: SamplingParams,
        tokens: list[int],
        logprobs: int | None,
        shape: ChatShape | None = None,
        received: float | None = None,
    ) -> Run:
        """Check a request against the model and the queue, and submit its jobs
        (``received``: when its handler began, for the first-token metrics)."""
        _check_model(body.model)
        max_tokens = _check_lengths(tokens, body.max_tokens, config)
        body.apply_defaults(config.sampling)
        if not app.state.accepting:
            raise APIError(503, "the server is shutting down.", "service_unavailable")
        if worker.queued + body.n > config.max_queue:
            raise APIError(
                429,
                f"{worker.queued} requests are already waiting (limit {config.max_queue}); "
                "retry later.",
                "rate_limit_exceeded",
            )
        run = Run(worker, tokens, body, max_tokens, logprobs, xtc_special, shape)
        run.timing = (received or time.perf_counter(), first_tokens)
        await run.start()
        return run

    async def _collect(run: Run, request: Request) -> None:
        try:
            await run.collect(request, config.request_timeout)
        finally:
            run.abort()

    return app


def _error(request: Request, e: APIError) -> JSONResponse:
    """An error in the shape of the API the request called."""
    if request.url.path.startswith("/v1/messages"):
        return error_response(e.status, e.message)
    return e.response()


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
