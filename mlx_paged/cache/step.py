"""One layer of a ``DecodeBatch`` in mlx-lm's cache protocol: ``StepPagedKVCache``.

The model's forward over every running sequence writes each layer's new K/V
through it and gets back the batch's K/V, or stand-ins where a fused kernel
reads the blocks itself; a decode step's kernel may store the new K/V too.
"""

from __future__ import annotations

import mlx.core as mx

from ..attention import (
    ColdView,
    Fetched,
    PagedLayerCache,
    PagedView,
    PrefillView,
    Rope,
    fused_read,
    kernels_ready,
    kernels_write,
    prefill_kernels_ready,
)
from ..storage import KVPool, take_blocks
from .batch import DecodeBatch


class StepPagedKVCache(PagedLayerCache):
    """One layer's cache for a ``DecodeBatch`` (mlx-lm protocol)."""

    def __init__(self, pool: KVPool, batch: DecodeBatch, layer: int, window: int | None = None):
        self.pool, self.batch, self.layer, self.window = pool, batch, layer, window
        self._fetched: Fetched | None = None
        self._deferred: Fetched | None = None  # stand-ins returned for a deferred read
        self._new: tuple[mx.array, mx.array] | None = None  # K/V left to the kernel to store
        # Set by the engine where the layer's model left its RoPE to the kernel: this step's
        # queries and new keys come unrotated (``engine/rope.py``).
        self.rope: Rope | None = None

    @property
    def offset(self) -> mx.array:
        """Positions of the new tokens, ``(B,)``."""
        return self.batch.offset

    @property
    def keys(self) -> mx.array:
        """The layer's whole key pool. A pipelined mlx-lm model ties its send to the next
        rank to it (``cache.keys = mx.depends(cache.keys, h)``), so that evaluating the
        step's writes also sends."""
        return self.pool.keys[self.layer]

    @keys.setter
    def keys(self, value: mx.array) -> None:
        pool = self.pool.keys[self.layer]
        if not isinstance(value, mx.array) or value.shape != pool.shape:
            got = getattr(value, "shape", type(value).__name__)
            raise ValueError(f"a batch cache's keys are the pool's {pool.shape}; got {got}.")
        self.pool.keys[self.layer] = value

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Write ``(B, H, n_new, D)`` K/V; return ``(B, H, width, D)`` gathered K/V.

        A decode step whose kernel stores its new rows itself (``kernels_write``) leaves
        them in the layer's view instead; ``deferred_read`` writes them where no kernel
        takes the call."""
        b = self.batch
        if keys.ndim != 4 or keys.shape[0] != len(b.tables) or keys.shape[2] != b.n_new:
            raise ValueError(
                f"this batch takes (B={len(b.tables)}, H, {b.n_new}, D) K/V; got {keys.shape}."
            )
        self._fetched = self._deferred = self._new = None
        p, layer = self.pool, self.layer
        p.check_write(layer, keys[:1], values[:1])
        ready = kernels_ready() if b.n_new == 1 else not b.has_cold and prefill_kernels_ready()
        stores = p.defer_reads and ready and b.n_new == 1 and kernels_write()
        if stores and self._as_is(keys, values):  # the kernel stores them (FW), rotated
            self._new = (keys, values)
        else:
            self._write(self._rotated(keys), values)
        if p.defer_reads and ready:
            # A fused kernel will read the blocks itself: no gather to build.
            dtype = p.input_dtypes[layer]
            keys, values = b.stand_ins(keys.shape[1], keys.shape[3], values.shape[3], dtype)
            self._deferred = Fetched(keys, values)
        else:
            keys, values = self._read()
        self._fetched = Fetched(keys, values)
        return keys, values

    def deferred_read(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array] | None:
        """The gathered K/V, if ``keys``/``values`` are this step's stand-ins (after writing
        the new K/V that no kernel stored)."""
        if self._new is not None:
            keys_new, values_new = self._new
            self._write(self._rotated(keys_new), values_new)
            self._new = None
        if self._deferred is None or not self._deferred.matches(keys, values):
            return None
        return self._read()

    def rotated_queries(self, queries: mx.array) -> mx.array:
        """``queries`` rotated where the kernel was to rotate them (``rope``)."""
        return self._rotated(queries)

    def _rotated(self, x: mx.array) -> mx.array:
        return x if self.rope is None else self.rope.apply(x, self.batch.offset)

    def _as_is(self, keys: mx.array, values: mx.array) -> bool:
        """Whether the pool stores these K/V in their own dtype (a kernel copies rows as is)."""
        p, layer = self.pool, self.layer
        return keys.dtype == values.dtype == p.keys[layer].dtype == p.values[layer].dtype

    def _write(self, keys: mx.array, values: mx.array) -> None:
        p, b, layer = self.pool, self.batch, self.layer
        b.write(p.keys[layer], p.to_storage(keys.swapaxes(1, 2)))  # (B, n_new, H, D)
        b.write(p.values[layer], p.to_storage(values.swapaxes(1, 2)))

    def _read(self) -> tuple[mx.array, mx.array]:
        """``(B, H, width, D)`` K/V of the batch's blocks, in the layer's input dtype."""
        p, layer, b = self.pool, self.layer, self.batch
        pk, pv = p.keys[layer], p.values[layer]
        if b.plan is not None:
            keys, values = p.read_tiered(layer, b.plan)
        else:
            # A prefill step's attention reads the gathered K/V: let a device kernel copy them.
            read = fused_read(pk, pv, b.slots) if b.n_new > 1 else None
            keys, values = read or take_blocks(pk, pv, b.slots)
        dtype = p.input_dtypes[layer]
        if keys.dtype != dtype:
            keys, values = keys.astype(dtype), values.astype(dtype)
        return keys, values

    def make_mask(
        self, N: int, return_array: bool = False, window_size: int | None = None
    ) -> mx.array:
        """The padding/causal/window mask for the batch's queries."""
        if N != self.batch.n_new:
            raise ValueError(f"this batch takes {self.batch.n_new} tokens per sequence, got {N}.")
        return self.batch.mask(window_size or self.window)

    def fetched(self, keys: mx.array, values: mx.array, mask: object) -> bool:
        """Whether attention got this layer's own K/V and a mask this batch made."""
        own = self._fetched is not None and self._fetched.matches(keys, values)
        own = own and mask is self.batch.masks.get(self.window)  # same window as the view
        self._fetched = None
        return own

    def paged_view(self) -> PagedView:
        """Where this layer's K/V lie, for fused kernels."""
        b = self.batch
        cold = self.pool.cold_arrays(self.layer) if b.has_cold else None
        new = self._new or (None, None)
        return PagedView(
            keys=self.pool.keys[self.layer],
            values=self.pool.values[self.layer],
            block_tables=b.view_tables,
            starts=b.starts,
            lengths=b.lengths,
            window=self.window,
            cold=None if cold is None else ColdView(*cold),
            new_keys=new[0],
            new_values=new[1],
            rope=self.rope,
        )

    def prefill_view(self) -> PrefillView | None:
        """Where a batched prefill's K/V lie, for fused prefill kernels (``None`` with cold
        blocks, which they do not read)."""
        b = self.batch
        if b.has_cold:
            return None
        return PrefillView(
            keys=self.pool.keys[self.layer],
            values=self.pool.values[self.layer],
            block_tables=b.view_tables,
            starts=b.starts,
            offsets=b.offset,
            lengths=b.lengths,
            window=self.window,
        )

    @property
    def state(self) -> tuple:
        """The layer's pool arrays, so ``mx.eval`` forces this step's writes (a kernel's
        stores of the new K/V come with its output)."""
        return (self.pool.keys[self.layer], self.pool.values[self.layer])
