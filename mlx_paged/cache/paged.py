"""``PagedKVCache``: mlx-lm's cache protocol over a shared block pool.

One ``PagedKVCache`` is one layer of one sequence. The layers of a sequence
that share a ``KVPool`` (all full-attention layers, or all sliding-window
layers with the same window) share one ``BlockTable``, so a block id names the
same token slots in every one of those layers.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models import cache as mlx_cache
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import KVCache

from ..attention import (
    ColdView,
    Fetched,
    PagedLayerCache,
    PagedView,
    attention_path,
    fused_read,
    kernels_ready,
    route_attention,
    stand_ins,
    views_read_in_place,
)
from ..blocks import COLD, HOLE, BlockTable, PagedCacheStats, is_cold
from ..storage import KVPool, check_kv_quant
from .batch import pad_tables
from .batch_cache import PagedBatchKVCache


class PagedKVCache(PagedLayerCache, KVCache):
    """One layer's KV cache for one sequence, stored in a shared ``KVPool``.

    Use ``make_paged_cache(model)`` to build a model's caches. ``update_and_fetch``
    returns the layer's K/V gathered lazily from the blocks (a decode step whose
    attention a fused kernel will serve returns stand-ins, see
    ``PagedLayerCache.deferred_read``); ``copy.deepcopy``
    forks by reference (copy-on-write), it never copies the pool. A subclass of
    mlx-lm's ``KVCache`` for code that checks the type; it overrides every member.

    Args:
        pool: Storage for the layer group this layer belongs to.
        table: The sequence's block table in ``pool``.
        layer: This layer's index within ``pool``.
        window: Sliding-window size in tokens, or ``None`` for full attention.
    """

    def __init__(self, pool: KVPool, table: BlockTable, layer: int, window: int | None = None):
        self.pool = pool
        self.table = table
        self.layer = layer
        self.window = window
        self._fetched: Fetched | None = None
        self._deferred: tuple[Fetched, int, int] | None = None  # stand-ins, first, end
        self._in_place = False  # the last fetch returned views of the pool (``run_view``)

    # ---- mlx-lm protocol --------------------------------------------------

    @property
    def offset(self) -> int:
        """Tokens this layer has seen."""
        return self.table.lengths[self.layer]

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Write ``(1, H, n, D)`` K/V at the tail; return the K/V attention should read.

        Full attention returns every token; a sliding window returns tokens from
        the start of the block holding the oldest key any new query sees.
        """
        self._fetched = self._deferred = None
        if self.window is None and _one_token(self.pool, keys, values):
            view = self.pool.append_view(self.table, self.layer, keys, values)
            if view is not None:  # written, and read in place: no other check needed
                self._in_place = True
                return view
        start = self.offset
        if self.layer == 0 and self.pool.quant is not None:  # between steps: due blocks go cold
            self.pool.maybe_migrate([self.table])
        self.pool.write_prefill(self.table, self.layer, keys, values)
        lo = read_start(start, self.window, self.pool.block_size)
        n, end = keys.shape[2], self.offset
        view = _in_place_view(self.pool, self.table, self.layer, n, lo, end)
        if view is not None:
            keys, values = view
        elif n == 1 and self.pool.defer_reads and kernels_ready():
            t, dtype = end - lo, self.pool.input_dtypes[self.layer]
            shapes = ((1, keys.shape[1], t, keys.shape[3]), (1, keys.shape[1], t, values.shape[3]))
            keys, values = _stand_ins(self.table, shapes, dtype)
            self._deferred = (Fetched(keys, values), lo, end)
        else:
            # A prefill chunk's attention reads the gathered K/V: let a device kernel copy them.
            read = fused_read if n > 1 else None
            keys, values = self.pool.gather(self.table, self.layer, lo, end, read)
        if view is None:  # a view goes to MLX's own attention, never to a kernel
            self._fetched = Fetched(keys, values)
        self._in_place = view is not None
        if self.window is not None:
            # Blocks this step's queries do not read go back now; a fused kernel
            # reads the blocks after this, so nothing it needs may go yet.
            self.pool.drop_before(self.table, lo)
        return keys, values

    def make_mask(
        self, N: int, return_array: bool = False, window_size: int | None = None
    ) -> mx.array | str | None:
        """The mask for ``N`` new queries against what ``update_and_fetch`` will return."""
        if self.window is None:
            if window_size is not None:
                return create_causal_mask(N, self.offset, window_size=window_size)
            if N == 1:
                return None
            return create_causal_mask(N, self.offset) if return_array else "causal"
        self.table.mask = _window_mask(
            N, self.offset, self.window, self.pool.block_size, window_size, return_array
        )
        return self.table.mask

    @property
    def state(self) -> tuple:
        """This layer's pool arrays, the sequence's blocks and scalars.

        Evaluating it forces pending writes without copying; ``from_state``
        keeps only this sequence's blocks.
        """
        p, t = self.pool, self.table
        dtype = p.input_dtypes[self.layer]
        state = (
            p.keys[self.layer],
            p.values[self.layer],
            mx.array(t.blocks, dtype=mx.int32),
            t.first,
            self.offset,
            self.window,
            p.block_size,
            None if dtype is None else str(dtype).rsplit(".", 1)[-1],
        )
        parts = None if p.cold is None else p.cold.layer_parts(self.layer)
        if parts is None:
            return state
        q = p.quant
        return (*state, *parts[0], *parts[1], q.bits, q.group_size, q.hot_tokens)

    @state.setter
    def state(self, v: tuple) -> None:
        self.pool, self.table, self.window = _restore(v)
        self.layer, self._fetched, self._deferred, self._in_place = 0, None, None, False

    @classmethod
    def from_state(cls, state: tuple) -> PagedKVCache:
        """Rebuild one layer from ``state`` into a private pool (used by ``load_prompt_cache``)."""
        obj = cls.__new__(cls)
        obj.state = state
        return obj

    def is_trimmable(self) -> bool:
        """Full layers always; sliding layers until they have given blocks back."""
        return self.window is None or self.table.first == 0

    def trim(self, n: int) -> int:
        """Forget the last ``n`` tokens (at most ``offset``); return how many were dropped."""
        if not self.is_trimmable():
            return 0
        n = min(self.offset, n)
        self.pool.truncate(self.table, self.layer, self.offset - n)
        return n

    def size(self) -> int:
        """Tokens attention reads: all of them, or the window."""
        return self.offset if self.window is None else min(self.offset, self.window)

    def empty(self) -> bool:
        """Whether nothing has been written."""
        return self.offset == 0

    @property
    def nbytes(self) -> int:
        """Bytes of the blocks this layer's table holds, in their tier (shared ones per holder)."""
        return self.pool.held_bytes(self.layer, self.table.blocks)

    def __deepcopy__(self, memo: dict) -> PagedKVCache:
        # Layers of one sequence share a table; fork it once per deepcopy call.
        key = id(self.table)
        if key not in memo:
            memo[key] = self.pool.fork(self.table)
        return PagedKVCache(self.pool, memo[key], self.layer, self.window)

    @classmethod
    def merge(cls, caches: list[PagedKVCache]) -> PagedBatchKVCache:
        """One layer of a batch from these sequences' caches (see ``PagedBatchKVCache.merge``)."""
        return PagedBatchKVCache.merge(caches, single=cls)

    def keys_and_values(self) -> tuple[mx.array, mx.array]:
        """This layer's retained K/V as contiguous ``(1, H, T, D)`` arrays."""
        return self.gather_visible()

    @property
    def keys(self) -> mx.array | None:
        """The retained keys, ``(1, H, T, D)``, read from the blocks (``None`` before a write)."""
        return None if self.empty() else self.gather_visible()[0]

    @keys.setter
    def keys(self, value: mx.array) -> None:
        self._assign("keys", value)

    @property
    def values(self) -> mx.array | None:
        """The retained values, ``(1, H, T, D)``, read from the blocks (``None`` before a write)."""
        return None if self.empty() else self.gather_visible()[1]

    @values.setter
    def values(self, value: mx.array) -> None:
        self._assign("values", value)

    def _assign(self, name: str, value: mx.array) -> None:
        """A model replacing the retained K or V (deepseek_v32's indexer zeroes its values)."""
        want = None if self.empty() else getattr(self, name).shape
        if not isinstance(value, mx.array) or value.shape != want:
            got = getattr(value, "shape", type(value).__name__)
            raise ValueError(
                f"a paged cache's {name} can only be replaced by an array of their shape {want}, "
                f"got {got}; the K/V lives in shared blocks."
            )
        self.pool.overwrite(self.table, self.layer, name, value)

    def to_quantized(self, group_size: int = 64, bits: int = 4) -> PagedKVCache:
        """Quantize this cache's pool behind a full-precision hot tail; return ``self``.

        What mlx-lm's ``kv_bits`` calls: the cache stays paged, and from its next
        write every sequence of the pool keeps its last ``hot_tokens`` (the
        pool's, or 256) tokens full precision, older full blocks ``bits``-bit.

        Raises:
            ValueError: for bits other than 4/8, a group size ``mx.quantize`` does
                not take or that does not divide the head dim, or a pool that
                already quantizes with other settings.
        """
        q = self.pool.quant
        if q is not None and (q.bits, q.group_size) == (bits, group_size):
            return self  # mlx-lm asks again after every step
        hot = q.hot_tokens if q is not None else 256
        quant = check_kv_quant(bits, group_size, hot)
        if self.window is not None:
            return self  # a window holds few tokens: it stays in full precision
        self.pool.enable_quant(quant)
        return self

    # ---- paged extras -----------------------------------------------------

    def stats(self) -> PagedCacheStats:
        """Block counts and bytes of the pool this layer lives in."""
        return self.pool.blocks.stats()

    def fetched(self, keys: mx.array, values: mx.array, mask: object) -> bool:
        """Whether attention got this layer's own K/V and mask, untouched by the model.

        Only then may a fused kernel read the blocks (either tier) instead.
        """
        own = self._fetched is not None and self._fetched.matches(keys, values)
        own = own and (mask is None or mask is self.table.mask)
        self._fetched = None
        return own

    def paged_view(self) -> PagedView:
        """This layer's blocks as a batch of one, for fused kernels."""
        return _paged_view(self.pool, self.table, self.layer, self.offset, self.window)

    def reads_in_place(self) -> bool:
        """Whether the last fetch returned views of the pool (``KVPool.run_view``)."""
        return self._in_place

    def deferred_read(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array] | None:
        """The K/V the last decode step stood in for, if these are its stand-ins."""
        if self._deferred is None or not self._deferred[0].matches(keys, values):
            return None
        return self.pool.gather(self.table, self.layer, *self._deferred[1:])

    def gather_visible(self) -> tuple[mx.array, mx.array]:
        """This layer's retained K/V as contiguous ``(1, H, T, D)`` arrays."""
        return self.pool.gather_visible(self.table, self.layer)


