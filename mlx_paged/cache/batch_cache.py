"""``PagedBatchKVCache``: mlx-lm's batch-cache protocol over block tables.

mlx-lm batches requests (``batch_generate``, ``BatchGenerator``, ``mlx_lm.server``)
by building one cache list per request, merging them layer by layer with
``type(cache).merge``, prefilling right-padded prompts between ``prepare`` and
``finalize``, and moving requests with ``filter``, ``extend`` and ``extract``.
Here each of those moves block tables; K/V is never copied within a pool, and
right padding is never stored: each sequence writes only its real tokens, at
its own offset.

mlx-lm calls every batch operation once per layer. The layers of one layer
group share one ``PagedBatch`` (the tables, in batch order); the first layer to
ask applies an operation and the others find it done.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx

from ..attention import PagedLayerCache, PagedView, PrefillView
from ..blocks import BlockTable
from ..storage import KVPool, copy_table
from .batch import DecodeBatch
from .step import StepPagedKVCache


class PagedBatch:
    """The block tables of a batch in one layer group, shared by the group's layer caches.

    Args:
        pool: Where every table's blocks live.
        tables: One per sequence, in batch order; the batch holds them.
        window: The group's sliding window, or ``None``.
        single: The one-sequence cache type ``extract`` returns.
    """

    def __init__(self, pool: KVPool, tables: list[BlockTable], window: int | None, single: type):
        self.pool, self.tables, self.window, self.single = pool, tables, window, single
        self.ends: list[int] | None = None  # per sequence, where a right-padded prompt ends
        self._op: tuple[tuple, set[int], Any] | None = None
        self._step: tuple[tuple, StepPagedKVCache] | None = None
        self._offsets: tuple[tuple[int, ...], mx.array] | None = None

    def offsets(self, layer: int) -> mx.array:
        """``(B,)`` int32: where each sequence's next token goes in ``layer``."""
        now = tuple(t.lengths[layer] for t in self.tables)
        if self._offsets is None or self._offsets[0] != now:
            self._offsets = (now, mx.array(now, dtype=mx.int32))
        return self._offsets[1]

    def once(self, layer: int, key: tuple, apply: Callable[[], Any]) -> Any:
        """``apply()`` for the first layer that asks for ``key``; the others get its result.

        A layer asking again (or another key) starts a new operation.
        """
        if self._op is None or self._op[0] != key or layer in self._op[1]:
            self._op = (key, {layer}, apply())
        else:
            self._op[1].add(layer)
        return self._op[2]

    def step(self, layer: int, n: int) -> StepPagedKVCache:
        """This forward's view of the batch for ``layer``: ``n`` query tokens per sequence.

        The first layer of a forward gives the new tokens private blocks (and a
        window's old blocks back); later layers, with the same offsets, share it.
        """
        pool, window = self.pool, self.window
        offsets = [t.lengths[layer] for t in self.tables]
        if self.ends is None:
            counts = [n] * len(offsets)
        else:
            counts = [min(n, max(0, e - o)) for e, o in zip(self.ends, offsets, strict=True)]

        def key() -> tuple:  # any new holder of a block (shares) may call for a copy
            versions = tuple((id(t), t.version) for t in self.tables)
            return (n, tuple(offsets), tuple(counts), versions, pool.blocks.shares)

        if self._step is None or self._step[0] != key():  # the first layer of a forward
            pool.maybe_migrate(self.tables)
            for t, o, c in zip(self.tables, offsets, counts, strict=True):
                if window is not None:
                    pool.drop_before(t, max(0, o - window + 1))
                if c:
                    pool.reserve(t, o, o + c)
            batch = DecodeBatch(pool, self.tables, window, n, offsets, counts)
            self._step = (key(), StepPagedKVCache(pool, batch, layer, window))
        view = self._step[1]
        view.layer = layer
        return view

    def absorb(self, other: PagedBatch) -> None:
        """Append ``other``'s sequences (copied in once if they live in another pool)."""
        if other.pool is self.pool:
            tables = other.tables
        else:
            tables = [copy_table(other.pool, self.pool, t) for t in other.tables]
            for t in other.tables:
                other.pool.release(t)
        if self.ends is not None or other.ends is not None:
            own = self.ends or [t.end for t in self.tables]
            self.ends = own + (other.ends or [t.end for t in other.tables])
        self.tables = self.tables + tables
        other.tables, other.ends = [], None

    def keep(self, indices: list[int]) -> None:
        """Keep only the sequences at ``indices``, in that order; release the others."""
        kept, seen = [], set()
        for i in indices:  # a repeated index gets its own fork of the table
            kept.append(self.pool.fork(self.tables[i]) if i in seen else self.tables[i])
            seen.add(i)
        for i, t in enumerate(self.tables):
            if i not in seen:
                self.pool.release(t)
        if self.ends is not None:
            self.ends = [self.ends[i] for i in indices]
        self.tables = kept


# Batches being merged, layer by layer: the key is the merged tables' ids, checked
# against weak references so a reused id never matches a dead table.
_merging: dict[tuple[int, ...], tuple[list[weakref.ref], PagedBatch, set[int]]] = {}
MAX_MERGING = 16


