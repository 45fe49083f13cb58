"""The decode forward under ``mx.compile``: its Python runs once per step shape.

A decode step's graph is the same for every token while the batch and its
block tables' width bucket stay the same; only the arrays' contents move. On
the engine's host-bound steps (one stream above all) building that graph in
Python costs as much as running it. ``CompiledDecode`` traces the model's
forward over ``DecodeBatch.of_arrays`` (token ids, block tables padded to a
width bucket on the host, positions, the new tokens' blocks; their slots follow
from the positions inside the trace) with every pool array as compiled state, and
replays the trace for later steps of that shape (BENCHMARKS.md, run 262). A fused
kernel never reads the padded blocks; the portable gather path reads and masks
them. A batch is padded to a row bucket with copies of its last row, which
compute that row's K/V again and store it in the same slots, and whose logits
are dropped: continuous batching changes the batch size from step to step.

A hybrid's ``StatePool`` arrays are compiled state beside the pools. While its
requests hold slots ``0 .. B-1`` and ``B`` is a row bucket, the step reads and
replaces the first ``B`` rows as they are (no gather). Otherwise the requests'
slots are one more input, padded like the batch with the last row's slot: a
padding row reads that row's state and writes back the same state and K/V.

A step whose tables hold cold blocks traces apart from one whose tables do not
(``has_cold`` per layer group is part of the trace's key), with the cold tier's
arrays as read-only compiled state: a fused kernel reads both tiers, and the
portable path reads them through a ``TierPlan`` made on the device from the
padded tables.

It serves every engine, sharded ones included (each rank traces the same shapes
at the same steps, the collectives inside the trace), unless turned off
(``PagedEngine(compile_decode=False)``, or ``MLX_PAGED_COMPILE=off`` for engines
that do not say). A model whose forward cannot be traced (it reads arrays on the
host, say) falls back to uncompiled steps at its first trace, with one warning.
It has run on CUDA (BENCHMARKS.md, runs 263-281; NCCL in run 280); on the CPU the
tests check its tokens against the uncompiled step's and mlx-lm's, and a sharded
engine's over ``mlx.launch``'s ring against one process's; Metal has not been
run. The model's weights are captured when a shape is first traced, as
constants: an engine's model must not change under it. All layers of a compiled
step share one buffer of split-K counters (the graph merges equal zero fills),
which the CUDA kernel's merging split zeroes again after each launch.
"""

from __future__ import annotations

import logging
import os
import time
from collections import Counter

import mlx.core as mx

from ..attention import path_counts, read_counts
from ..cache import DecodeBatch, StepPagedKVCache, StepStateCache
from ..storage import batch_bucket
from .request import Request
from .runner import ModelRunner

logger = logging.getLogger("mlx_paged.engine")

#: ``MLX_PAGED_COMPILE`` values that turn compiled decode steps on, and off (unset: on).
ON = ("", "1", "on", "true", "yes")
OFF = ("0", "off", "false", "no")
#: The attention counters a step's Python adds to: a replayed step adds what its trace did.
COUNTERS = (path_counts, read_counts)


