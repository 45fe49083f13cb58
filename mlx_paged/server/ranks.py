"""The engine thread of a server sharded across processes (``mlx.launch``).

Every rank runs a ``RankWorker`` over its shard of the model. Rank 0 serves
HTTP; before each step it sends the requests, aborts and client disconnects it
received to every rank (``share``), and every rank applies them in the same
order, so their replicated schedulers agree (``PagedEngine(group=)`` checks
that they do). Jobs travel as data: each rank rebuilds the sampler from its
settings and the grammar from its schema; the ranks seed their random streams
alike, so sampling agrees too. Each rank detokenizes as well, so every rank
meets the same stop strings.

A rank that dies makes the others' collectives fail; one that hangs leaves
them waiting. Either way, rank 0 answers its requests with an error and exits
non-zero: at once for a failure, after ``timeout`` seconds for a hang.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import random
import threading
import time
from collections.abc import Callable

import mlx.core as mx
from mlx_lm.tokenizer_utils import TokenizerWrapper

from ..engine import PagedEngine
from ..engine.distributed import share
from .grammar import Grammars
from .sampling import make_request_sampler
from .worker import EngineWorker, Job, Output

logger = logging.getLogger("mlx_paged.server")

#: Exit status of a rank that stops because another rank failed or hung.
RANK_FAILED = 3


class RankWorker(EngineWorker):
    """An ``EngineWorker`` whose inputs come from rank 0, on every rank of ``group``.

    Args:
        load: Builds ``(engine, tokenizer)`` over this rank's shard.
        group: The ranks.
        timeout: Seconds a step or an exchange may take before rank 0 calls the job
            hung, answers its requests with an error and exits.
    """

    admits_mid_step = False  # every rank adds the same jobs, between steps

    def __init__(
        self,
        load: Callable[[], tuple[PagedEngine, TokenizerWrapper]],
        group: mx.distributed.Group,
        timeout: float = 120.0,
    ):
        super().__init__(load)
        self.group, self.timeout = group, timeout
        self.fatal_steps = True  # a failed step leaves the ranks apart: stop the job
        self._grammars: Grammars | None = None
        self._busy_since: float | None = None
        self._pulled: list[tuple[str, Job | None]] = []

    def start(self, timeout: float | None = None) -> None:
        super().start(timeout)
        if self.group.rank() == 0:
            threading.Thread(target=self._watch, name="mlx_paged-watchdog", daemon=True).start()

    def wait(self) -> None:
        """Block until the engine loop ends (rank 0 stopped the job)."""
        self._done.wait()

    # ---- engine thread ----------------------------------------------------

    def _run(self) -> None:
        try:
            seed = self._exchange(random.getrandbits(31))  # rank 0's, on every rank
            mx.random.seed(seed)
            super()._run()
        except Exception as e:  # a collective failed: another rank died or disagreed
            logger.error("mlx_paged: rank %d stops: %s", self.group.rank(), e)
            self._give_up(f"a rank of the sharded model failed: {e}")

    def _drain(self, block: bool) -> bool:
        local: list[tuple[str, Job | None]] = []
        if self.group.rank() == 0:
            local = self._pull(block)
        self._pulled = local  # seen by _give_up until every rank has them
        commands = self._exchange([_wire(kind, job, local) for kind, job in local])
        self._pulled = []
        applied: list[Job | None] = []
        for i, (kind, payload) in enumerate(commands):
            if kind == "stop":
                return False
            if kind == "add":
                job = local[i][1] if local else self._rebuild(payload)
                self._add(job)
                applied.append(job)
                continue
            applied.append(None)
            uid = applied[payload[1]].uid if payload[0] == "new" else payload[1]
            if uid is not None and uid in self._jobs:
                self.engine.abort(uid)
                self._finish(self._jobs[uid], "abort")
        return True

    def _pull(self, block: bool) -> list[tuple[str, Job | None]]:
        """Rank 0: what the HTTP side queued (waiting up to 0.5 s for one if ``block``)."""
        out = []
        try:
            out.append(self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait())
            while True:
                out.append(self._inbox.get_nowait())
        except queue.Empty:
            pass
        if self._stopping.is_set() and not any(kind == "stop" for kind, _ in out):
            out.append(("stop", None))
        return out

    def _exchange(self, obj: object) -> object:
        self._busy_since = time.monotonic()
        try:
            return share(obj, self.group)
        finally:
            self._busy_since = None

    def _step(self) -> None:
        self._busy_since = time.monotonic()
        try:
            super()._step()
        finally:
            self._busy_since = None

    def _update_stats(self) -> None:
        """Rank 0's stats with the bytes every rank holds summed: the whole job's memory
        (the block counts and token counters are the same on every rank)."""
        stats = self.engine.stats()
        names = ("bytes", "cold_bytes", "state_bytes", "state_snapshot_bytes")
        self._busy_since = time.monotonic()
        try:
            totals = mx.distributed.all_sum(
                mx.array([getattr(stats, n) for n in names], mx.int64), group=self.group
            ).tolist()
        finally:
            self._busy_since = None
        self.stats = dataclasses.replace(stats, **dict(zip(names, totals, strict=True)))

    def _rebuild(self, job: Job) -> Job:
        """Another rank's copy of rank 0's job: its sampler and grammar made here."""
        job.deliver = _discard
        job.sampler = make_request_sampler(*job.sampling) if job.sampling else None
        if job.schema is not None:
            if self._grammars is None:
                self._grammars = Grammars(self.tokenizer, self.engine.vocab_size)
            job.constraint = self._grammars.compile(job.schema)()
        return job

    # ---- failures ----------------------------------------------------------

    def _watch(self) -> None:
        """Rank 0: give up when a step or an exchange has taken more than ``timeout``."""
        while not self._done.is_set():
            time.sleep(1.0)
            since = self._busy_since
            if since is not None and time.monotonic() - since > self.timeout:
                logger.error("mlx_paged: no rank answered for %.0f s", self.timeout)
                self._give_up(f"the sharded model's ranks did not answer in {self.timeout} s")

    def _give_up(self, message: str) -> None:
        """Answer every request with ``message`` and exit with ``RANK_FAILED``."""
        for job in list(self._jobs.values()):
            job.deliver(Output(error=message))
        pulled = self._pulled + (self._pull(block=False) if self.group.rank() == 0 else [])
        for kind, job in pulled:
            if kind == "add":
                job.deliver(Output(error=message))
        time.sleep(1.0)  # the HTTP side sends the errors
        os._exit(RANK_FAILED)


def _wire(kind: str, job: Job | None, batch: list[tuple[str, Job | None]]) -> tuple:
    """A command as data: an add carries the job without its callables; an abort names
    the job's engine uid, or (``"new"``, i) for the add at position i of this batch."""
    if kind == "add":
        return "add", dataclasses.replace(job, deliver=None, sampler=None, constraint=None)
    if kind == "abort":
        if job.uid is not None:
            return "abort", ("uid", job.uid)
        position = next((i for i, (k, j) in enumerate(batch) if k == "add" and j is job), None)
        return "abort", ("new", position) if position is not None else ("uid", None)
    return "stop", None


def _discard(_: Output) -> None:
    """Other ranks' jobs answer no one."""
