"""A step's prefills: their forwards, and their first tokens, overlapped like decode.

``Prefiller.run`` runs the prefill work a step's admission yields, in order. A
work's forwards write its requests' K/V and index the blocks they fill; a fresh
work's last forward gives its rows' first tokens. With ``overlap``, a batched
work's last forward is dispatched together with its first tokens' picks
(``mx.async_eval``), and those are read only once the next work's forwards are
dispatched, so the host builds one forward while the device runs the one before.
A hybrid model's prefills (recurrent state) and a work with a constrained request
(whose grammar needs the token on the host) are read at once.

Where a fused prefill kernel runs (``attention.prefill_kernels_ready``), ``widen``
lets batched forwards grow to ``KERNEL_BATCH_TOKENS``: the kernel holds no score
matrix, so a forward's memory no longer grows with its rows times their keys. If
the kernel then declines a batched forward's attention (a head dim, dtype or sinks
it does not take), the batches shrink back to ``BATCH_TOKENS`` for good.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

import mlx.core as mx

from ..attention import path_counts, prefill_kernels_ready
from ..attention.prefill import on_cuda
from .decode import emit
from .picks import Picks, pick
from .recurrent import SPAN_FRACTION
from .request import Event, Prefill
from .runner import ModelRunner
from .scheduler import BATCH_TOKENS, KERNEL_BATCH_TOKENS, Scheduler
from .timing import StepClock

logger = logging.getLogger("mlx_paged.engine")
#: ``path_counts`` keys of attention calls no fused kernel served.
UNFUSED = ("gather", "in_place", "prefill_ops")


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
        self.widened = False  # batches at KERNEL_BATCH_TOKENS, until the kernel declines
        states = scheduler.recurrent
        if states is not None and on_cuda():  # where a forward costs little per token
            states.min_span = states.interval // SPAN_FRACTION

    def widen(self) -> None:
        """Batch prompts up to ``KERNEL_BATCH_TOKENS`` a forward where a fused prefill
        kernel runs on the default device (else leave the batches as they are)."""
        if prefill_kernels_ready():
            step = self.scheduler.prefill_step_size
            self.scheduler.prefill_batch_tokens = min(KERNEL_BATCH_TOKENS, step)
            self.widened = True

    def _narrow_if_unfused(self, unfused: int) -> None:
        """Back to ``BATCH_TOKENS`` a forward if the batched forward just run had attention
        calls no fused kernel served (``unfused`` counted them before it)."""
        if sum(path_counts[k] for k in UNFUSED) > unfused:
            step = self.scheduler.prefill_step_size
            self.scheduler.prefill_batch_tokens = min(BATCH_TOKENS, step)
            self.widened = False
            logger.info(
                "mlx_paged: the prefill kernel declined a batched forward; batches "
                "stay at %d tokens.",
                self.scheduler.prefill_batch_tokens,
            )

    def run(
        self, works: Iterable[Prefill | None], tell: Callable[[list[Event]], list[Event]]
    ) -> list[Event]:
        """Run ``works`` in order; hand each work's first-token events to ``tell`` as they
        are read and return them all. A ``None`` among the works reads the first tokens
        still pending. Admission time (between works) counts as ``admit``."""
        events: list[Event] = []
        pending: tuple[Prefill, Picks] | None = None  # first tokens dispatched, not read
        for work in works:
            if work is None:  # read what is dispatched before any more admissions
                if pending is not None:
                    events += tell(self.first_tokens(*pending))
                    pending = None
                continue
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
                unfused = sum(path_counts[k] for k in UNFUSED) if self.widened else 0
                logits = self.runner.forward(work.requests, n, want, counts, wait)
                if self.widened:
                    self._narrow_if_unfused(unfused)
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
