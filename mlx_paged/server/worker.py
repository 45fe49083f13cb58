"""The engine thread: the one thread that makes MLX calls for the server.

HTTP handlers hand it ``Job``s and aborts through a thread-safe queue. It adds
jobs to the ``PagedEngine``, steps while there is work, turns each job's tokens
into text (stop strings included) and hands every ``Output`` back through the
job's ``deliver`` callback, which the server points at its event loop.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from mlx_lm.generate import TextStateMachine, make_text_state_machine
from mlx_lm.sample_utils import make_logits_processors
from mlx_lm.tokenizer_utils import TokenizerWrapper

from ..engine import EngineStats, Event, PagedEngine
from ..engine.request import Request, TokenConstraint, check_tokens
from .grammar import parse_forced_calls
from .memory import at_rest, held
from .text import TextStream, initial_state, parse_call, thinking_machine

logger = logging.getLogger("mlx_paged.server")


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

    def processors(self, vocab: int | None) -> list:
        """``logits``' processors; ValueError for a ``logit_bias`` id outside ``vocab``
        (MLX does not bounds-check the scatter that applies it)."""
        try:
            check_tokens(list(self.logits.get("logit_bias") or ()), vocab)
        except ValueError as e:
            raise ValueError(f"logit_bias: {e}") from None
        return make_logits_processors(**self.logits)


class EngineWorker:
    """Owns a ``PagedEngine`` on a background thread.

    MLX arrays belong to the thread whose stream made them, so the thread
    builds the engine itself: ``load`` runs there first and returns the engine
    and the tokenizer.

    Args:
        load: Builds ``(engine, tokenizer)``; the tokenizer's EOS ids stop generation.
    """

    #: Jobs that come during a step join its prefill (``PagedEngine.step``'s ``admit_more``).
    admits_mid_step = True

    def __init__(self, load: Callable[[], tuple[PagedEngine, TokenizerWrapper]]):
        self._load = load
        self.engine: PagedEngine | None = None
        self.tokenizer: TokenizerWrapper | None = None
        self.stats = EngineStats(0, 0, 0, 0, 0, 0)
        self.memory = (0, 0)  # MLX's live and cached bytes, as the engine thread last read them
        self.ready = threading.Event()
        self.load_error: BaseException | None = None
        self._inbox: queue.Queue[tuple[str, Job | None]] = queue.Queue()
        self._jobs: dict[int, Job] = {}
        self._stopped: list[int] = []  # uids that met a stop string: aborted after the step
        self._thread = threading.Thread(target=self._main, name="mlx_paged-engine", daemon=True)
        self._stopping = threading.Event()
        self._done = threading.Event()  # the engine loop has ended
        self.fatal_steps = False  # whether a failed step ends the loop (sharded models)
        self._held: list[tuple[str, Job | None]] = []  # commands seen during a step

    # ---- any thread -------------------------------------------------------

    def start(self, timeout: float | None = None) -> None:
        """Start the engine thread and wait until the engine is built.

        Raises:
            RuntimeError: if ``load`` failed (the cause is chained).
        """
        self._thread.start()
        self.ready.wait(timeout)
        if self.load_error is not None:
            raise RuntimeError(f"loading the model failed: {self.load_error}") from self.load_error

    def submit(self, job: Job) -> None:
        """Queue a job; its first ``Output`` says whether the engine took it."""
        self._inbox.put(("add", job))

    def abort(self, job: Job) -> None:
        """End a job at the next step boundary; its blocks are freed or parked."""
        self._inbox.put(("abort", job))

    @property
    def queued(self) -> int:
        """Jobs waiting for the engine: not yet added, or added and not admitted."""
        return self._inbox.qsize() + self.stats.waiting

    def stop(self, timeout: float | None = None) -> None:
        """Abort every job, stop the engine loop and wait for it to end."""
        self._stopping.set()
        self._inbox.put(("stop", None))
        if self._thread.is_alive():
            self._done.wait(timeout)

    # ---- engine thread ----------------------------------------------------

    def _main(self) -> None:
        try:
            self.engine, self.tokenizer = self._load()
            self.stop_tokens = frozenset(self.tokenizer.eos_token_ids)
            self.thinking = thinking_machine(self.tokenizer)
            # Reasoning and tool-call markers, as mlx_lm.server splits them.
            tools = self.tokenizer.has_tool_calling
            self.agent = make_text_state_machine(self.tokenizer) if tools else None
            self._update_stats()
        except BaseException as e:  # reported by start()
            self.load_error = e
            return
        finally:
            self.ready.set()
        try:
            self._run()
        finally:
            self._done.set()
        # The thread never ends: MLX frees its per-thread state (the compile cache) when a
        # thread ends, taking the GIL; at interpreter exit that would abort the process
        # ("terminate called without an active exception"). Parked, it ends with it.
        threading.Event().wait()

    def _run(self) -> None:
        rested = True  # MLX's cached buffers handed back since the last step
        while True:
            busy = bool(self.engine.running or self.engine.waiting)
            if not self._drain(block=not busy):
                break
            if self.engine.running or self.engine.waiting:
                self._step()
                rested = False
            else:  # idle, most often for the inbox's timeout
                rested = at_rest(self.engine, rested)
            self._update_stats()
            self.memory = held()
        self._fail_all("the server is shutting down", reason="abort")
        if self.engine.disk is not None:  # what the prefix cache holds outlives the process
            written = self.engine.disk.spill_cached()
            logger.info("mlx_paged: %d cached blocks written to the disk tier", written)
        self.stats = self.engine.stats()

    def _update_stats(self) -> None:
        self.stats = self.engine.stats()

    def _step(self) -> None:
        try:
            # First tokens go out as soon as their prefill ends.
            more = self._admit_more if self.admits_mid_step else None
            self.engine.step(on_event=self._on_event, admit_more=more)
        except Exception as e:  # a forward failed: end what it carried, keep serving
            logger.exception("mlx_paged: an engine step failed")
            self._fail_all(f"the engine step failed: {type(e).__name__}: {e}")
            if self.fatal_steps:
                raise
        for uid in self._stopped:  # stop strings seen during the step
            self.engine.abort(uid)
        self._stopped.clear()

    def _admit_more(self) -> None:
        """During a step, once its admissions are dispatched: add the jobs queued since, so
        the step prefills them too; other commands wait for the step's end."""
        while not self._inbox.empty():  # this thread alone takes from it
            kind, job = self._inbox.get_nowait()
            if kind == "add":
                self._add(job)
            else:
                self._held.append((kind, job))

    def _drain(self, block: bool) -> bool:
        """Apply queued commands (waiting for one if ``block``); False once asked to stop."""
        try:
            kind, job = self._next(block)
        except queue.Empty:
            return not self._stopping.is_set()
        while True:
            if kind == "stop":
                return False
            if kind == "add":
                self._add(job)
            elif job.uid is not None and job.uid in self._jobs:
                self.engine.abort(job.uid)
                self._finish(job, "abort")
            try:
                kind, job = self._next(False)
            except queue.Empty:
                return True

    def _next(self, block: bool) -> tuple[str, Job | None]:
        """The next command, held ones first; ``queue.Empty`` if none (in 0.5 s if ``block``)."""
        if self._held:
            return self._held.pop(0)
        return self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()

    def _add(self, job: Job) -> None:
        try:
            processors = job.processors(self.engine.vocab_size)
            machine = self.thinking if job.split_reasoning else None
            if job.tools and not job.forced:
                machine = self.agent
            if machine is not None:
                job.thinking = machine.make_state(initial_state(self.tokenizer, job.tokens))
            job.uid = self.engine.add_request(
                job.tokens,
                job.max_tokens,
                sampler=job.sampler,
                logits_processors=processors,
                stop_tokens=self.stop_tokens,
                logprobs=job.logprobs,
                constraint=job.constraint,
            )
        except ValueError as e:
            job.deliver(Output(error=str(e)))
            return
        except Exception as e:  # this request's setup failed: end it, keep the thread alive
            logger.exception("mlx_paged: a request could not be added")
            job.deliver(Output(error=f"{type(e).__name__}: {e}"))
            return
        job.request = self.engine.request(job.uid)
        job.text = TextStream(self.tokenizer, job.stop)
        self._jobs[job.uid] = job
        job.deliver(Output(accepted=True, prompt_tokens=len(job.tokens)))

    def _on_event(self, event: Event) -> None:
        job = self._jobs.get(event.uid)
        if job is None:
            return
        if event.finish_reason == "error":
            del self._jobs[event.uid]
            job.deliver(Output(error=event.error))
            return
        eos = event.finish_reason == "stop"  # a stop token: not part of the text
        text, stopped = ("", False) if eos else job.text.add(event.token)
        logprobs = ()
        if event.logprob is not None:
            logprobs = ((event.logprob, event.top_logprobs or ()),)
        if stopped:
            self._stopped.append(event.uid)
            self._finish(job, "stop", text, (event.token,), logprobs, flush=False)
        elif event.finish_reason is not None:
            tokens = () if eos else (event.token,)
            self._finish(job, event.finish_reason, text, tokens, logprobs if tokens else ())
        else:
            text, reasoning, calls = split_output(self.tokenizer, job, text)
            out = Output(text, (event.token,), logprobs, reasoning=reasoning, tool_calls=calls)
            job.deliver(out)

    def _finish(
        self,
        job: Job,
        reason: str,
        text: str = "",
        tokens: tuple[int, ...] = (),
        logprobs: tuple = (),
        flush: bool = True,
    ) -> None:
        """Deliver a job's last output; ``flush`` adds the text the stream still held."""
        del self._jobs[job.uid]
        if flush and reason != "abort":
            text += job.text.finish()
        cached = job.request.prefix_hit if job.request is not None else 0
        text, reasoning, calls = split_output(self.tokenizer, job, text, final=reason)
        job.deliver(
            Output(
                text,
                tokens,
                logprobs,
                reason,
                cached_tokens=cached,
                reasoning=reasoning,
                tool_calls=calls,
                stop_sequence=job.text.matched if job.text is not None else None,
            )
        )

    def _fail_all(self, message: str, reason: str | None = None) -> None:
        for uid, job in list(self._jobs.items()):
            self.engine.abort(uid)
            if reason is None:
                del self._jobs[uid]
                job.deliver(Output(error=message))
            else:
                self._finish(job, reason)