def read_start(offset: int, window: int | None, block_size: int) -> int:
    """First token a layer with ``window`` reads for queries from ``offset``: the start of
    the block holding the oldest key they see."""
    if window is None:
        return 0
    oldest = max(0, offset - window + 1)
    return oldest - oldest % block_size


def _one_token(pool: KVPool, keys: mx.array, values: mx.array) -> bool:
    """Whether ``append_view`` may take a write: one token of well-formed arrays (the
    general path checks anything else) not for a kernel (``_for_kernel``), and not the
    ``kernel`` path."""
    arrays = isinstance(keys, mx.array) and isinstance(values, mx.array)
    if not (arrays and keys.ndim == 4 and keys.shape[2] == 1 and attention_path() != "kernel"):
        return False
    return not _for_kernel(pool, keys.shape[3], values.shape[3])


def _for_kernel(pool: KVPool, dk: int, dv: int) -> bool:
    """Whether a one-token step should leave its read to a fused kernel rather than hand
    attention views of the pool that MLX's attention would copy (``views_read_in_place``)."""
    return pool.defer_reads and not (views_read_in_place(dk) and views_read_in_place(dv))


def _in_place_view(
    pool: KVPool, table: BlockTable, layer: int, n: int, start: int, end: int
) -> tuple[mx.array, mx.array] | None:
    """For a decode step or a prefill chunk over consecutive blocks, tokens ``[start, end)``
    as views of the pool, which attention reads in place like mlx-lm's dense cache; else
    ``None`` (path ``kernel``, cold blocks, blocks that do not lie in one stretch, or a
    decode step better left to a kernel, ``_for_kernel``)."""
    if attention_path() == "kernel" or pool.has_cold(table):
        return None
    if n == 1 and _for_kernel(pool, pool.keys[layer].shape[3], pool.values[layer].shape[3]):
        return None
    return pool.run_view(table, layer, start, end)


