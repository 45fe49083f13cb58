"""``PagedEngine``: continuous batching over the block pool.

The facade wires a ``Scheduler`` (queues, admission, preemption, finishing:
plain Python over ids and counts) to a ``ModelRunner`` (forward passes and
sampling). Each ``step()``:

1. admits waiting requests while blocks allow (``Scheduler.admit``): each
   adopts the longest cached prefix of its tokens and prefills only the rest;
2. runs one batched decode forward over every running request, each with its
   own offset and length, reading K/V where it lies in the blocks;
3. samples per request; finished requests park their blocks in the prefix
   index for the next request with the same prefix.

Hybrid models (recurrent ``ArraysCache`` layers beside attention, or recurrent
layers only) keep each running request's state in a slot of a ``StatePool`` and
reuse prefixes through snapshots of that state (see ``Scheduler``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from functools import partial

import mlx.core as mx
import mlx.nn as nn

from ..attention import route_model
from ..blocks import LayerKind, check_block_size
from ..cache import PagedLayout, make_pools
from ..storage import KVPool, StatePool, check_kv_dtype, check_kv_quant
from ..storage.preload import check_preload
from .compiled import CompiledDecode
from .decode import Decoder
from .disk_tier import DiskTier
from .distributed import Agreement
from .prefilling import Prefiller
from .request import (
    EngineStats,
    Event,
    LogitsProcessor,
    Request,
    Sampler,
    TokenConstraint,
    make_request,
)
from .runner import ModelRunner
from .scheduler import Scheduler
from .timing import StepClock

#: Tokens between recurrent-state snapshots of a long prefill (BENCHMARKS.md: snapshot
#: interval).
DEFAULT_SNAPSHOT_INTERVAL = 512
#: The fewest snapshots the default keeps: a request leaves up to one per interval of its
#: prefill, one at its last whole block and one at its end, so ``2 * max_batch_size``
#: alone, at one stream, evicted a shared prefix's snapshot before the next request came.
MIN_STATE_SNAPSHOTS = 8


class PagedEngine:
    """Runs many requests at once over one paged KV cache.

    Args:
        model: An mlx-lm model: attention layers (full, sliding window, MLA, sinks)
            are paged; recurrent layers (``ArraysCache``) keep their state in slots.
        block_size: Token slots per block.
        num_blocks: Blocks per layer group, or ``None`` to grow on demand.
        max_batch_size: Most sequences decoding at once.
        prefill_step_size: Most tokens per prefill forward; a long prompt goes alone in
            chunks of this size (mlx-lm's default; BENCHMARKS.md runs 179-181).
        prefill_batch_tokens: Most tokens, padding included, in a forward batching several
            requests' short prompts (``None``: 2048 where a fused prefill kernel serves the
            forwards, else 512; at most the step size; runs 183 and 321).
        prefill_budget: Most prompt tokens admitted per step, beside its decode (``None``: all
            that fit, prefilled before the step's decode; each step admits one at least).
        kv_dtype: Storage dtype for K/V; ``None`` keeps the model's.
        kv_bits, kv_group_size, hot_tokens: A quantized cold tier, as in
            ``make_paged_cache``: full-attention blocks behind each sequence's last
            ``hot_tokens`` tokens are quantized to ``kv_bits`` and shared from there.
            ``num_blocks`` then counts full-precision blocks.
        cold_blocks: Cold-tier capacity in blocks, or ``None`` to grow it on demand.
        kv_disk_dir, kv_disk_bytes: A disk tier (``engine/disk_tier.py``): full blocks the
            prefix index evicts go to files in this directory, at most this many bytes, and
            come back when a prompt needs them, in this process or a later one; so do a
            hybrid model's snapshots, a sliding window's blocks and cold blocks. Under a
            ``group``: each rank's shard in ``DIR/rank-R-of-N`` with 1/N of the bytes; the
            ranks load only what all of them have.
        kv_disk_preload_bytes: Read the newest entries on disk, up to this many bytes, into
            host memory (pinned on CUDA) in the background as the engine starts
            (``DiskTier.preload``; 0: none), held until each was loaded once or for
            ``preload.HOLD_SECONDS`` (``Preload.release``); ``engine.disk.restore()`` loads
            the prefixes they hold into the pool before a first request for them.
        state_snapshot_interval: For models with recurrent layers: a long prefill snapshots
            the recurrent state every this many tokens (a multiple of ``block_size``), so a
            later request sharing the prefix recomputes fewer of its tokens. ``None``: the
            multiple of ``block_size`` nearest ``DEFAULT_SNAPSHOT_INTERVAL``.
        num_state_snapshots: Most recurrent-state snapshots kept (least recently used evicted
            first); ``None``: ``max(MIN_STATE_SNAPSHOTS, 2 * max_batch_size)``.
        group: The ranks of a model sharded across processes (``shard_model``): every rank
            adds the same requests and aborts in the same order; each step compares their
            states first (``Agreement``).
        overlap: Dispatch each decode step before reading the previous one's tokens (the
            host builds step t+1 while the device runs step t, as in mlx-lm's
            ``generate_step``) while no running request has a constraint: a step's tokens
            come with the next step's events, a stop token costs one row. Each batched
            prefill forward is dispatched before the previous one's first tokens are read.
        compile_decode: Replay each decode step's graph, built once per step shape
            (``engine/compiled.py``); ``None``: on unless ``MLX_PAGED_COMPILE=off``.
    """

    def __init__(
        self,
        model: nn.Module,
        block_size: int = 16,
        num_blocks: int | None = None,
        max_batch_size: int = 64,
        prefill_step_size: int = 2048,
        prefill_batch_tokens: int | None = None,
        prefill_budget: int | None = None,
        kv_dtype: mx.Dtype | None = None,
        kv_bits: int | None = None,
        kv_group_size: int = 64,
        hot_tokens: int = 256,
        cold_blocks: int | None = None,
        state_snapshot_interval: int | None = None,
        num_state_snapshots: int | None = None,
        group: mx.distributed.Group | None = None,
        kv_disk_dir: str | os.PathLike | None = None,
        kv_disk_bytes: int | None = None,
        kv_disk_preload_bytes: int = 0,
        overlap: bool = True,
        compile_decode: bool | None = None,
    ):
        check_block_size(block_size)
        check_preload(kv_disk_preload_bytes, kv_disk_dir)
        check_kv_dtype(kv_dtype)
        quant = check_kv_quant(kv_bits, kv_group_size, hot_tokens)
        sizes = {"max_batch_size": max_batch_size, "prefill_step_size": prefill_step_size}
        optional = {
            "prefill_budget": prefill_budget,
            "prefill_batch_tokens": prefill_batch_tokens,
            "cold_blocks": cold_blocks,
            "num_state_snapshots": num_state_snapshots,
        }
        check_positive(sizes, optional)
        if not isinstance(overlap, bool):
            raise ValueError(f"overlap must be True or False, got {overlap!r}.")
        state_snapshot_interval = snapshot_interval(state_snapshot_interval, block_size)
        layout = PagedLayout.of(model)
        pools = make_pools(layout, block_size, num_blocks, kv_dtype, quant, cold_blocks)
        if not pools:  # recurrent layers only: blocks index tokens and hold no K/V
            pools = {LayerKind(): KVPool(1, block_size, num_blocks)}
        snapshots = num_state_snapshots or max(MIN_STATE_SNAPSHOTS, 2 * max_batch_size)
        states = StatePool(layout.entries, max_batch_size, snapshots) if layout.entries else None
        self.scheduler = Scheduler(
            pools,
            max_batch_size,
            prefill_step_size,
            prefill_budget,
            states,
            state_snapshot_interval,
            prefill_batch_tokens,
            layout.padded_states,
        )
        self.runner = ModelRunner(model, layout, pools, states)
        self.runner.compiled = CompiledDecode.of(self.runner, compile_decode)
        disk = (kv_disk_dir, kv_disk_bytes, model, pools, self.scheduler, group)
        self.disk = DiskTier.open(*disk) if kv_disk_dir is not None else None  # a disk tier
        if kv_disk_preload_bytes:
            self.disk.preload(kv_disk_preload_bytes)
        self.agreement = Agreement(group) if group is not None and group.size() > 1 else None
        self.vocab_size = vocab_size(model)
        self.clock = StepClock()  # host time per step phase (``engine/timing.py``)
        self.decoder = Decoder(self.scheduler, self.runner, self.clock, self.vocab_size, overlap)
        self.prefiller = Prefiller(self.scheduler, self.runner, self.clock, overlap)
        if prefill_batch_tokens is None:
            self.prefiller.widen()
        self._next_uid = 0
        route_model(model)

    # ---- public API -------------------------------------------------------

    @property
    def waiting(self) -> Sequence[Request]:
        """Requests queued for admission, next first."""
        return self.scheduler.waiting

    @property
    def running(self) -> Sequence[Request]:
        """Requests holding blocks and decoding, in batch order."""
        return self.scheduler.running

    def add_request(
        self,
        tokens: Sequence[int] | mx.array,
        max_tokens: int,
        sampler: Sampler | None = None,
        logits_processors: Iterable[LogitsProcessor] | None = None,
        stop_tokens: Iterable[int] | None = None,
        logprobs: int | None = None,
        constraint: TokenConstraint | None = None,
    ) -> int:
        """Queue a prompt; return its uid.

        ``sampler`` maps log-probs ``(1, V)`` to a token (greedy if ``None``); one
        with a hashable ``batch_key`` attribute samples rows independently and keeps no
        per-request state, and is called once on ``(k, V)`` for the k requests of a step
        whose samplers share that key;
        ``logits_processors`` see ``(tokens, logits)`` first, as in mlx-lm. With
        ``logprobs`` (0 or more), each event carries the sampled token's log-prob and
        the ``logprobs`` most likely tokens'. A ``constraint`` (a grammar's state)
        masks the logits before the processors and the sampler and sees every token
        the request samples; the batch's other requests are not changed by it.

        Raises:
            ValueError: for an empty prompt, a token id outside ``[0, vocab_size)``
                (the model's embedding would read out of bounds), a bad
                ``max_tokens``/``logprobs``, or a request the pool can never hold.
        """
        tokens = tokens.tolist() if isinstance(tokens, mx.array) else list(tokens)
        req = make_request(
            self._next_uid,
            tokens,
            max_tokens,
            self.vocab_size,
            sampler=sampler,
            logits_processors=list(logits_processors or []),
            stop_tokens=frozenset(stop_tokens or ()),
            logprobs=logprobs,
            constraint=constraint,
        )
        self.scheduler.add(req)
        self._next_uid += 1
        return req.uid

    def abort(self, request_id: int) -> bool:
        """End a request now; return whether it was still waiting or running.

        Call it between steps (the engine is not thread-safe: a server calls it on the
        thread that steps). A running request's blocks are parked in the prefix index, as
        at a normal finish; a waiting one holds none. No event follows for it.
        """
        req = self.request(request_id)
        if req is not None:
            self.scheduler.abort(req)
        return req is not None

    def request(self, request_id: int) -> Request | None:
        """The waiting or running request with this uid, or ``None``."""
        reqs = (*self.scheduler.running, *self.scheduler.waiting)
        return next((req for req in reqs if req.uid == request_id), None)

    def step(
        self,
        on_event: Callable[[Event], None] | None = None,
        admit_more: Callable[[], object] | None = None,
    ) -> list[Event]:
        """Admit and prefill what fits, then decode one token for every running request.

        Returns the step's events; ``on_event`` hears each as soon as it exists (a new
        request's first token after its prefill, with ``overlap`` once the next batched
        prefill is dispatched; a decode's tokens, with ``overlap``, in the next step). It
        must not call ``abort``. ``admit_more`` is called once the step's admissions are
        dispatched and their first tokens read: requests it adds are admitted and
        prefilled in this step, before its decode (not asked under a ``prefill_budget``,
        nor by a sharded engine).
        """
        events: list[Event] = []
        if self.agreement is not None and (self.scheduler.waiting or self.scheduler.running):
            self.agreement.check(self.scheduler)
        clock = self.clock
        clock.start()
        tell = partial(_tell, on_event=on_event, clock=clock, phase="prefill")
        more = admit_more if self.agreement is None else None
        events += self.prefiller.run(_admissions(self.scheduler, more), tell)
        clock.lap("admit")
        if self.scheduler.running:
            events += _tell(self.decoder.step(), on_event, clock, "emit")
        else:
            self.decoder.in_flight = None  # every request it carried has ended
        if not self.scheduler.running:
            self.runner.masks.wait()  # idle: every constraint has seen its last token
        if self.disk is not None:
            self.disk.after_step()
        return events

    def stream(self) -> Iterator[Event]:
        """Step until every request has finished, yielding events as they come."""
        while self.scheduler.waiting or self.scheduler.running:
            yield from self.step()

    def generate(
        self, prompts: Sequence[Sequence[int]], max_tokens: int = 256, **kwargs
    ) -> list[list[int]]:
        """Generate for every prompt (greedy unless ``sampler`` is given); return token ids."""
        uids = [self.add_request(p, max_tokens, **kwargs) for p in prompts]
        out: dict[int, list[int]] = {uid: [] for uid in uids}
        for event in self.stream():
            if event.uid in out:
                out[event.uid].append(event.token)
        return [out[uid] for uid in uids]

    def stats(self) -> EngineStats:
        """Pool counts summed over layer groups, plus prefix hits, prefill and preemptions."""
        return self.scheduler.stats()

    def check_invariants(self) -> None:
        """Assert refcounts equal holders in every group and the index agrees with the pools."""
        self.scheduler.check_invariants()


def _admissions(scheduler: Scheduler, admit_more: Callable[[], object] | None):
    """A step's prefill work: the scheduler's admissions, then, once they are dispatched
    and their first tokens read (``None``), those of the requests ``admit_more`` adds (not
    asked under a ``prefill_budget``, which bounds a step's prompt tokens)."""
    if admit_more is not None and not callable(admit_more):  # before any admission
        raise ValueError(f"admit_more must be a callable or None, got {admit_more!r}.")
    yield from scheduler.admit()
    if admit_more is not None and scheduler.prefill_budget is None:
        yield None  # the first tokens so far are read before the requests added are built
        admit_more()
        yield from scheduler.admit()


def snapshot_interval(interval: object, block_size: int) -> int:
    """``state_snapshot_interval`` checked (a positive multiple of ``block_size``), or the
    default for ``None``."""
    if interval is None:
        return block_size * max(1, DEFAULT_SNAPSHOT_INTERVAL // block_size)
    valid = isinstance(interval, int) and not isinstance(interval, bool) and interval > 0
    if not valid or interval % block_size:
        raise ValueError(
            f"state_snapshot_interval must be a positive multiple of block_size "
            f"({block_size}), got {interval!r}."
        )
    return interval


def _tell(
    events: list[Event], on_event: Callable[[Event], None] | None, clock: StepClock, phase: str
) -> list[Event]:
    """Hand ``events`` to ``on_event``; the time until now counts for ``phase``, the
    callbacks' for ``deliver``."""
    clock.lap(phase)
    if on_event is not None:
        for event in events:
            on_event(event)
        clock.lap("deliver")
    return events


def check_positive(sizes: dict[str, object], optional: dict[str, object]) -> None:
    """Raise ValueError unless every value in ``sizes`` is a positive int, and every one in
    ``optional`` is one or ``None``."""
    for name, v in {**sizes, **optional}.items():
        if v is None and name in optional:
            continue
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            none = " or None" if name in optional else ""
            raise ValueError(f"{name} must be a positive int{none}, got {v!r}.")


def vocab_size(model: nn.Module) -> int | None:
    """Rows of the model's token embedding (what a token id indexes), or ``None`` if unknown."""
    for _, module in model.named_modules():
        if isinstance(module, nn.QuantizedEmbedding):
            return module.num_embeddings
        if isinstance(module, nn.Embedding):
            return module.weight.shape[0]
    size = getattr(getattr(model, "args", None), "vocab_size", None)
    return size if isinstance(size, int) else None