def split_output(
    tokenizer: TokenizerWrapper, job: Job, text: str, final: str | None = None
) -> tuple[str, str, tuple]:
    """``text`` as (content, reasoning, completed tool calls): all content unless the
    job splits reasoning or tool calls off.

    The state machine holds back text that may begin a marker; at the end (``final``,
    the finish reason) it lets it go. A call still open then is complete when the
    model stopped (formats without an end marker end there), and raw text when it
    was cut off. A forced call's output is all call: it is held to the end.
    """
    if job.forced:
        job.tool_text += text
        if final is None:
            return "", "", ()
        text, job.tool_text = job.tool_text, ""
        if final == "stop":
            try:
                return "", "", tuple(parse_forced_calls(text, job.forced_name))
            except ValueError:
                pass
        return text, "", ()
    if job.thinking is None:
        return text, "", ()
    job.thinking, segments = TextStateMachine.split(job.thinking, text)
    if final is not None:
        job.thinking, rest, state = TextStateMachine.flush(job.thinking)
        segments.append((state, rest))
    content, reasoning, raw = [], [], []
    for state, piece in segments:
        if state == "tool":
            job.tool_text += piece
            continue
        if job.tool_text:  # the tool state ended: the call is complete
            raw.append(job.tool_text)
            job.tool_text = ""
        (reasoning if state == "reasoning" else content).append(piece)
    if final is not None and job.tool_text:
        if final == "stop":
            raw.append(job.tool_text)
        else:
            content.append(f"{tokenizer.tool_call_start}{job.tool_text}")
        job.tool_text = ""
    calls = []
    for text in raw:
        parsed = parse_call(tokenizer, text, job.tools)
        if parsed is None:
            end = tokenizer.tool_call_end or ""
            content.append(f"{tokenizer.tool_call_start}{text}{end}")
        calls += parsed or []
    return "".join(content), "".join(reasoning), tuple(calls)