def _window_mask(
    n: int, offset: int, window: int, block_size: int, window_size: int | None, as_array: bool
) -> mx.array | str | None:
    """A sliding layer's mask for ``n`` queries from ``offset`` against the keys it reads
    (from the start of the block holding the oldest key they see)."""
    # A wider window sees no more: the layer holds no keys older than its own.
    seen = min(window_size or window, window)
    before = offset - read_start(offset, window, block_size)  # keys older than the queries
    if not as_array and before + n <= seen:
        return None if n == 1 else "causal"
    return create_causal_mask(n, before, window_size=seen)


def _paged_view(p: KVPool, t: BlockTable, layer: int, offset: int, window: int | None) -> PagedView:
    """One layer of one sequence as a ``PagedView`` of the pool (a kernel's input)."""
    block_tables, starts, lengths = _view_arrays(p, t, offset)
    cold = p.cold_arrays(layer) if p.has_cold(t) else None
    return PagedView(
        keys=p.keys[layer],
        values=p.values[layer],
        block_tables=block_tables,
        starts=starts,
        lengths=lengths,
        window=window,
        cold=None if cold is None else ColdView(*cold),
    )


def _view_arrays(pool: KVPool, table: BlockTable, offset: int) -> tuple[mx.array, ...]:
    """A one-sequence view's block table (padded, ``pad_tables``), start and length; the
    layers of a step share them."""
    return table.derived(
        "view",
        (table.version, offset),
        lambda: (
            pad_tables(pool.table_ids(table)[None]),
            mx.array([table.first * pool.block_size], dtype=mx.int32),
            mx.array([offset], dtype=mx.int32),
        ),
    )


