"""Per-layer K/V storage in blocks: the writes, the copy-on-write copy and the reads.

A ``KVPool`` serves one layer group (see ``mlx_paged.blocks.BlockTables``, whose
bookkeeping it inherits). Each layer has its own K and V arrays in layout A,
``[num_blocks, block_size, n_kv_heads, head_dim]``, created at the layer's
first write; K and V head dims may differ.

Each pool array has exactly one reference, held here, and every write replaces
it, so MLX can donate the buffer and update it in place instead of copying the
whole pool.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx

from ..blocks import BlockTable, BlockTables
from .read import take_blocks

#: A device read of pool slots: ``read(keys, values, slots)`` returns ``(B, H, T, D)``
#: K and V in the pool's dtype, or ``None`` to leave the read to ``take_blocks``.
Reader = Callable[[mx.array, mx.array, mx.array], "tuple[mx.array, mx.array] | None"]


class KVPool(BlockTables):
    """K/V arrays for a layer group, on top of the group's block-table bookkeeping.

    Args:
        num_layers: Layers in this group.
        block_size: Token slots per block.
        num_blocks: Fixed capacity, or ``None`` to grow on demand.
        kv_dtype: Storage dtype; ``None`` stores the model's K/V dtype.
    """

    def __init__(
        self,
        num_layers: int,
        block_size: int,
        num_blocks: int | None = None,
        kv_dtype: mx.Dtype | None = None,
    ):
        super().__init__(num_layers, block_size, num_blocks)
        self.kv_dtype = kv_dtype
        self.keys: list[mx.array | None] = [None] * num_layers
        self.values: list[mx.array | None] = [None] * num_layers
        self.input_dtypes: list[mx.Dtype | None] = [None] * num_layers
        # Per layer, the (K shape, V shape, K dtype, V dtype) of a one-token write that passed.
        self._decode_ok: dict[int, tuple] = {}

    # ---- writes -----------------------------------------------------------

    def write_prefill(
        self, table: BlockTable, layer: int, keys: mx.array, values: mx.array
    ) -> None:
        """Write a chunk of K/V, ``(1, n_kv_heads, n_new, head_dim)``, at the layer's tail."""
        self.check_write(layer, keys, values)
        start = table.lengths[layer]
        n = keys.shape[2]
        if n == 0:
            return
        bs = self.block_size
        if n == 1:  # decode: usually the tail block is already ours
            i = start // bs - table.first
            if i >= len(table.blocks) or self.blocks.is_shared(table.blocks[i]):
                self.reserve(table, start, start + 1)
            b, s = table.blocks[start // bs - table.first], start % bs
            h = keys.shape[1]
            # Integer indices make a static slice update, which MLX does in place; an
            # index array (mx.slice_update) made a dynamic one that copied the pool.
            self.keys[layer][b, s] = self.to_storage(keys.reshape(h, -1))  # (H, Dk)
            self.values[layer][b, s] = self.to_storage(values.reshape(h, -1))  # (H, Dv)
        else:
            if table.reserved_key != (table.version, start, start + n, self.blocks.shares):
                self.reserve(table, start, start + n)
            k = self.to_storage(keys[0].swapaxes(0, 1))  # (n, H, Dk)
            v = self.to_storage(values[0].swapaxes(0, 1))  # (n, H, Dv)
            ids, slots = self._write_index(table, start, n)
            self.keys[layer][ids, slots] = k
            self.values[layer][ids, slots] = v
        table.lengths[layer] = start + n

    def append(self, table: BlockTable, layer: int, keys: mx.array, values: mx.array) -> None:
        """Decode-step write of one token: ``(1, n_kv_heads, 1, head_dim)``."""
        if keys.ndim != 4 or keys.shape[2] != 1:
            raise ValueError(f"append writes one token, shape (1, H, 1, D); got {keys.shape}.")
        self.write_prefill(table, layer, keys, values)

    def copy_block(self, src: int, dst: int) -> None:
        """Copy block ``src`` into block ``dst`` in every layer (copy-on-write)."""
        for layer in range(self.num_layers):
            if self.keys[layer] is not None:
                self.keys[layer][dst] = self.keys[layer][src]
                self.values[layer][dst] = self.values[layer][src]

    def grown(self) -> None:
        """Grow every layer's arrays to the pool's new capacity (zero-filled)."""
        extra = self.blocks.capacity - next(
            (k.shape[0] for k in self.keys if k is not None), self.blocks.capacity
        )
        if extra <= 0:
            return
        for layer in range(self.num_layers):
            for arrays in (self.keys, self.values):
                x = arrays[layer]
                if x is not None:
                    pad = mx.zeros((extra, *x.shape[1:]), dtype=x.dtype)
                    arrays[layer] = mx.concatenate([x, pad])

    def overwrite(self, table: BlockTable, layer: int, name: str, x: mx.array) -> None:
        """Replace a layer's retained ``"keys"`` or ``"values"`` with ``(1, H, T, D)`` ``x``.

        What a model assigning ``cache.keys`` means; shared blocks are copied first.
        """
        start, end = table.first * self.block_size, table.lengths[layer]
        self.reserve(table, start, end)
        ids, slots = self._write_index(table, start, end - start)
        getattr(self, name)[layer][ids, slots] = self.to_storage(x[0].swapaxes(0, 1))

    # ---- reads ------------------------------------------------------------

    def gather(
        self,
        table: BlockTable,
        layer: int,
        start: int,
        end: int,
        read: Reader | None = None,
        sinks: int = 0,
    ) -> tuple[mx.array, mx.array]:
        """Tokens ``[0, sinks)`` then ``[start, end)`` of one layer as ``(1, H, T, D)`` K and V.

        ``start`` must not precede the table's first retained block. ``read`` lets a
        device kernel copy (``fused_read``): worth it for a prefill chunk, whose
        attention reads these arrays, not for a decode step, whose fused kernel
        never evaluates them.
        """
        slots = self._token_slots(table, start, end, sinks)  # (1, T)
        keys, values = self.keys[layer], self.values[layer]
        fetched = read(keys, values, slots) if read is not None else None
        k, v = fetched or take_blocks(keys, values, slots)
        dtype = self.input_dtypes[layer]
        return (k, v) if k.dtype == dtype else (k.astype(dtype), v.astype(dtype))

    def table_ids(self, table: BlockTable) -> mx.array:
        """The retained block ids of a table as an int32 array (cached until it changes)."""
        return self._block_ids(table, table.first, table.first + len(table.blocks))

    def gather_visible(self, table: BlockTable, layer: int) -> tuple[mx.array, mx.array]:
        """Every retained token of one layer: the bytes the dense cache would hold."""
        return self.gather(table, layer, table.first * self.block_size, table.lengths[layer])

    def held_bytes(self, layer: int, blocks: int) -> int:
        """Bytes ``blocks`` blocks take in one layer (0 before the layer's first write)."""
        k, v = self.keys[layer], self.values[layer]
        return 0 if k is None else blocks * (k.nbytes + v.nbytes) // max(k.shape[0], 1)

    def to_storage(self, x: mx.array) -> mx.array:
        """``x`` in the storage dtype."""
        return (
            x.astype(self.kv_dtype) if self.kv_dtype is not None and x.dtype != self.kv_dtype else x
        )

    # ---- layers -----------------------------------------------------------

    def check_write(self, layer: int, keys: mx.array, values: mx.array) -> None:
        """Raise ValueError unless ``(1, H, n, D)`` K/V fit the layer; create it on first use."""
        ok = self._decode_ok.get(layer)
        if ok is not None and isinstance(keys, mx.array) and isinstance(values, mx.array):
            if ok == (keys.shape, values.shape, keys.dtype, values.dtype):
                return  # the shapes of the layer's previous one-token write: checked then
        for name, x in (("keys", keys), ("values", values)):
            if not isinstance(x, mx.array) or x.ndim != 4 or x.shape[0] != 1:
                shape = getattr(x, "shape", type(x).__name__)
                raise ValueError(
                    f"{name} must be an mx.array shaped (1, n_kv_heads, n_new, head_dim) "
                    f"for one sequence; got {shape}."
                )
        if keys.shape[:3] != values.shape[:3]:
            raise ValueError(
                f"keys {keys.shape} and values {values.shape} must agree on batch, heads, tokens."
            )
        if keys.dtype != values.dtype:
            raise ValueError(f"keys ({keys.dtype}) and values ({values.dtype}) must share a dtype.")
        if self.keys[layer] is None:
            self._create_layer(layer, keys, values)
            return
        want = (*self.keys[layer].shape[2:], *self.values[layer].shape[2:])
        got = (keys.shape[1], keys.shape[3], values.shape[1], values.shape[3])
        if got != want:
            raise ValueError(
                f"layer {layer} stores (K heads, K dim, V heads, V dim) = {want}; "
                f"got keys {keys.shape} and values {values.shape}."
            )
        if keys.dtype != self.input_dtypes[layer]:
            raise ValueError(
                f"layer {layer} holds {self.input_dtypes[layer]} K/V; got {keys.dtype}. "
                "Cast the model or start a new cache."
            )
        if keys.shape[2] == 1:
            self._decode_ok[layer] = (keys.shape, values.shape, keys.dtype, values.dtype)

    def adopt_layer(
        self, layer: int, keys: mx.array, values: mx.array, input_dtype: mx.Dtype
    ) -> None:
        """Install existing block arrays (layout A) for a layer, e.g. from a saved cache."""
        if keys.shape[0] != self.blocks.capacity:
            raise ValueError(f"expected {self.blocks.capacity} blocks, got {keys.shape[0]}.")
        self.keys[layer], self.values[layer] = keys, values
        self.input_dtypes[layer] = input_dtype
        self._decode_ok.pop(layer, None)
        if keys.dtype != input_dtype:
            self.kv_dtype = keys.dtype
        self._update_bytes_per_block()

    # ---- internals --------------------------------------------------------

    def _create_layer(self, layer: int, keys: mx.array, values: mx.array) -> None:
        dtype = self.kv_dtype or keys.dtype
        shape = (self.blocks.capacity, self.block_size)
        self.keys[layer] = mx.zeros((*shape, keys.shape[1], keys.shape[3]), dtype=dtype)
        self.values[layer] = mx.zeros((*shape, values.shape[1], values.shape[3]), dtype=dtype)
        self.input_dtypes[layer] = keys.dtype
        self._update_bytes_per_block()

    def _update_bytes_per_block(self) -> None:
        total = 0
        for k, v in zip(self.keys, self.values, strict=True):
            if k is not None:
                per_token = (
                    k.shape[2] * k.shape[3] * k.itemsize + v.shape[2] * v.shape[3] * v.itemsize
                )
                total += self.block_size * per_token
        self.blocks.bytes_per_block = total

    def _write_index(self, table: BlockTable, start: int, n: int) -> tuple[mx.array, mx.array]:
        """(block id, offset) of tokens ``[start, start + n)``, shared by a step's layers."""

        def make() -> tuple[mx.array, mx.array]:
            bs = self.block_size
            lo, hi = start // bs, -(-(start + n) // bs)
            pos = mx.arange(start, start + n, dtype=mx.int32)
            return self._block_ids(table, lo, hi)[pos // bs - lo], pos % bs

        return table.derived("write_index", (table.version, start, n), make)

    def _token_slots(self, table: BlockTable, start: int, end: int, sinks: int = 0) -> mx.array:
        """``(1, T)`` pool slots of tokens ``[0, sinks)`` then ``[start, end)`` (memoized)."""
        bs = self.block_size
        assert start // bs >= table.first, f"tokens from {start} were already given back"

        def span(a: int, b: int) -> mx.array:
            lo, hi = a // bs, -(-b // bs)
            ids = self._block_ids(table, lo, hi)
            slots = (ids[:, None] * bs + mx.arange(bs, dtype=mx.int32)).reshape(-1)
            return slots[a - lo * bs : b - lo * bs]

        def make() -> mx.array:
            if not sinks:
                return span(start, end)[None]
            return mx.concatenate([span(0, sinks), span(start, end)])[None]

        return table.derived("slots", (table.version, start, end, sinks), make)

    def _block_ids(self, table: BlockTable, lo: int, hi: int) -> mx.array:
        """Block ids for logical blocks ``[lo, hi)``, reused while the table is unchanged."""
        return table.derived(
            "ids",
            (table.version, lo, hi),
            lambda: mx.array(table.blocks[lo - table.first : hi - table.first], dtype=mx.int32),
        )


def copy_table(src: KVPool, dst: KVPool, table: BlockTable) -> BlockTable:
    """A new table in ``dst`` holding copies of ``table``'s blocks from ``src``, every layer.

    Raises:
        ValueError: if the pools differ in block size, layer count or layer shapes.
    """
    if (src.block_size, src.num_layers) != (dst.block_size, dst.num_layers):
        raise ValueError(
            f"cannot copy blocks from a pool of {src.num_layers} layers x block_size "
            f"{src.block_size} into one of {dst.num_layers} x {dst.block_size}; "
            "the caches come from different models or settings."
        )
    copy = dst.new_table()
    copy.first, copy.lengths[:] = table.first, table.lengths
    if not table.blocks:
        return copy
    start = table.first * dst.block_size
    dst.reserve(copy, start, start + len(table.blocks) * dst.block_size)
    to = mx.array(copy.blocks, dtype=mx.int32)
    ids = mx.array(table.blocks, dtype=mx.int32)
    for layer in range(dst.num_layers):
        k, v = src.keys[layer], src.values[layer]
        if k is None:
            continue
        if dst.keys[layer] is None:
            n = dst.blocks.capacity
            empty = [mx.zeros((n, *x.shape[1:]), dtype=x.dtype) for x in (k, v)]
            dst.adopt_layer(layer, *empty, src.input_dtypes[layer])
        elif dst.keys[layer].shape[1:] != k.shape[1:] or dst.keys[layer].dtype != k.dtype:
            raise ValueError(
                f"layer {layer}: blocks {k.shape[1:]} {k.dtype} do not fit the pool's "
                f"{dst.keys[layer].shape[1:]} {dst.keys[layer].dtype}."
            )
        dst.keys[layer][to] = k[ids]
        dst.values[layer][to] = v[ids]
    return copy