class CompiledDecode:
    """``ModelRunner.decode`` for the runners ``of`` accepts, through one compiled
    function per step shape."""

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.kinds = list(runner.pools)
        state = [a for pool in runner.pools.values() for a in (pool.keys, pool.values)]
        if runner.states is not None:
            state.append(runner.states.arrays)
        colds = [p.cold for p in runner.pools.values() if p.cold is not None]
        self._colds = [cold.blobs for cold in colds]
        self._forward = mx.compile(self._trace, inputs=state + self._colds, outputs=state)
        self.traces = 0  # shapes traced so far
        self.steps = 0  # steps that went through a trace (traced or replayed)
        self.trace_seconds = 0.0  # host time the calls that traced took
        self._counts: dict[tuple, list[Counter[str]]] = {}  # per step shape: its path counts

    @classmethod
    def of(cls, runner: ModelRunner, enabled: object = None) -> CompiledDecode | None:
        """A ``CompiledDecode`` for ``runner`` if ``enabled`` (``None``: unless the
        environment sets ``MLX_PAGED_COMPILE=off``), else ``None``.

        Raises:
            ValueError: if ``enabled`` is not a bool or ``None``, or ``MLX_PAGED_COMPILE``
                is none of ``ON`` and ``OFF``.
        """
        if enabled is not None and not isinstance(enabled, bool):
            raise ValueError(f"compile_decode must be True, False or None, got {enabled!r}.")
        if enabled is None:
            setting = os.environ.get("MLX_PAGED_COMPILE", "").strip().lower()
            if setting not in ON + OFF:
                raise ValueError(
                    f"MLX_PAGED_COMPILE must be one of {', '.join(ON[1:] + OFF)}, got {setting!r}."
                )
            enabled = setting in ON
        return cls(runner) if enabled else None

    def __call__(self, reqs: list[Request], tokens: mx.array) -> mx.array:
        """Lazy logits ``(B, V)`` of one step; ``tokens`` ``(B, 1)``. Advances the tables."""
        runner, states, n, given = self.runner, self.runner.states, len(reqs), tokens
        if not self._written():
            return runner.forward_step(reqs, tokens)
        pad = batch_bucket(n) - n
        rows = reqs + reqs[-1:] * pad  # copies of the last row: the same K/V to the same slots
        batches = [
            DecodeBatch(runner.pools[k], [r.tables[k] for r in rows], k.window) for k in self.kinds
        ]
        arrays = [a for b in batches for a in b.arrays(width_bucket(b.width // b.block_size))]
        for pool in runner.pools.values():  # the trace reads the arrays' lists directly
            pool.flush_copies()
        if states is not None:
            states.flush()  # a trace must not take the pending slots' writes in
            slots = [r.slot for r in rows]
            if pad or not isinstance(states.rows(slots), int):  # gathered and scattered
                arrays.append(mx.array(slots, dtype=mx.int32))
        if tokens.dtype != mx.int32:  # one trace for host and sampled ids
            tokens = tokens.astype(mx.int32)
        if pad:
            tokens = mx.pad(tokens, [(0, pad), (0, 0)], mode="edge")
        cold = tuple(b.has_cold for b in batches)
        key = (cold, tokens.shape, *(a.shape for a in arrays), *self._pool_shapes())
        counted = self._counts.get(key)
        before = [Counter(c) for c in COUNTERS] if counted is None else None
        traces, start = self.traces, time.perf_counter()
        saved = [(held, list(held)) for held in self._state_lists()] if counted is None else []
        try:
            logits = self._forward(cold, tokens, *arrays)
        except Exception as error:
            if counted is not None:
                raise
            for held, items in saved:  # the arrays the failed trace may have swapped out
                held[:] = items
            logger.warning(
                "mlx_paged: this model's decode step cannot be compiled (%s); it decodes "
                "uncompiled from now on.",
                error,
            )
            runner.compiled = None
            return runner.forward_step(reqs, given)
        self.steps += 1
        if self.traces != traces:
            self.trace_seconds += time.perf_counter() - start
        if counted is None:  # what the trace's Python counted, for every replay
            self._counts[key] = [c - b for c, b in zip(COUNTERS, before, strict=True)]
        else:
            for total, step in zip(COUNTERS, counted, strict=True):
                total.update(step)
        for batch in batches:
            del batch.tables[n:], batch.new_tokens[n:]  # advance each real table once
            batch.finish()
        return logits[:n] if pad else logits

    def _written(self) -> bool:
        """Whether every layer's arrays exist, so that a trace may take them as state (a
        model of recurrent layers alone has no attention layer)."""
        runner, states = self.runner, self.runner.states
        if runner.layout.counts and any(a is None for p in runner.pools.values() for a in p.keys):
            return False
        return states is None or all(a is not None for layer in states.arrays for a in layer)

    def _state_lists(self) -> list[list[mx.array | None]]:
        """The lists that hold the compiled state's arrays."""
        runner = self.runner
        lists = [held for pool in runner.pools.values() for held in (pool.keys, pool.values)]
        return lists + (runner.states.arrays if runner.states is not None else []) + self._colds

    def _pool_shapes(self) -> list[tuple[int, ...]]:
        pools = self.runner.pools.values()
        shapes = [pool.keys[0].shape for pool in pools if pool.keys[0] is not None]
        shapes += [blob.shape for held in self._colds for blob in held]  # per stack
        if self.runner.states is not None:
            shapes.append((self.runner.states.rows_held,))
        return shapes

    def _trace(self, cold: tuple[bool, ...], tokens: mx.array, *arrays: mx.array) -> mx.array:
        self.traces += 1
        runner, n = self.runner, DecodeBatch.STEP_ARRAYS
        batches = {
            k: DecodeBatch.of_arrays(runner.pools[k], list(arrays[n * i : n * i + n]), cold[i])
            for i, k in enumerate(self.kinds)
        }
        views = []
        if runner.states is not None:  # the requests' slots, or the first B rows
            rows = arrays[-1] if len(arrays) > n * len(self.kinds) else tokens.shape[0]
            views = [
                StepStateCache(runner.states, i, rows) for i in range(runner.states.num_layers)
            ]
        caches = runner.layout.bind(runner.pools, batches, StepPagedKVCache, views.__getitem__)
        with runner.rope_kernel(caches, 1):
            logits = runner.model(tokens, cache=caches)[:, -1, :]
        for view in views:
            view.finish()
        return logits


def width_bucket(width: int) -> int:
    """Block-table width a compiled step pads ``width`` blocks to: the next power of two up
    to 64, then the next multiple of 64; a sequence's step retraces when it crosses one."""
    if width <= 64:
        return 1 << max(0, width - 1).bit_length()
    return -(-width // 64) * 64