class PagedBatchKVCache(PagedLayerCache):
    """One layer of a batch of sequences in a shared pool: mlx-lm's batch-cache protocol.

    Made by ``PagedKVCache.merge``. ``offset`` is each sequence's own position;
    ``make_mask`` masks padding, causality and windows per sequence.
    """

    def __init__(self, batch: PagedBatch, layer: int):
        self.batch, self.layer = batch, layer
        self._view: StepPagedKVCache | None = None  # the last forward's view of this layer

    @classmethod
    def merge(cls, caches: Sequence[Any], single: type) -> PagedBatchKVCache:
        """One layer of a batch from one-sequence caches of type ``single``.

        Caches in one pool (``install_paged_cache``) are forked: the batch takes
        references to their blocks and copies none. Caches from different pools
        (a ``make_paged_cache`` call each) are copied once into the first one's
        kind of pool, every layer of the group at the first layer's merge.

        Raises:
            ValueError: for an empty list, caches of another type, or caches of
                different layers, windows, block sizes or models.
        """
        if not caches:
            raise ValueError("merge needs at least one cache.")
        first = caches[0]
        for c in caches:
            if not isinstance(c, single):
                raise ValueError(f"cannot merge a {type(c).__name__} into a {single.__name__}.")
            if (c.layer, c.window, c.pool.block_size) != (
                first.layer,
                first.window,
                first.pool.block_size,
            ):
                raise ValueError(
                    "merged caches must be the same layer of the same model with the same "
                    f"block size: got (layer, window, block_size) "
                    f"{(c.layer, c.window, c.pool.block_size)} and "
                    f"{(first.layer, first.window, first.pool.block_size)}."
                )
        tables = [c.table for c in caches]
        key = tuple(id(t) for t in tables)
        held = _merging.get(key)
        if held and all(r() is t for r, t in zip(held[0], tables, strict=True)):
            if first.layer not in held[2]:
                held[2].add(first.layer)
                if len(held[2]) == held[1].pool.num_layers:
                    del _merging[key]
                return cls(held[1], first.layer)
        if all(c.pool is first.pool for c in caches):
            pool = first.pool
            forks = [pool.fork(t) for t in tables]
        else:
            pool = KVPool(first.pool.num_layers, first.pool.block_size, None, first.pool.kv_dtype)
            forks = [copy_table(c.pool, pool, c.table) for c in caches]
        batch = PagedBatch(pool, forks, first.window, single)
        if pool.num_layers > 1:
            while len(_merging) >= MAX_MERGING:  # merges left unfinished: forget the oldest
                del _merging[next(iter(_merging))]
            _merging[key] = ([weakref.ref(t) for t in tables], batch, {first.layer})
        return cls(batch, first.layer)

    # ---- mlx-lm protocol --------------------------------------------------

    @property
    def offset(self) -> mx.array:
        """Each sequence's position, ``(B,)``: where its next token goes."""
        return self.batch.offsets(self.layer)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Write ``(B, H, n, D)`` K/V (padding not stored); return ``(B, H, width, D)``."""
        if keys.ndim != 4:
            raise ValueError(f"keys must be (B, H, n, D); got {keys.shape}.")
        view = self.batch.step(self.layer, keys.shape[2])
        out = view.update_and_fetch(keys, values)
        self._view = view
        for t, c in zip(self.batch.tables, view.batch.new_tokens, strict=True):
            t.lengths[self.layer] += c
        return out

    def make_mask(
        self, N: int, return_array: bool = False, window_size: int | None = None
    ) -> mx.array:
        """``(B, 1, N, width)`` bool: padding, causality and the window, per sequence."""
        window = self.batch.window
        if window_size is not None and window is not None:
            window_size = min(window_size, window)  # the layer holds no older keys
        return self.batch.step(self.layer, N).make_mask(N, window_size=window_size)

    def prepare(
        self,
        *,
        left_padding: Sequence[int] | None = None,
        lengths: Sequence[int] | None = None,
        right_padding: Sequence[int] | None = None,
    ) -> None:
        """Before a right-padded prefill: ``lengths[i]`` of the next tokens are real."""
        if left_padding is not None and any(left_padding):
            raise ValueError(
                "PagedBatchKVCache stores no padding; give right_padding and lengths, as "
                "mlx-lm's BatchGenerator does."
            )
        if right_padding is None or not any(right_padding):
            return
        if lengths is None or len(lengths) != len(self.batch.tables):
            raise ValueError(f"give one length per sequence ({len(self.batch.tables)}).")

        def apply() -> None:
            tables = self.batch.tables
            self.batch.ends = [
                t.lengths[self.layer] + n for t, n in zip(tables, lengths, strict=True)
            ]

        self.batch.once(self.layer, ("prepare", tuple(lengths)), apply)

    def finalize(self) -> None:
        """After a right-padded prefill: nothing to move, the padding was never stored."""
        self.batch.once(self.layer, ("finalize",), lambda: setattr(self.batch, "ends", None))

    def filter(self, batch_indices: Sequence[int] | mx.array) -> None:
        """Keep only the sequences at ``batch_indices``; the others' blocks are released."""
        if isinstance(batch_indices, mx.array):
            batch_indices = batch_indices.tolist()
        given = tuple(batch_indices)

        def apply() -> None:  # checked by the first layer, against the batch it filters
            indices = self._indices(given)
            if not indices:
                raise ValueError("filter needs at least one index; drop the cache to empty it.")
            self.batch.keep(indices)

        self.batch.once(self.layer, ("filter", given), apply)

    def extend(self, other: PagedBatchKVCache) -> None:
        """Append ``other``'s sequences (its tables move here; ``other`` is left empty)."""
        if not isinstance(other, PagedBatchKVCache):
            raise ValueError(f"cannot extend a paged batch with a {type(other).__name__}.")
        if (other.layer, other.batch.window, other.batch.pool.block_size) != (
            self.layer,
            self.batch.window,
            self.batch.pool.block_size,
        ):
            raise ValueError("extend needs the same layer of a batch with the same block size.")
        key = ("extend", id(other.batch))
        self.batch.once(self.layer, key, lambda: self.batch.absorb(other.batch))

    def extract(self, idx: int) -> Any:
        """Sequence ``idx`` as a one-sequence cache sharing its blocks (copy-on-write)."""
        (i,) = self._indices([idx])
        b = self.batch
        table = b.once(self.layer, ("extract", i), lambda: b.pool.fork(b.tables[i]))
        return b.single(b.pool, table, self.layer, b.window)

    @property
    def state(self) -> tuple:
        """The layer's pool arrays, so ``mx.eval`` forces this forward's writes."""
        pool = self.batch.pool
        return (pool.keys[self.layer], pool.values[self.layer])

    def keys_and_values(self) -> tuple[mx.array, mx.array]:
        """Each sequence's retained K/V, left-padded with zeros to one length: ``(B, H, T, D)``."""
        pool = self.batch.pool
        kv = [pool.gather_visible(t, self.layer) for t in self.batch.tables]
        longest = max(k.shape[2] for k, _ in kv)
        pad = [[(0, 0), (0, 0), (longest - k.shape[2], 0), (0, 0)] for k, _ in kv]
        keys = mx.concatenate([mx.pad(k, p) for (k, _), p in zip(kv, pad, strict=True)])
        values = mx.concatenate([mx.pad(v, p) for (_, v), p in zip(kv, pad, strict=True)])
        return keys, values

    def size(self) -> int:
        """The longest sequence's tokens."""
        return max((t.lengths[self.layer] for t in self.batch.tables), default=0)

    def empty(self) -> bool:
        """Whether no sequence has K/V."""
        return self.size() == 0

    def is_trimmable(self) -> bool:
        """Full layers always; sliding layers until a sequence has given blocks back."""
        return self.batch.window is None or all(t.first == 0 for t in self.batch.tables)

    def trim(self, n: int) -> int:
        """Forget each sequence's last ``n`` tokens (at most the shortest's length)."""
        if not self.is_trimmable():
            return 0
        n = min([n] + [t.lengths[self.layer] for t in self.batch.tables])
        for t in self.batch.tables:
            self.batch.pool.truncate(t, self.layer, t.lengths[self.layer] - n)
        return n

    @property
    def nbytes(self) -> int:
        """Bytes of the blocks the batch's tables hold in this layer (shared ones per holder)."""
        blocks = [b for t in self.batch.tables for b in t.blocks]
        return self.batch.pool.held_bytes(self.layer, blocks)

    def __deepcopy__(self, memo: dict) -> PagedBatchKVCache:
        # The layers of a batch share a PagedBatch: fork its tables once per deepcopy call.
        b = self.batch
        if id(b) not in memo:
            copy = PagedBatch(b.pool, [b.pool.fork(t) for t in b.tables], b.window, b.single)
            copy.ends = None if b.ends is None else list(b.ends)
            memo[id(b)] = copy
        return PagedBatchKVCache(memo[id(b)], self.layer)

    # ---- paged extras -----------------------------------------------------

    def fetched(self, keys: mx.array, values: mx.array, mask: object) -> bool:
        """Whether attention got this forward's own K/V and mask."""
        return self._view is not None and self._view.fetched(keys, values, mask)

    def deferred_read(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array] | None:
        """The last forward's gathered K/V, if these are the stand-ins it returned."""
        if self._view is None:
            return None
        self._view.layer = self.layer
        return self._view.deferred_read(keys, values)

    def paged_view(self) -> PagedView:
        """Where this layer's K/V lie in the last forward, for fused kernels."""
        self._view.layer = self.layer
        return self._view.paged_view()

    def prefill_view(self) -> PrefillView | None:
        """Where this layer's K/V lie in the last forward, for fused prefill kernels."""
        if self._view is None:
            return None
        self._view.layer = self.layer
        return self._view.prefill_view()

    def _indices(self, indices: Sequence[int]) -> list[int]:
        out, n = [], len(self.batch.tables)
        for i in indices:
            if isinstance(i, bool) or not isinstance(i, int) or not -n <= i < n:
                raise ValueError(f"batch index {i!r} is outside this batch of {n} sequences.")
            out.append(i % n)
        return out
