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
    Fetched,
    PagedLayerCache,
    PagedView,
    attention_path,
    fused_read,
    kernels_ready,
    one_token_read,
    route_attention,
)
from ..blocks import BlockTable, PagedCacheStats
from ..storage import KVPool, check_kv_quant
from .batch_cache import PagedBatchKVCache
from .reads import paged_view, read_start, table_stand_ins, window_mask
from .saved import LayerBuffers, restore_layer


class PagedKVCache(LayerBuffers, PagedLayerCache, KVCache):
    """One layer's KV cache for one sequence, stored in a shared ``KVPool``.

    Use ``make_paged_cache(model)`` to build a model's caches. ``update_and_fetch``
    returns the layer's K/V gathered lazily from the blocks, or views of them (a decode
    step whose attention a fused kernel will serve returns stand-ins, see
    ``PagedLayerCache.deferred_read``, and may leave the token's write to the kernel,
    ``routing.one_token_read``); ``copy.deepcopy`` forks by reference (copy-on-write),
    it never copies the pool. A subclass of mlx-lm's ``KVCache`` for code that checks
    the type; it overrides every member.

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
        # A decode step's K/V left to the kernel to store (``PagedView.new_keys``), its slot.
        self._new: tuple[mx.array, mx.array, int, int] | None = None
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
        self._fetched = self._deferred = self._new = None
        route = _one_token_route(self.pool, keys, values)
        if route == "views" and self.window is None:
            view = self.pool.append_view(self.table, self.layer, keys, values)
            if view is not None:  # written, and read in place: no other check needed
                self._in_place = True
                return view
        elif route == "store" and self._as_is(keys, values):
            return self._leave_to_kernel(keys, values)
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
            keys, values = table_stand_ins(self.table, shapes, dtype)
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
        self.table.mask = window_mask(
            N, self.offset, self.window, self.pool.block_size, window_size, return_array
        )
        return self.table.mask

    @LayerBuffers.state.setter
    def state(self, v: tuple) -> None:
        self.pool, self.table, self.window = restore_layer(v)
        self.layer, self._fetched, self._deferred, self._in_place = 0, None, None, False
        self._new = None

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

    def _as_is(self, keys: mx.array, values: mx.array) -> bool:
        """Whether a kernel may store this token's K/V itself: rows of the shapes the
        layer's last one-token write passed with, in the dtype the pool stores, no cold tier."""
        p = self.pool
        stored = p.kv_dtype is None or p.kv_dtype == keys.dtype
        return stored and p.quant is None and p.passed_check(self.layer, keys, values)

    def _leave_to_kernel(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """A decode step whose token the fused kernel stores as it reads the blocks
        (``PagedView.new_keys``): claim the slot, return stand-ins for the read."""
        p, t, layer = self.pool, self.table, self.layer
        block, slot = p.claim_slot(t, layer)
        end = t.lengths[layer]
        lo = read_start(end - 1, self.window, p.block_size)
        shapes = (
            (1, keys.shape[1], end - lo, keys.shape[3]),
            (1, keys.shape[1], end - lo, values.shape[3]),
        )
        stand_k, stand_v = table_stand_ins(t, shapes, keys.dtype)
        self._new = (keys, values, block, slot)
        self._deferred = (Fetched(stand_k, stand_v), lo, end)
        self._fetched, self._in_place = Fetched(stand_k, stand_v), False
        if self.window is not None:
            p.drop_before(t, lo)
        return stand_k, stand_v

    def kernel_stored(self, out: mx.array) -> None:
        """A kernel took the step and stored its token in the pool arrays: later reads of
        them wait for ``out`` (the kernel's output)."""
        if self._new is not None:
            p, layer = self.pool, self.layer
            p.keys[layer], p.values[layer] = mx.depends([p.keys[layer], p.values[layer]], [out])
            self._new = None

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
        new = (None, None) if self._new is None else self._new[:2]
        return paged_view(self.pool, self.table, self.layer, self.offset, self.window, new)

    def reads_in_place(self) -> bool:
        """Whether the last fetch returned views of the pool (``KVPool.run_view``)."""
        return self._in_place

    def deferred_read(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array] | None:
        """The K/V the last decode step stood in for, if these are its stand-ins."""
        if self._new is not None:  # no kernel stored the token
            self.pool.put(self.layer, *self._new[2:], *self._new[:2])
            self._new = None
        if self._deferred is None or not self._deferred[0].matches(keys, values):
            return None
        return self.pool.gather(self.table, self.layer, *self._deferred[1:])

    def gather_visible(self) -> tuple[mx.array, mx.array]:
        """This layer's retained K/V as contiguous ``(1, H, T, D)`` arrays."""
        return self.pool.gather_visible(self.table, self.layer)


def _one_token_route(pool: KVPool, keys: mx.array, values: mx.array) -> str | None:
    """How a one-token step of well-formed arrays reads (``one_token_read``), or ``None``
    for the general path, which checks and routes anything else."""
    arrays = isinstance(keys, mx.array) and isinstance(values, mx.array)
    if not (arrays and keys.ndim == 4 and keys.shape[2] == 1):
        return None
    if pool.defer_reads:
        return one_token_read(keys.shape[3], values.shape[3])
    return None if attention_path() == "kernel" else "views"


def _in_place_view(
    pool: KVPool, table: BlockTable, layer: int, n: int, start: int, end: int
) -> tuple[mx.array, mx.array] | None:
    """For a decode step or a prefill chunk over consecutive blocks, tokens ``[start, end)``
    as views of the pool, which attention reads in place like mlx-lm's dense cache; else
    ``None`` (path ``kernel``, cold blocks, blocks that do not lie in one stretch, or a
    decode step better left to a kernel, ``one_token_read``)."""
    if attention_path() == "kernel" or pool.has_cold(table):
        return None
    if n == 1 and pool.defer_reads:  # a decode step: views unless it is better left to a kernel
        if one_token_read(pool.keys[layer].shape[3], pool.values[layer].shape[3]) != "views":
            return None
    return pool.run_view(table, layer, start, end)


# load_prompt_cache looks cache classes up by name in mlx-lm's cache module.
mlx_cache.PagedKVCache = PagedKVCache
route_attention()
