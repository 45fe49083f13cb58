"""A GatedDeltaNet layer's recurrent state at one position inside a prefill forward.

A hybrid's prefill snapshots the recurrent state where later requests may start:
the end of a prompt's last full block, a prefix shared with earlier prompts, every
``state_snapshot_interval`` tokens. Taken where a forward ends, such a snapshot
cuts a prompt's prefill in two forwards: a burst of questions after a cached system
prompt ran one forward to its last full block and another for its tail (BENCHMARKS.md,
runs 636-638), each costing a GPU forward's host and launch work.

Inside ``capturing(offsets)``, each of mlx-lm's GatedDeltaNet layers (qwen3_5,
qwen3_5_moe, qwen3_next) records, for every row ``b``, its state after the
forward's first ``offsets[b]`` tokens: the convolution's window, read from the
input of its ``DepthwiseConv1d`` (``route_convolutions``), and the delta rule's
state, from one more masked ``gated_delta_update`` over the first
``max(offsets)`` tokens. The forward's own outputs do not change.
``routing.captures_states(model, layers)`` says whether every recurrent layer of a
model records; ``MLX_PAGED_CAPTURE=off`` turns recording off.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import mlx.core as mx
from mlx_lm.models import gated_delta, qwen3_5, qwen3_next

#: mlx-lm's GatedDeltaNet classes whose calls ``capturing`` records, and the modules
#: whose ``gated_delta_update`` they call.
GATED_DELTA_LAYERS = (qwen3_5.GatedDeltaNet, qwen3_next.Qwen3NextGatedDeltaNet)
_CALLERS = (qwen3_5, qwen3_next)

_active = threading.local()


class Capture:
    """Per layer, in call order: ``[conv window, delta state]``, each ``(B, ...)``.

    Args:
        offsets: Per row, the tokens of the forward before the position to record
            (0: a row whose record is not wanted).
    """

    def __init__(self, offsets: list[int]):
        if not offsets or min(offsets) < 0:
            raise ValueError(f"offsets must be non-negative, one per row, got {offsets}.")
        self.offsets = mx.array(offsets, dtype=mx.int32)
        self.longest = max(offsets)
        self.layers: list[list[mx.array | None]] = []
        self.broken = False  # a call came out of order

    def conv(self, x: mx.array, keep: int) -> None:
        """A convolution's input ``(B, keep + T, C)``: its window after each row's offset."""
        at = self.offsets[:, None] + mx.arange(keep)
        self.layers.append([mx.take_along_axis(x, at[..., None], axis=1), None])

    def delta(self, state: mx.array) -> None:
        """The delta rule's state ``(B, ...)`` after each row's offset."""
        if not self.layers or self.layers[-1][1] is not None:
            self.broken = True
            return
        self.layers[-1][1] = state

    def states(self, layers: int) -> list[list[mx.array]] | None:
        """Each of ``layers`` layers' ``[conv, state]``, or ``None`` unless exactly that many
        layers recorded both."""
        complete = all(s is not None for layer in self.layers for s in layer)
        if self.broken or not complete or len(self.layers) != layers:
            return None
        return self.layers


@contextmanager
def capturing(offsets: list[int]) -> Iterator[Capture]:
    """Within: GatedDeltaNet layers record their state after ``offsets[b]`` tokens of row
    ``b`` into the ``Capture`` yielded (this thread only)."""
    capture = Capture(offsets)
    _active.capture = capture
    try:
        yield capture
    finally:
        _active.capture = None


def active() -> Capture | None:
    """The capture of this thread's forward, if one records."""
    return getattr(_active, "capture", None)


def route_capture() -> bool:
    """Give mlx-lm's GatedDeltaNet modules ``captured_update`` for ``gated_delta_update``;
    idempotent. Returns whether it is routed (not with ``MLX_PAGED_CAPTURE=off``)."""
    if os.environ.get("MLX_PAGED_CAPTURE", "").strip().lower() == "off":
        return False
    for module in _CALLERS:
        module.gated_delta_update = captured_update
    return True


def captured_update(q: mx.array, k: mx.array, v: mx.array, a: mx.array, b: mx.array, *args, **kw):
    """``gated_delta_update``; inside ``capturing``, also the state after each row's offset
    (the same recurrence over the first ``longest`` tokens, masked after the offset)."""
    out = gated_delta.gated_delta_update(q, k, v, a, b, *args, **kw)
    capture = active()
    if capture is not None and q.shape[1] > 1:
        n = capture.longest
        names = ("A_log", "dt_bias", "state", "mask")
        given = dict(zip(names, args, strict=False)) | kw
        given["mask"] = mx.arange(n)[None] < capture.offsets[:, None]
        cut = [x[:, :n] for x in (q, k, v, a, b)]
        capture.delta(gated_delta.gated_delta_update(*cut, **given)[1])
    return out
