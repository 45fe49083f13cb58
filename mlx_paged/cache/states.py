"""A recurrent layer's state for one batched step, in mlx-lm's ``ArraysCache`` protocol."""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache

from ..storage import StatePool


class StepStateCache(ArraysCache):
    """One recurrent layer's state for the requests of a step, read from their slots.

    The model reads and replaces the entries (``cache[0]``, ``cache[1]``, ...) as
    with mlx-lm's own ``ArraysCache``; ``finish`` stores what it left in the
    requests' slots. Rows padded on the right carry ``lengths``, which mlx-lm's
    recurrent layers that support it read to keep each row's state at its last
    real token (``PagedLayout.padded_states``).

    Args:
        pool: The state arrays.
        layer: Which recurrent layer of the pool.
        rows: The requests' slots, in batch order, as ``StatePool.rows`` gives them.
        lengths: Real tokens per row of a padded forward, or ``None`` (no padding).
    """

    def __init__(
        self,
        pool: StatePool,
        layer: int,
        rows: mx.array | int,
        lengths: Sequence[int] | None = None,
    ):
        super().__init__(len(pool.arrays[layer]))
        self.pool, self.layer, self.rows = pool, layer, rows
        self.cache = pool.read(layer, rows)
        # One array per layer: ``advance`` updates it in place.
        self.lengths = None if lengths is None else mx.array(lengths, dtype=mx.int32)

    def finish(self) -> None:
        """Write the step's new state back to the slots (after the forward)."""
        self.pool.write(self.layer, self.rows, self.cache)
