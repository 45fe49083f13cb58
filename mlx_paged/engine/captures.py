"""Snapshots a hybrid's prefill forward takes inside itself (``attention.capture``).

Where ``StateSlots.captures`` holds, the scheduler leaves one snapshot position
inside a forward instead of ending the forward there (``Request.captures``).
``snapshots_inside`` runs a forward under ``attention.capturing`` and leaves each
row's state at that position on its request (``Request.captured``), copied out
of the batch, for the scheduler to index once the forward has run.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

import mlx.core as mx

from ..attention.capture import capturing
from ..storage import StatePool
from .request import Request

logger = logging.getLogger("mlx_paged.engine")


@contextmanager
def snapshots_inside(
    states: StatePool | None, reqs: list[Request], counts: tuple[int, ...]
) -> Iterator[list[mx.array]]:
    """Within: the forward of ``counts[i]`` tokens of each of ``reqs`` records the state
    at the capture position each has inside it. Yields a list that holds, on exit, the
    arrays to evaluate with the forward's; sets ``Request.captured``. A model whose
    layers did not all record turns ``states.captures`` off, with a warning."""
    offsets = [_inside(r, c) for r, c in zip(reqs, counts, strict=True)]
    if states is None or not states.captures or not any(offsets):
        yield []
        return
    taken: list[mx.array] = []
    starts = [r.written for r in reqs]
    with capturing(offsets) as capture:
        yield taken
    layers = capture.states(states.num_layers)
    if layers is None:
        states.captures = False
        logger.warning(
            "mlx_paged: the model's recurrent layers did not record their state inside a "
            "forward; snapshots end forwards from now on."
        )
        return
    for i, (req, offset) in enumerate(zip(reqs, offsets, strict=True)):
        if offset:
            at = mx.array([i], dtype=mx.int32)  # a copy: a slice would hold the whole batch
            state = [[entry[at] for entry in layer] for layer in layers]
            req.captured = (starts[i] + offset, state)
            taken += [entry for layer in state for entry in layer]


def _inside(req: Request, count: int) -> int:
    """Tokens of ``req``'s next ``count`` before a capture position inside them, or 0."""
    start = req.written
    return next((c - start for c in req.captures if start < c < start + count), 0)