def _stand_ins(table: BlockTable, shapes: tuple, dtype: mx.Dtype) -> tuple[mx.array, mx.array]:
    """Stand-ins of ``shapes`` for a deferred read, made once per step for the table's layers."""
    return table.derived("stand_ins", (*shapes, dtype), lambda: stand_ins(*shapes, dtype))


def _restore(state: tuple) -> tuple[KVPool, BlockTable, int | None]:
    """A private one-layer pool and table holding a saved layer's blocks, and its window."""
    keys, values, blocks, first, offset, window, block_size, dtype = state[:8]
    cold = state[8:14]
    quant = check_kv_quant(*(int(x) for x in state[14:17])) if cold else None
    pool = KVPool(1, int(block_size), None, None, quant)
    table = pool.new_table()
    table.first = int(first)
    table.lengths[0] = int(offset)
    ids = blocks.tolist() if blocks is not None and blocks.size else []
    hot = [b for b in ids if b != HOLE and not is_cold(b)]
    frozen = [b - COLD for b in ids if is_cold(b)]
    if keys is not None and (hot or frozen):
        new_hot = iter(pool.blocks.allocate(len(hot)))
        new_cold = iter(c + COLD for c in pool.blocks.cold.allocate(len(frozen)))
        table.blocks.extend(
            HOLE if b == HOLE else next(new_cold if is_cold(b) else new_hot) for b in ids
        )
        idx = mx.array(hot, dtype=mx.int32)
        pool.adopt_layer(0, keys[idx], values[idx], getattr(mx, dtype))
        if frozen:
            at = mx.array(frozen, dtype=mx.int32)
            pool.adopt_cold(0, tuple(x[at] for x in cold[:3]), tuple(x[at] for x in cold[3:]))
    return pool, table, None if window is None else int(window)


# load_prompt_cache looks cache classes up by name in mlx-lm's cache module.
mlx_cache.PagedKVCache = PagedKVCache
route_attention()
