"""The load generator of ``benchmarks/server.py``: streamed requests from one event loop or
spread over client processes, and a null server that measures the client and HTTP stack alone.

One asyncio loop running the ``openai`` client handles every chunk of every stream in turn
(an HTTP read, an SSE parse and a pydantic object each). At 32 streams and thousands of
chunks a second that loop is a queue of its own: a first token waits behind the other
streams' chunks before its time is taken. Separate users' streams do not share a loop, so
``Clients(p)`` runs each level's streams in ``p`` processes, about ``c / p`` each, started at
one instant, and pools their times.

``python benchmarks/clients.py --port PORT [--gap-ms 8]`` is the null server: it answers
``/v1/completions`` with ``max_tokens`` canned chunks, the first at once and then one every
``--gap-ms`` (8 ms is about what ``mlx_paged.server`` streams at c=32), so its time to first
token is what the client, the loopback and uvicorn take by themselves.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import time
from multiprocessing.connection import Connection

import openai


async def one(
    client, model: str, prompt: str, max_tokens: int, temperature: float = 0.0
) -> tuple[float, list[float], int]:
    """(time to first token, inter-token gaps, output tokens) of one streamed request."""
    start = time.perf_counter()
    stamps: list[float] = []
    tokens = 0
    stream = await client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=temperature,
        stream=True,
        stream_options={"include_usage": True},
    )
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            stamps.append(time.perf_counter())
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    gaps = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    return (stamps[0] - start if stamps else float("nan")), gaps, tokens or len(stamps)


async def load(
    client, model: str, prompts: list[str], concurrency: int, max_tokens: int, temp: float = 0.0
):
    """``prompts`` with ``concurrency`` in flight (a closed loop): wall seconds, and ``one``'s
    result per prompt."""
    gate = asyncio.Semaphore(concurrency)

    async def run(p: str):
        async with gate:
            return await one(client, model, p, max_tokens, temp)

    start = time.perf_counter()
    results = await asyncio.gather(*(run(p) for p in prompts))
    return time.perf_counter() - start, results


def client(port: int) -> openai.AsyncOpenAI:
    """An ``openai`` client of the server on ``port`` (retries: ``mlx_lm.server``'s listen
    backlog resets connections when many requests arrive at once)."""
    return openai.AsyncOpenAI(
        base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=5, timeout=3600
    )


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def _client_process(conn: Connection) -> None:
    """A client process: runs ``load``s sent over ``conn`` on one loop, a client per port
    kept between them (its connections stay open, as the single loop's do)."""
    loop = asyncio.new_event_loop()
    clients: dict[int, openai.AsyncOpenAI] = {}
    while True:
        try:
            job = conn.recv()
        except EOFError:  # the parent ended
            return
        if job is None:
            break
        port, model, prompts, c, max_tokens, temp, at = job
        if port not in clients:
            clients[port] = client(port)
        loop.run_until_complete(asyncio.sleep(max(0.0, at - time.perf_counter())))
        _, results = loop.run_until_complete(
            load(clients[port], model, prompts, c, max_tokens, temp)
        )
        conn.send((time.perf_counter(), results))
    for c in clients.values():
        loop.run_until_complete(c.close())


class Clients:
    """``processes`` client processes that run each level's streams between them.

    ``load`` gives process ``i`` of ``p = min(processes, concurrency)`` the prompts
    ``i, i + p, ...`` and its share of the concurrency; all start at one instant
    (``time.perf_counter`` is the machine's monotonic clock in every process).
    """

    def __init__(self, processes: int):
        self.processes = processes
        self._conns: list[Connection] = []
        self._procs: list[multiprocessing.Process] = []

    def _start(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        for _ in range(self.processes):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_client_process, args=(child,), daemon=True)
            proc.start()
            self._conns.append(parent)
            self._procs.append(proc)

    def load(
        self,
        port: int,
        model: str,
        prompts: list[str],
        concurrency: int,
        max_tokens: int,
        temp: float = 0.0,
        timeout: float | None = None,
    ) -> tuple[float, list]:
        """``load`` over the processes: wall seconds from the common start to the last
        request's end, and every request's result.

        Raises:
            TimeoutError: when the level takes over ``timeout`` seconds (the processes are
                ended; the next call starts new ones).
        """
        if not self._conns:
            self._start()
        p = min(self.processes, concurrency, len(prompts))
        at = time.perf_counter() + 0.2
        for i, conn in enumerate(self._conns[:p]):
            share = concurrency // p + (i < concurrency % p)
            conn.send((port, model, prompts[i::p], share, max_tokens, temp, at))
        deadline = None if timeout is None else at + timeout
        outs = []
        for conn in self._conns[:p]:
            left = None if deadline is None else max(0.0, deadline - time.perf_counter())
            if not conn.poll(left):
                self.close(wait=False)
                raise TimeoutError(f"a level ran past {timeout} s")
            outs.append(conn.recv())
        return max(end for end, _ in outs) - at, [r for _, res in outs for r in res]

    def close(self, wait: bool = True) -> None:
        """End the processes (``wait``: let each finish its clients first)."""
        for conn, proc in zip(self._conns, self._procs, strict=True):
            if wait:
                conn.send(None)
                proc.join(10)
            if proc.is_alive():
                proc.terminate()
        self._conns, self._procs = [], []


def null_app(gap: float):
    """A Starlette app streaming canned completions: ``max_tokens`` chunks, one every ``gap``
    seconds after the first."""
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    def chunk(choices: list, **more) -> str:
        body = {"id": "null", "object": "text_completion", "created": 0, "model": "null"}
        return f"data: {json.dumps({**body, 'choices': choices, **more})}\n\n"

    async def completions(request):
        n = int((await request.json()).get("max_tokens") or 16)

        async def stream():
            for i in range(n):
                if i:
                    await asyncio.sleep(gap)
                text = {"index": 0, "text": " x", "logprobs": None, "finish_reason": None}
                yield chunk([text])
            usage = {"prompt_tokens": 1, "completion_tokens": n, "total_tokens": n + 1}
            yield chunk([], usage=usage)
            yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    async def models(request):
        return JSONResponse({"object": "list", "data": [{"id": "null", "object": "model"}]})

    routes = [Route("/v1/completions", completions, methods=["POST"])]
    return Starlette(routes=[*routes, Route("/v1/models", models)])


def main() -> None:
    import uvicorn

    ap = argparse.ArgumentParser(description="the null server: canned streamed completions")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--gap-ms", type=float, default=8.0, help="between a stream's chunks")
    args = ap.parse_args()
    uvicorn.run(null_app(args.gap_ms / 1000), host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
