"""The model runner: forward passes over block tables, and sampling.

It owns every MLX call of the engine. Given requests whose block tables the
scheduler has reserved, it binds them to paged caches (one sequence through
``PagedKVCache``, a batch through ``DecodeBatch``; a hybrid model's recurrent
layers through ``StepStateCache`` over the requests' state slots), runs the
model, evaluates the writes and samples tokens; it never changes which blocks a
table holds.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

import mlx.core as mx
import mlx.nn as nn

from ..attention import kernels_write
from ..blocks import LayerKind
from ..cache import DecodeBatch, PagedKVCache, PagedLayout, StepPagedKVCache, StepStateCache
from ..storage import KVPool, StatePool
from .head import Head
from .masks import MaskWork
from .migrations import MigrationCheck
from .picks import pick
from .request import Request, Sampled
from .rope import kernel_ropes


class ModelRunner:
    """Runs ``model`` over the K/V in ``pools``.

    Args:
        model: An mlx-lm model.
        layout: Which of the model's caches are paged, in which group.
        pools: Per layer group, the K/V storage.
        states: The recurrent-state slots of a hybrid model, or ``None``.
    """

    def __init__(
        self,
        model: nn.Module,
        layout: PagedLayout,
        pools: dict[LayerKind, KVPool],
        states: StatePool | None = None,
    ):
        self.model = model
        self.layout = layout
        self.pools = pools
        self.states = states
        self.masks = MaskWork()
        #: Moves blocks to the cold tier before decode steps (``engine/migrations.py``).
        self.migrations = MigrationCheck(pools)
        #: The model's head, cut to the sampled positions in prefill forwards (``head.py``).
        self.head = Head.of(model)
        self.vocab = 0  # columns of the logits, once a step has sampled
        #: Decode steps through one compiled function per shape (``engine/compiled.py``).
        self.compiled: Callable[[list[Request], mx.array], mx.array] | None = None
        #: The layers' rotations, where ``rope_in_kernel`` left them to the kernel.
        self.ropes = kernel_ropes(model)

    def prefill(self, req: Request, n: int, logits: bool = False) -> mx.array | None:
        """Run ``req``'s next ``n`` tokens through its own caches.

        Returns the last position's logits ``(1, V)`` if asked, else ``None`` (left
        unevaluated, so the head over the chunk is not computed).
        """
        self.migrations.forwarded()
        # Recurrent layers read and write state slots; a model with no paged layer writes
        # no K/V, so only the batched step records its tokens.
        if self.states is not None or not self.layout.counts:
            for kind, pool in self.pools.items():  # as a PagedKVCache write would
                pool.reserve(req.tables[kind], req.written, req.written + n)
            return self._forward([req], n, logits)
        start = req.written
        caches = self.layout.bind(self.pools, req.tables, PagedKVCache)
        with self._head_at(logits and n > 1):
            out = self.model(mx.array(req.tokens_between(start, start + n))[None], cache=caches)
        last = out[:, -1, :] if logits else None
        mx.eval(last if logits else [], [c.state for c in caches])
        return last

    def forward(
        self,
        reqs: list[Request],
        n: int,
        logits: bool = False,
        counts: tuple[int, ...] | None = None,
        wait: bool = True,
    ) -> mx.array | None:
        """Run the next ``n`` tokens of each request together (blocks reserved); with
        ``counts``, the next ``counts[i]`` of request ``i``, padded on the right to ``n``.

        Returns each request's last real position's logits ``(B, V)`` if asked, else
        ``None``. Evaluated before it returns, or with ``wait`` false only dispatched
        (``mx.async_eval``): the host may build the next forward while this one runs.
        """
        self.migrations.forwarded()
        return self._forward(reqs, n, logits, counts, wait)

    def _forward(
        self,
        reqs: list[Request],
        n: int,
        logits: bool,
        counts: tuple[int, ...] | None = None,
        wait: bool = True,
    ) -> mx.array | None:
        counts = counts or (n,) * len(reqs)
        pairs = zip(reqs, counts, strict=True)
        inputs = [r.tokens_between(r.written, r.written + c) + [0] * (n - c) for r, c in pairs]
        out, caches = self._batched(reqs, inputs, counts, logits)
        states = self.states.evaluated() if self.states is not None else []
        evaluate = mx.eval if wait else mx.async_eval
        evaluate(out if logits else [], [c.state for c in caches], states)
        return out if logits else None

    def migrate(self, reqs: list[Request]) -> int:
        """Quantize the blocks due for the cold tier in every request (between steps)."""
        return self.migrations.migrate(reqs)

    def decode(self, reqs: list[Request], tokens: mx.array | None = None) -> mx.array:
        """One token for every request (blocks reserved): the lazy logits ``(B, V)``.

        Each request feeds its last token, or row ``i`` of ``tokens (B,)`` where given
        (a previous step's samples, not yet on the host).
        """
        self.migrations.decoded()
        if tokens is None:
            inputs = mx.array([[r.last_token] for r in reqs], dtype=mx.int32)
        else:
            inputs = tokens[:, None]
        if self.compiled is not None:
            return self.compiled(reqs, inputs)
        return self.forward_step(reqs, inputs)

    def forward_step(self, reqs: list[Request], inputs: mx.array) -> mx.array:
        """One uncompiled decode step of ``inputs`` ``(B, 1)``: the lazy logits ``(B, V)``."""
        return self._batched(reqs, inputs)[0]

    def _batched(
        self,
        reqs: list[Request],
        inputs: list[list[int]] | mx.array,
        counts: tuple[int, ...] | None = None,
        logits: bool = True,
    ) -> tuple[mx.array, list]:
        """One forward of ``inputs`` (rows of equal length, of which the first ``counts[i]``
        of row ``i`` are real, all by default) over the requests' tables; advances them.

        Returns each row's last real position's lazy logits ``(B, V)`` and the caches it
        ran on. With ``logits``, the head computes those positions alone.
        """
        n = inputs.shape[1] if isinstance(inputs, mx.array) else len(inputs[0])
        padded = counts is not None and any(c != n for c in counts)
        batches = {
            kind: DecodeBatch(
                self.pools[kind],
                [r.tables[kind] for r in reqs],
                kind.window,
                n,
                counts=list(counts) if padded else None,
            )
            for kind in self.pools
        }
        views: list[StepStateCache] = []
        if self.states is not None:
            rows = self.states.rows([r.slot for r in reqs])
            lengths = counts if padded else None
            views = [
                StepStateCache(self.states, i, rows, lengths) for i in range(self.states.num_layers)
            ]
        caches = self.layout.bind(self.pools, batches, StepPagedKVCache, views.__getitem__)
        x = inputs if isinstance(inputs, mx.array) else mx.array(inputs)
        last = mx.array(counts, dtype=mx.int32) - 1 if padded else None  # last real positions
        with self._head_at(logits and n > 1, last), self.rope_kernel(caches, n):
            out = self.model(x, cache=caches)
        if padded and out.shape[1] == n:  # the head ran over every position
            out = mx.take_along_axis(out, last[:, None, None], axis=1)[:, 0, :]
        else:
            out = out[:, -1, :]  # (B, V)
        for batch in batches.values():
            batch.finish()
        for view in views:
            view.finish()
        return out, caches

    def rope_kernel(self, caches: list, n: int) -> AbstractContextManager:
        """Within: a one-token forward's layers rotate nothing and ``caches`` hand the
        kernel their rotations, where the model left them to it (``engine/rope.py``) and
        a decode kernel stores K/V here (``kernels_write``)."""
        if self.ropes is None or n != 1 or not kernels_write():
            return nullcontext()
        switch, specs = self.ropes
        for cache, spec in zip(caches, specs, strict=False):
            if spec is not None and isinstance(cache, StepPagedKVCache):
                cache.rope = spec
        return switch.deferring()

    def _head_at(self, cut: bool, rows: mx.array | None = None) -> AbstractContextManager:
        """Where ``cut`` (and the model has a ``Head``), the head computes one position
        per row: ``rows``, or the last."""
        return self.head.at(rows) if cut and self.head is not None else nullcontext()

    def sample(self, reqs: list[Request], logits: mx.array) -> list[Sampled]:
        """One token per request from ``(B, V)`` logits, each with its own settings.

        A request whose logits processors or sampler raise, or whose sampler
        gives no token id in ``[0, V)``, gets an error instead; the others do not
        notice. Constrained requests' logits are masked first, in one operation
        over the batch that leaves the other rows as they were. Then every request
        is sampled in one lazy vector, read at once (``pick``).
        """
        self.vocab = vocab = logits.shape[-1]
        errors: dict[int, str] = {}
        if any(r.constraint is not None for r in reqs):
            mx.async_eval(logits)  # the forward runs while the masks are gathered
            words, errors = self.masks.words(reqs, self.vocab)
            logits = mask_logits(logits, mx.array(words))
        out: list[Sampled | None] = [None] * len(reqs)
        for i, error in errors.items():
            out[i] = Sampled(error=error)
        rest = [i for i in range(len(reqs)) if i not in errors]
        if rest:
            rows = logits if len(rest) == len(reqs) else logits[mx.array(rest)]
            batch = [reqs[i] for i in rest]
            for i, s in zip(rest, pick(batch, rows).read(batch, vocab), strict=True):
                out[i] = s
        return out


def mask_logits(logits: mx.array, words: mx.array) -> mx.array:
    """Set ``logits (B, V)`` to ``-inf`` where the bitmask ``words (B, ceil(V / 32))``
    (int32; bit ``t % 32`` of word ``t // 32`` allows token ``t``) has a 0."""
    bits = mx.arange(32, dtype=mx.uint32)
    allowed = (words.view(mx.uint32)[:, :, None] >> bits) & 1
    allowed = allowed.reshape(words.shape[0], -1)[:, : logits.shape[-1]]
    return mx.where(allowed.astype(mx.bool_), logits, mx.array(-mx.inf, logits.dtype))
