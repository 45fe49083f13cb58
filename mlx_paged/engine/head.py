"""A prefill forward's head over the positions it samples, not over the whole chunk.

The forward that gives a request its first token needs one position's logits per
row, but an mlx-lm model applies its head (``lm_head``, or the tied embedding's
``as_linear``) to every position it is given: for a chunk of 2,048 tokens and a
vocabulary of 128k, a matmul a fifth the size of the rest of the forward and
2,048 x 128k logits in memory, of which one row is read. ``Head`` wraps the
model's head so that, inside ``Head.at``, its input is cut to the chosen
position of each row first; the model's own code runs as it is, and what it
does to the logits after the head (a soft cap, a scale) sees ``(B, 1, V)``.

The head is found by name: modules called ``lm_head``, or, where there is none
(tied weights), the ``as_linear`` of the model's one embedding. A model with
neither (or with several embeddings and no ``lm_head``) gets no ``Head``, and
its forwards compute the head over every position, as before.
Outside ``Head.at`` the wrapped head is the model's own (a compiled decode
step traces it unchanged). The cut is per thread: engines on one model in two
threads do not see each other's.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import mlx.core as mx
import mlx.nn as nn


class Head:
    """The head of ``model``, cut to chosen positions inside ``at``; see ``Head.of``."""

    def __init__(self, model: nn.Module, heads: list[nn.Module], tied: list[nn.Module]):
        self.model = model
        self.heads, self.tied = heads, tied
        self._local = threading.local()

    @classmethod
    def of(cls, model: nn.Module) -> Head | None:
        """``model``'s ``Head``, made once per model (wrapping its head), or ``None``
        where it has no module named ``lm_head`` and not one embedding with ``as_linear``."""
        made = model.__dict__.get("_mlx_paged_head")
        if made is not None:
            return made
        named = model.named_modules()
        heads = [m for name, m in named if name.rsplit(".", 1)[-1] == "lm_head"]
        tied = [] if heads else [m for _, m in named if callable(getattr(m, "as_linear", None))]
        if not heads and len(tied) != 1:
            return None
        self = cls(model, heads, tied)
        for module in heads:
            module.__class__ = _cutting(type(module))
            module._mlx_paged_head = self
        for module in tied:
            linear = module.as_linear
            module.as_linear = lambda x, linear=linear: linear(self.cut(x))
        object.__setattr__(model, "_mlx_paged_head", self)
        return self

    @contextmanager
    def at(self, rows: mx.array | None = None) -> Iterator[None]:
        """Inside: the head computes one position per row, row ``i``'s ``rows[i]``
        (``(B,)`` int32), or the last of every row where ``rows`` is ``None``."""
        self._local.rows, self._local.on = rows, True
        try:
            yield
        finally:
            self._local.rows, self._local.on = None, False

    def cut(self, x: mx.array) -> mx.array:
        """The head's input ``(B, L, D)`` cut to ``(B, 1, D)`` inside ``at``; else ``x``."""
        if not getattr(self._local, "on", False) or x.ndim != 3:
            return x
        rows = self._local.rows
        if rows is None:
            return x[:, -1:, :]
        return mx.take_along_axis(x, rows[:, None, None], axis=1)


_CUTTING: dict[type, type] = {}


def _cutting(base: type) -> type:
    """A subclass of the head's class whose call cuts its input first (the module's
    parameters, and so its weights' names, stay as they were)."""
    if base in _CUTTING.values():
        return base
    made = _CUTTING.get(base)
    if made is None:

        def __call__(self, x: mx.array, *args, **kwargs) -> mx.array:
            return base.__call__(self, self._mlx_paged_head.cut(x), *args, **kwargs)

        made = _CUTTING[base] = type(base.__name__, (base,), {"__call__": __call__})
    return made
