"""``PagedSinkKVCache``: a window that keeps the sequence's first tokens.

mlx-lm's answer to ``max_kv_size`` is ``RotatingKVCache(max_size, keep=4)``:
the first ``keep`` tokens (attention sinks) stay, and the rest is a window.
This layer reproduces what that cache hands attention, in the same order.

With ``P`` tokens already seen, mlx-lm's cache holds ``H = min(P, max_size -
1)`` of them: the first ``keep`` and the last ``H - keep`` (all ``P`` while
``P < max_size``). A step of ``N`` new tokens attends to those ``H`` and the new
ones under a causal mask with offset ``H`` and window ``max_size``. A decode
step therefore sees the sinks and the last ``max_size - keep`` tokens; a
longer chunk's later queries lose sinks and old tokens to the window, exactly
as in mlx-lm. Blocks in between that no later step can read go back to the
pool, leaving holes in the table, so a sequence holds at most about
``max_size`` tokens plus one chunk.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models import cache as mlx_cache
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import BatchRotatingKVCache, RotatingKVCache

from ..blocks import BlockTable
from ..storage import KVPool
from .paged import PagedKVCache


class PagedSinkKVCache(PagedKVCache):
    """One layer of one sequence keeping its first ``keep`` tokens and a ``window``.

    The paged counterpart of ``RotatingKVCache(max_size=window, keep=keep)``;
    ``make_paged_cache(model, max_kv_size=...)`` builds it. Attention takes the
    portable gather path (the fused kernels read one contiguous window), and
    ``merge`` batches copies in mlx-lm's own ``BatchRotatingKVCache``.

    Args:
        pool, table, layer: as ``PagedKVCache``.
        window: ``max_size``: tokens a decode step attends to, sinks included.
        keep: Leading tokens kept for good, ``0 < keep < window``.
    """

    def __init__(self, pool: KVPool, table: BlockTable, layer: int, window: int, keep: int):
        if not 0 < keep < window:
            raise ValueError(f"keep must be in (0, window={window}), got {keep}.")
        super().__init__(pool, table, layer, window)
        self.keep = keep

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Write ``(1, H, n, D)`` K/V at the tail; return the sinks, the window and the new K/V."""
        self._fetched = None
        seen = self.offset
        self.pool.write_prefill(self.table, self.layer, keys, values)
        start = self._recent_start(seen)
        sinks = self.keep if start else 0
        keys, values = self.pool.gather(self.table, self.layer, start, self.offset, None, sinks)
        # What this step does not read, no later step reads either.
        self.pool.drop_range(self.table, self.keep, start)
        return keys, values

    def make_mask(
        self, N: int, return_array: bool = False, window_size: int | None = None
    ) -> mx.array | str | None:
        """The mask mlx-lm's ``RotatingKVCache`` gives ``N`` new queries, in the same key order."""
        held = min(self.window - 1, self.offset)
        if N > 1:
            window = window_size or self.window
            if return_array or held + N > window:
                return create_causal_mask(N, held, window_size=window)
            return "causal"
        if window_size is None or self.offset < window_size:
            return None
        size = min(self.offset + 1, self.window)
        return mx.arange(size) >= size - window_size

    def fetched(self, keys: mx.array, values: mx.array, mask: object) -> bool:
        """Never: the fused kernels read one contiguous window, not sinks and a window."""
        return False

    def size(self) -> int:
        """Tokens a decode step attends to: all of them, at most ``window``."""
        return min(self.offset, self.window)

    def is_trimmable(self) -> bool:
        """Until the window first fills, as mlx-lm's rotating cache."""
        return self.offset < self.window

    def gather_visible(self) -> tuple[mx.array, mx.array]:
        """The sinks and the last ``window - keep`` tokens, ``(1, H, size(), D)``."""
        end = self.offset
        start = end - (self.window - self.keep) if end > self.window else 0
        sinks = self.keep if start else 0
        return self.pool.gather(self.table, self.layer, start, end, None, sinks)

    def _assign(self, name: str, value: mx.array) -> None:
        raise ValueError(
            f"a paged cache built with max_kv_size cannot have its {name} replaced; "
            "build the cache without max_kv_size for this model."
        )

    @property
    def state(self) -> tuple:
        """``PagedKVCache``'s state with ``keep`` last."""
        return (*super().state, self.keep)

    @state.setter
    def state(self, v: tuple) -> None:
        PagedKVCache.state.fset(self, v[:-1])
        self.keep = int(v[-1])

    def __deepcopy__(self, memo: dict) -> PagedSinkKVCache:
        key = id(self.table)
        if key not in memo:
            memo[key] = self.pool.fork(self.table)
        return PagedSinkKVCache(self.pool, memo[key], self.layer, self.window, self.keep)

    @classmethod
    def merge(cls, caches: list) -> BatchRotatingKVCache:
        """mlx-lm's ``BatchRotatingKVCache`` over copies of these caches' retained K/V.

        A paged batch reads one contiguous window per sequence, so batching
        leaves the pool: the K/V are copied once, and the batch keeps a plain
        window of ``window`` tokens, as mlx-lm's batch cache does with ``keep``.

        Raises:
            ValueError: for an empty list or caches of another type.
        """
        if not caches or not all(isinstance(c, cls) for c in caches):
            raise ValueError(f"merge needs one or more {cls.__name__}s, got {caches!r}.")
        return BatchRotatingKVCache.merge([c.to_rotating() for c in caches])

    def to_rotating(self) -> RotatingKVCache:
        """A dense mlx-lm ``RotatingKVCache`` holding a copy of what this layer retains."""
        dense = RotatingKVCache(max_size=self.window, keep=self.keep)
        if not self.empty():
            dense.keys, dense.values = self.gather_visible()
            dense.offset = self.offset
            dense._idx = dense.keys.shape[2]
        return dense

    @property
    def nbytes(self) -> int:
        """Bytes of the blocks this layer's table holds (holes excluded)."""
        return self.pool.held_bytes(self.layer, self.table.blocks)

    def _recent_start(self, seen: int) -> int:
        """First token after the sinks that a step starting at ``seen`` reads (0: all of them).

        mlx-lm keeps ``window - 1`` old tokens once it has seen that many: the
        sinks and the last ``window - 1 - keep``.
        """
        return seen - (self.window - 1 - self.keep) if seen >= self.window else 0


# load_prompt_cache looks cache classes up by name in mlx-lm's cache module.
mlx_cache.PagedSinkKVCache = PagedSinkKVCache
