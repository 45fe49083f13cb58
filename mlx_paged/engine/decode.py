"""The decode step: one token for every running request, overlapped with the next step.

``Decoder.step`` schedules the running requests, builds one batched forward and
samples it lazily. With ``overlap`` it dispatches that step before reading the
previous one's tokens (``InFlight``), so the host builds step t+1 while the
device runs step t, as mlx-lm's ``generate_step`` does; the next step feeds the
tokens still on the device. The host reads a step's tokens before it needs
them: before preempting (a requeued request resumes from its tokens), and while
a request's constraint needs each token (its grammar gives the next mask).

A request that stops on a stop token has run one more token by then: its K/V
(and a hybrid model's state) are kept, so the prefix index holds one token more.
A request whose in-flight token is its ``max_tokens``-th is left out of the next
step.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import mlx.core as mx

from .picks import Picks, pick
from .request import Event, Request, Sampled
from .runner import ModelRunner
from .scheduler import Scheduler
from .timing import StepClock


class Decoder:
    """Runs decode steps over a scheduler's running requests.

    Args:
        scheduler, runner, clock: The engine's.
        rows: Rows of the model's token embedding: where a token fed back is clipped.
        overlap: Dispatch each step before reading the previous one's tokens.
    """

    def __init__(
        self,
        scheduler: Scheduler,
        runner: ModelRunner,
        clock: StepClock,
        rows: int | None,
        overlap: bool = True,
    ):
        self.scheduler, self.runner, self.clock = scheduler, runner, clock
        self.rows, self.overlap = rows, overlap
        self.in_flight: InFlight | None = None  # a dispatched step not yet read

    def step(self) -> list[Event]:
        """Decode one token for every running request; return the events read this step
        (with ``overlap``, the previous step's)."""
        scheduler, clock = self.scheduler, self.clock
        events: list[Event] = []
        before, self.in_flight = self.in_flight, None
        overlap = self.overlap and all(map(_overlaps, scheduler.running))
        if before is not None and not overlap:
            events, before = self.read(before), None
        if not scheduler.running:
            return events
        self.runner.migrate(scheduler.running)  # first: it frees full-precision blocks
        # Preempting requeues a request from its tokens: every one must be on the host.
        reqs = scheduler.schedule_decode(preempt=before is None)
        if reqs is None:
            events, before = self.read(before), None
            if not scheduler.running:
                return events
            reqs = scheduler.schedule_decode()
        if before is not None:  # a request whose token in flight is its last has none to feed
            reqs = [r for r in reqs if not before.ends(r)]
        clock.lap("admit")
        if not reqs:
            return self.read(before)
        feed = before.inputs(reqs, self.rows or self.runner.vocab) if before else None
        logits = self.runner.decode(reqs, feed)
        clock.lap("build")
        clock.decode_steps += 1
        if overlap:
            self.runner.vocab = logits.shape[-1]
            picks = pick(reqs, logits, before.histories(reqs, feed) if before else None)
            mx.async_eval(picks.arrays())
            clock.lap("dispatch")
            if before is not None:  # read while this step runs
                events = self.read(before)
            self.in_flight = InFlight(reqs, picks)
            clock.lap("wait")
            return events
        mx.async_eval(logits)
        clock.lap("dispatch")
        sampled = self.runner.sample(reqs, logits)
        clock.lap("wait")
        return events + emit(scheduler, self.runner, reqs, sampled)

    def read(self, step: InFlight) -> list[Event]:
        """The events of a dispatched step's tokens, for the requests still running."""
        live = {id(r) for r in self.scheduler.running}  # not since ended or aborted
        read = step.picks.read(step.reqs, self.runner.vocab)
        rows = [(r, s) for r, s in zip(step.reqs, read, strict=True) if id(r) in live]
        return emit(self.scheduler, self.runner, [r for r, _ in rows], [s for _, s in rows])


@dataclass(frozen=True)
class InFlight:
    """A decode step dispatched but not read: its requests and their lazy picks."""

    reqs: list[Request]
    picks: Picks

    def ends(self, req: Request) -> bool:
        """Whether ``req``'s token in this step is its ``max_tokens``-th."""
        return len(req.generated) + 1 >= req.max_tokens and any(r is req for r in self.reqs)

    def histories(self, reqs: list[Request], feed: mx.array | None) -> dict[int, mx.array]:
        """For the rows of ``reqs`` with logits processors that were in this step: their
        tokens, ending with the one in flight (row ``i`` of ``feed``, the next step's
        input)."""
        if feed is None or not any(r.logits_processors for r in reqs):
            return {}
        was = {id(r) for r in self.reqs}
        return {
            i: mx.concatenate([mx.array(r.tokens, dtype=mx.int32), feed[i : i + 1]])
            for i, r in enumerate(reqs)
            if r.logits_processors and id(r) in was
        }

    def inputs(self, reqs: list[Request], vocab: int) -> mx.array | None:
        """Input tokens ``(B,)`` for the next step of ``reqs``: this step's where a request
        was in it, its last token otherwise; ``None`` if none was."""
        tokens = self.picks.tokens
        if any(r.sampler is not None for r in self.reqs):  # a bad pick is refused when read,
            tokens = mx.clip(tokens, 0, vocab - 1)  # but the next step's embedding reads it
        if len(reqs) == len(self.reqs) and all(map(operator.is_, reqs, self.reqs)):
            return tokens
        where = {id(r): i for i, r in enumerate(self.reqs)}
        rows = [where.get(id(r), -1) for r in reqs]
        if max(rows) < 0:
            return None
        picked = tokens[mx.array([max(i, 0) for i in rows])]
        host = mx.array([r.last_token for r in reqs], dtype=mx.int32)
        return mx.where(mx.array([i >= 0 for i in rows]), picked, host)


def _overlaps(req: Request) -> bool:
    """Whether ``req``'s next step can be built before its token is read: no constraint
    needs the token on the host first (its grammar gives the next step's mask)."""
    return req.constraint is None


def emit(
    scheduler: Scheduler, runner: ModelRunner, reqs: list[Request], sampled: list[Sampled]
) -> list[Event]:
    """Record a step's sampled tokens (or errors) as events; constrained requests accept
    theirs and fill their next masks in the background."""
    events, constrained = [], []
    for r, s in zip(reqs, sampled, strict=True):
        if s.error is not None:
            events.append(scheduler.abort(r, s.error))
        else:
            events.append(scheduler.emit(r, s.token, s.logprob, s.top_logprobs))
            if r.constraint is not None:
                constrained.append((r, s.token, events[-1].finish_reason is None))
    # Accepted, and the next masks filled, while the host builds the next step.
    runner.masks.advance(constrained, runner.vocab)
    return events
