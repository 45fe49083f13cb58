"""A step's prefills: their forwards, and their first tokens, overlapped like decode.

``Prefiller.run`` runs the prefill work a step's admission yields, in order. A
work's forwards write its requests' K/V and index the blocks they fill; a fresh
work's last forward gives its rows' first tokens. With ``overlap``, a batched
work's last forward is dispatched together with its first tokens' picks
(``mx.async_eval``), and those are read only once the next work's forwards are
dispatched, so the host builds one forward while the device runs the one before.
A hybrid model's prefills (recurrent state) and a work with a constrained request
(whose grammar needs the token on the host) are read at once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import mlx.core as mx

from .decode import emit
from .picks import Picks, pick
from .request import Event, Prefill
from .runner import ModelRunner
from .scheduler import Scheduler
from .timing import StepClock


class Prefiller:
    """Runs prefill work over a scheduler's requests.

    Args:
        scheduler, runner, clock: The engine's.
        overlap: Read a batched work's first tokens once the next work is dispatched.
    """

    def __init__(
        self, scheduler: Scheduler, runner: ModelRunner, clock: StepClock, overlap: bool = True
    ):
        self.scheduler, self.runner, self.clock = scheduler, runner, clock
        self.overlap = overlap

    def run(
        self, works: Iterable[Prefill], tell: Callable[[list[Event]], list[Event]]
    ) -> list[Event]:
        """Run ``works`` in order; hand each work's first-token events to ``tell`` as they
        are read and return them all. Admission time (between works) counts as ``admit``."""
        events: list[Event] = []
        pending: tuple[Prefill, Picks] | None = None  # first tokens dispatched, not read
        for work in works:
            self.clock.lap("admit")
            first = self.prefill(work)
            if pending is not None:  # read while this work's forwards run
                events += tell(self.first_tokens(*pending))
                pending = None
            if isinstance(first, Picks):
                pending = (work, first)
            elif first is not None:
                events += tell(self.first_tokens(work, first))
            self.clock.lap("prefill")
        if pending is not None:
            events += tell(self.first_tokens(*pending))
        return events

    def prefill(self, work: Prefill) -> mx.array | Picks | None:
        """Run a work's forwards, indexing the blocks each one wrote.

        Returns ``None`` unless ``work.fresh``; else its rows' first-token logits,
        evaluated, or where the work overlaps its lazy picks, dispatched with the last
        forward and not read."""
        overlap = self.overlaps(work)
        logits = None
        for i, n in enumerate(work.steps):
            want = work.fresh and i == len(work.steps) - 1
            if work.alone:
                logits = self.runner.prefill(work.requests[0], n, logits=want)
            else:
                counts, wait = work.step_counts(i), not (overlap and want)
                logits = self.runner.forward(work.requests, n, want, counts, wait)
            for req in work.requests:
                self.scheduler.index_written(req)
        if not overlap or logits is None:
            return logits
        self.runner.vocab = logits.shape[-1]
        picks = pick(work.requests, logits)
        mx.async_eval(picks.arrays())
        return picks

    def first_tokens(self, work: Prefill, logits: mx.array | Picks) -> list[Event]:
        """Sample ``logits`` (or read picks) and emit the first tokens of a fresh work's
        rows."""
        if isinstance(logits, Picks):
            sampled = logits.read(work.requests, self.runner.vocab)
        else:
            sampled = self.runner.sample(work.requests, logits)
        return emit(self.scheduler, self.runner, work.requests, sampled)

    def overlaps(self, work: Prefill) -> bool:
        """Whether ``work``'s last forward and its picks may be dispatched unread: a batched
        work, with ``overlap``, on a model without recurrent state, with no constraint."""
        batched = self.overlap and not work.alone and self.runner.states is None
        return batched and all(r.constraint is None for r in work.requests)
