"""A request's jobs on the engine thread, and the samplers they run with.

A ``Run`` is the ``n`` jobs (choices) of one HTTP request: it submits them to
the ``EngineWorker``, gathers what they produce from an ``asyncio.Queue`` the
engine thread feeds, and aborts them when the client goes away. The engine
thread posts outputs through the event loop's ``Mailbox``, which wakes the loop
once for all the outputs it has gathered by then (a step's tokens for every
stream) instead of once per token.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
import weakref
from dataclasses import dataclass
from typing import Any

from fastapi import Request

from ..engine.request import TokenConstraint
from .config import APIError
from .sampling import make_request_sampler
from .schemas import SamplingParams
from .worker import EngineWorker, Job, Output


@dataclass
class ChatShape:
    """What a chat request asks of its jobs beyond sampling.

    ``reasoning``: split a thinking model's reasoning off. ``tools``: the tools the
    template showed (calls are cut out of the text). ``constraints``: one grammar per
    job (``response_format`` or a forced call). ``forced``: the output is a forced
    tool call's JSON, of the function ``forced_name`` (``None``: any, as a list).
    """

    reasoning: bool = False
    tools: list[dict] | None = None
    constraints: list[TokenConstraint] | None = None
    forced: bool = False
    forced_name: str | None = None
    schema: dict | None = None  # the constraints' JSON schema (other ranks rebuild them)


class Mailbox:
    """Carries items from other threads into one event loop's ``asyncio.Queue``s.

    ``post`` may be called from any thread. The first item posted since the
    loop last drained the mailbox schedules one drain; later ones ride along.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop):
        # Weak: the registry below maps the loop to this mailbox, and must not keep it.
        self._loop = weakref.ref(loop)
        self._lock = threading.Lock()
        self._items: list[tuple[asyncio.Queue, Any]] = []

    def post(self, queue: asyncio.Queue, item: Any) -> None:
        """Put ``item`` into ``queue`` on the loop's thread, soon (dropped if the loop is
        gone: nothing waits on its queues then)."""
        with self._lock:
            self._items.append((queue, item))
            if len(self._items) > 1:
                return  # a drain is already scheduled
        loop = self._loop()
        if loop is not None:
            loop.call_soon_threadsafe(self._drain)

    def _drain(self) -> None:
        with self._lock:
            items, self._items = self._items, []
        for queue, item in items:
            queue.put_nowait(item)


_mailboxes: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Mailbox] = (
    weakref.WeakKeyDictionary()
)


def mailbox(loop: asyncio.AbstractEventLoop) -> Mailbox:
    """The ``Mailbox`` of ``loop`` (made on first use, by the loop's own thread)."""
    box = _mailboxes.get(loop)
    if box is None:
        box = _mailboxes[loop] = Mailbox(loop)
    return box


class Run:
    """The ``n`` jobs of one HTTP request and what they have produced so far."""

    def __init__(
        self,
        worker: EngineWorker,
        tokens: list[int],
        body: SamplingParams,
        max_tokens: int,
        logprobs: int | None,
        xtc_special_tokens: list[int] | None = None,
        shape: ChatShape | None = None,
    ):
        shape = shape or ChatShape()
        self.worker = worker
        self.id = f"{uuid.uuid4().hex[:24]}"
        self.created = int(time.time())
        self.prompt_tokens = len(tokens)
        self.queue: asyncio.Queue[tuple[int, Output]] = asyncio.Queue()
        box = mailbox(asyncio.get_running_loop())
        self.jobs = []
        for i in range(body.n):
            seed = None if body.seed is None else body.seed + i
            xtc = (body.xtc_probability, body.xtc_threshold, list(xtc_special_tokens or []))
            sampling = (body.temperature, body.top_p, body.top_k, body.min_p, seed, xtc)
            sampler = make_request_sampler(*sampling)

            def deliver(out: Output, i: int = i) -> None:
                box.post(self.queue, (i, out))

            job = Job(list(tokens), max_tokens, deliver, sampler, logprobs=logprobs)
            job.sampling, job.schema = sampling, shape.schema
            job.logits = body.logits_settings()
            job.split_reasoning = shape.reasoning
            job.tools = shape.tools
            job.constraint = shape.constraints[i] if shape.constraints else None
            job.forced, job.forced_name = shape.forced, shape.forced_name
            job.stop = tuple(body.stop or ())
            self.jobs.append(job)
        self.text = [""] * body.n
        self.reasoning = [""] * body.n
        # Per job, (name, arguments JSON) of each tool call.
        self.tool_calls: list[list[tuple[str, str]]] = [[] for _ in range(body.n)]
        self.tokens: list[list[int]] = [[] for _ in range(body.n)]
        self.logprobs: list[list] = [[] for _ in range(body.n)]
        self.finish: list[str | None] = [None] * body.n
        self.cached = [0] * body.n
        self.stop_sequence: list[str | None] = [None] * body.n
        self.error: str | None = None
        self.early: list[tuple[int, Output]] = []
        # When the handler began and the first-token histograms (``FirstTokenTimes``), if
        # its first tokens are to be recorded; when the jobs were submitted.
        self.timing: tuple[float, Any] | None = None
        self.submitted = 0.0
        self.first_seen = [False] * body.n

    async def start(self) -> None:
        """Submit the jobs; raise APIError (aborting the rest) if the engine refuses one.

        Each job's first output says whether the engine took it; outputs that
        follow it before every job has answered are kept for ``next``.
        """
        self.submitted = time.perf_counter()
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
        if out.tokens and not self.first_seen[i]:
            self.first_seen[i] = True
            if self.timing is not None:
                received, times = self.timing
                job = self.jobs[i]
                times.observe(received, self.submitted, job.request, time.perf_counter())
        self.text[i] += out.text
        self.reasoning[i] += out.reasoning
        self.tool_calls[i] += out.tool_calls
        self.tokens[i] += out.tokens
        self.logprobs[i] += out.logprobs
        if out.finish_reason is not None:
            self.finish[i] = out.finish_reason
            self.cached[i] = out.cached_tokens
            self.stop_sequence[i] = out.stop_sequence

    async def next(self, timeout: float | None) -> tuple[int, Output]:
        """The next output of any job (TimeoutError after ``timeout`` seconds)."""
        if self.early:
            return self.early.pop(0)
        if not self.queue.empty():  # no timer to arm when an output is waiting
            return self.queue.get_nowait()
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
