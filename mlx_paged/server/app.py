"""The FastAPI app: OpenAI-compatible endpoints over an ``EngineWorker``.

Handlers never call MLX: they tokenize, check, hand ``Job``s to the engine
thread (``run.Run``) and wait on an ``asyncio.Queue`` that the thread feeds
through ``loop.call_soon_threadsafe``. A client that disconnects, or a request
that runs past its timeout, has its jobs aborted; their blocks are freed or
parked.
"""

from __future__ import annotations

import asyncio

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from .config import APIError, ServerConfig
from .grammar import Grammars, json_object_schema, tool_call_schema
from .metrics import metrics_registry, render
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
        try:
            messages = [m.text() for m in body.messages]
        except ValueError as e:
            raise APIError(400, str(e), param="messages") from e
        tools = body.template_tools()
        if tools and not tokenizer.has_tool_calling and not body.forced_tool:
            raise APIError(
                400,
                "this model's tokenizer has no tool calling (mlx-lm found no tool-call format "
                "in its chat template); send the request without tools.",
                param="tools",
            )
        extra = {"tools": tools} if tools else {}
        try:
            tokens = tokenizer.apply_chat_template(
                messages,
                add_generation_prompt=True,
                tokenize=True,
                **extra,
                **{**config.chat_template_args, **(body.chat_template_kwargs or {})},
            )
        except Exception as e:  # a template that rejects these messages
            raise APIError(400, f"the chat template rejected the messages: {e}") from e
        if isinstance(tokens, dict):  # some tokenizers return a BatchEncoding
            tokens = tokens["input_ids"]
        top = (body.top_logprobs or 0) if body.logprobs else None
        shape = ChatShape(reasoning=True, tools=tools)
        shape.forced, shape.forced_name = body.forced_tool, body.forced_name
        shape.constraints = await _constraints(body, tools)
        return await _serve(request, body, list(tokens), "chat.completion", top, shape)

    async def _constraints(body: ChatRequest, tools: list[dict] | None) -> list | None:
        """One grammar per choice for a forced call or a JSON ``response_format``; a
        schema the grammar engine rejects is a 400 with its message."""
        if body.forced_tool:
            schema = tool_call_schema(tools, body.forced_name, body.parallel_tool_calls)
            param = "tools"
        elif body.response_format is not None and body.response_format.type != "text":
            spec = body.response_format.json_schema
            schema = spec.schema_ if spec is not None else json_object_schema()
            param = "response_format"
        else:
            return None

        def compile_all() -> list:
            make = grammars.compile(schema)
            return [make() for _ in range(body.n)]

        try:  # compiling may take milliseconds: off the event loop
            return await asyncio.to_thread(compile_all)
        except ValueError as e:
            raise APIError(400, str(e), param=param) from e

    async def _serve(
        request: Request,
        body: SamplingParams,
        tokens: list[int],
        kind: str,
        logprobs: int | None,
        shape: ChatShape | None = None,
    ) -> Response:
        if body.model is not None and body.model != config.model_id:
            raise APIError(
                404,
                f"the model {body.model!r} does not exist; this server serves {config.model_id!r}.",
                "not_found_error",
                code="model_not_found",
            )
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
        await run.start()
        if body.stream:
            return StreamingResponse(
                stream_chunks(run, request, body, kind, config, tokenizer),
                media_type="text/event-stream",
            )
        try:
            await run.collect(request, config.request_timeout)
        finally:
            run.abort()
        return JSONResponse(response_body(run, kind, config, tokenizer, body, logprobs is not None))

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
