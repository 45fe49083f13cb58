"""What the engine thread works on: ``Job``s, their ``Output``s, and a gathered burst.

``Gathering`` holds new jobs while others keep coming right behind them (each
within ``GATHER_GAP`` of the last), for at most ``most`` seconds. The event
loop prepares a burst's requests one at a time (template, tokens, checks); jobs
added to the engine together are admitted together, so the burst's prompts
prefill in one batched forward instead of a few at each step boundary.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..engine.request import Request, TokenConstraint
from .text import TextStream

#: Seconds within which another job must follow the last for held jobs to keep waiting.
GATHER_GAP = 0.003


@dataclass(frozen=True)
class Output:
    """What a job hears from the engine thread.

    First exactly one of: ``accepted`` (the engine queued it) or ``error`` (it
    did not, or it failed later). Then text pieces; the last one has
    ``finish_reason`` ``"stop"``, ``"length"`` or ``"abort"``.
    """

    text: str = ""
    tokens: tuple[int, ...] = ()
    logprobs: tuple[tuple[float, tuple[tuple[int, float], ...]], ...] = ()
    finish_reason: str | None = None
    accepted: bool = False
    error: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    reasoning: str = ""  # a thinking model's reasoning text (chat jobs that asked for it)
    # Tool calls completed (jobs with tools): (function name, arguments as a JSON object text).
    tool_calls: tuple[tuple[str, str], ...] = ()
    stop_sequence: str | None = None  # the stop string that ended the job, if one did


@dataclass(eq=False)
class Job:
    """One generation (one choice): its engine arguments and where its output goes."""

    tokens: list[int]
    max_tokens: int
    deliver: Callable[[Output], None]
    sampler: Any = None
    # ``make_logits_processors``' arguments: the processors are made on the engine thread,
    # after their token ids are checked against the vocabulary.
    logits: dict[str, Any] = field(default_factory=dict)
    logprobs: int | None = None
    stop: tuple[str, ...] = ()
    uid: int | None = None
    request: Request | None = None
    text: TextStream | None = None
    # Chat jobs on a thinking model: reasoning text goes apart (mlx-lm's TextStateMachine
    # state while the job runs).
    split_reasoning: bool = False
    thinking: Any = None
    # Chat jobs with tools: calls are cut out of the text by the tokenizer's markers.
    tools: list[dict] | None = None
    tool_text: str = ""  # the call being generated
    # A grammar over the output (response_format, or a forced tool call), and a forced
    # call's shape: the whole output is the call's JSON (``tool_call_schema``).
    constraint: TokenConstraint | None = None
    forced: bool = False
    forced_name: str | None = None
    # How to rebuild the sampler and the constraint on another rank: make_request_sampler's
    # arguments, and the constraint's JSON schema.
    sampling: tuple | None = None
    schema: dict | None = None


class Gathering:
    """Jobs taken from the engine thread's inbox and not yet added to the engine.

    Args:
        most: Most seconds the first held job waits (0: none is ever held).

    Raises:
        ValueError: for a negative or non-numeric ``most``.
    """

    def __init__(self, most: float):
        if isinstance(most, bool) or not isinstance(most, int | float) or not most >= 0:
            raise ValueError(f"gather must be a number of seconds >= 0, got {most!r}.")
        self.most = float(most)
        self.jobs: list[tuple[float, Job]] = []  # (when it came, the job), oldest first

    def __len__(self) -> int:
        return len(self.jobs)

    def __contains__(self, job: Job) -> bool:
        return any(held is job for _, held in self.jobs)

    def hold(self, job: Job, now: float | None = None) -> None:
        """Hold ``job``, which came ``now`` (default: the clock's time)."""
        self.jobs.append((time.perf_counter() if now is None else now, job))

    def left(self, now: float | None = None) -> float:
        """Seconds the held jobs may still wait (0 if none): until ``GATHER_GAP`` after the
        last came, and no later than ``most`` after the first."""
        if not self.jobs:
            return 0.0
        now = time.perf_counter() if now is None else now
        return max(0.0, min(self.jobs[-1][0] + GATHER_GAP, self.jobs[0][0] + self.most) - now)

    def take(self, force: bool = False, now: float | None = None) -> list[Job]:
        """The held jobs, oldest first, once they may wait no longer (or at once with
        ``force``); none while they may."""
        if not self.jobs or (not force and self.left(now) > 0):
            return []
        jobs, self.jobs = [job for _, job in self.jobs], []
        return jobs
