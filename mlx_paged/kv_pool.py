"""Per-layer K/V storage in blocks, and the reads and writes on a block table.

A ``KVPool`` serves a group of layers that share block ids (all full-attention
layers of a model, or all sliding-window layers with one window). Each layer
has its own K and V arrays in layout A, ``[num_blocks, block_size, n_kv_heads,
head_dim]``, created at the layer's first write; K and V head dims may differ.

Each pool array has exactly one reference, held here, and every write replaces
it, so MLX can donate the buffer and update it in place instead of copying the
whole pool.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import mlx.core as mx

from .attention import fused_read
from .block_pool import BlockPool, PoolExhaustedError
from .kernels.read import take_blocks


@dataclass
class BlockTable:
    """One sequence's blocks in one pool, plus how far each layer has written.

    ``blocks[i]`` holds tokens ``[(first + i) * block_size, (first + i + 1) *
    block_size)``; ``first`` is the number of leading blocks already given back
    (sliding-window layers drop blocks that fell out of the window).
    """

    blocks: list[int] = field(default_factory=list)
    first: int = 0
    lengths: list[int] = field(default_factory=list)
    version: int = 0  # bumped whenever ``blocks`` or ``first`` changes
    ids: mx.array | None = field(default=None, repr=False)  # device copy of a span of blocks
    ids_key: tuple | None = field(default=None, repr=False)
    # Pool slots (block * block_size + offset) of the span ``gather`` last read: the
    # layers of a step share them.
    slots: mx.array | None = field(default=None, repr=False)
    slots_key: tuple | None = field(default=None, repr=False)
    # (version, start, end, pool shares) of the span ``reserve`` last made private: the
    # later layers of a prefill step skip the check while nothing changed.
    reserved_key: tuple | None = field(default=None, repr=False)
    # (block ids, offsets) of the chunk ``write_prefill`` last wrote, for the same reason.
    write_index: tuple | None = field(default=None, repr=False)
    write_key: tuple | None = field(default=None, repr=False)
    # The mask make_mask last returned for this sequence's layers, so attention
    # can tell it from a mask the model made itself.
    mask: object = field(default=None, repr=False)
    # Kernel-view arrays (block ids, start, length) for the current step.
    view_arrays: tuple | None = field(default=None, repr=False)
    view_key: tuple | None = field(default=None, repr=False)

    @property
    def end(self) -> int:
        """Tokens written by the furthest layer."""
        return max(self.lengths, default=0)


class KVPool:
    """K/V arrays for a group of layers plus the ``BlockPool`` that owns their ids.

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
        self.blocks = BlockPool(num_blocks, block_size)
        self.block_size = block_size
        self.kv_dtype = kv_dtype
        self.num_layers = num_layers
        self.keys: list[mx.array | None] = [None] * num_layers
        self.values: list[mx.array | None] = [None] * num_layers
        self.input_dtypes: list[mx.Dtype | None] = [None] * num_layers
        # Per layer, the (K shape, V shape, K dtype, V dtype) of a one-token write that passed.
        self._decode_ok: dict[int, tuple] = {}

    # ---- block tables -----------------------------------------------------

    def new_table(self) -> BlockTable:
        """An empty table whose blocks are released when it is garbage collected."""
        table = BlockTable(lengths=[0] * self.num_layers)
        weakref.finalize(table, _release_quietly, self.blocks, table.blocks)
        return table

    def fork(self, table: BlockTable) -> BlockTable:
        """A new table holding references to the same blocks (no K/V is copied)."""
        for b in table.blocks:
            self.blocks.retain(b)
        forked = self.new_table()
        forked.blocks.extend(table.blocks)
        forked.first = table.first
        forked.lengths[:] = table.lengths
        return forked

    def release(self, table: BlockTable) -> None:
        """Give back every block of a table and empty it."""
        self.blocks.release_all(table.blocks)
        table.blocks.clear()
        table.first = 0
        table.lengths[:] = [0] * self.num_layers
        table.version += 1

    def truncate(self, table: BlockTable, layer: int, length: int) -> None:
        """Set a layer's length to ``length`` and give back blocks no layer reaches."""
        table.lengths[layer] = length
        keep = -(-table.end // self.block_size) - table.first
        if keep < len(table.blocks):
            self.blocks.release_all(table.blocks[keep:])
            del table.blocks[keep:]
            table.version += 1

    def drop_before(self, table: BlockTable, position: int) -> None:
        """Give back the blocks that hold only tokens before ``position``."""
        n = position // self.block_size - table.first
        if n > 0:
            self.blocks.release_all(table.blocks[:n])
            del table.blocks[:n]
            table.first += n
            table.version += 1

    # ---- writes -----------------------------------------------------------

    def write_prefill(
        self, table: BlockTable, layer: int, keys: mx.array, values: mx.array
    ) -> None:
        """Write a chunk of K/V at the layer's tail.

        Args:
            keys: ``(1, n_kv_heads, n_new, k_head_dim)``.
            values: ``(1, n_kv_heads, n_new, v_head_dim)``.
        """
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

    def copy_on_write_block(self, table: BlockTable, index: int) -> int:
        """Give ``table.blocks[index]`` a private copy in every layer; return its id."""
        old = table.blocks[index]
        (new,) = self._allocate(1)
        for layer in range(self.num_layers):
            if self.keys[layer] is not None:
                self.keys[layer][new] = self.keys[layer][old]
                self.values[layer][new] = self.values[layer][old]
        table.blocks[index] = new
        table.version += 1
        self.blocks.release(old)
        return new

    # ---- reads ------------------------------------------------------------

    def gather(
        self, table: BlockTable, layer: int, start: int, end: int, fused: bool = False
    ) -> tuple[mx.array, mx.array]:
        """Tokens ``[start, end)`` of one layer as ``(1, H, end - start, D)`` K and V.

        ``start`` must not precede the table's first retained block. ``fused`` lets a
        device kernel do the read (``attention.fused_read``): worth it for a prefill
        chunk, whose attention reads these arrays, but not for a decode step, whose
        fused attention kernel never evaluates them while the kernel call would
        still cost host time.
        """
        slots = self._token_slots(table, start, end)  # (1, T)
        keys, values = self.keys[layer], self.values[layer]
        read = fused_read(keys, values, slots) if fused else None
        k, v = read or take_blocks(keys, values, slots)
        dtype = self.input_dtypes[layer]
        return (k, v) if k.dtype == dtype else (k.astype(dtype), v.astype(dtype))

    def table_ids(self, table: BlockTable) -> mx.array:
        """The retained block ids of a table as an int32 array (cached until it changes)."""
        return self._block_ids(table, table.first, table.first + len(table.blocks))

    def gather_visible(self, table: BlockTable, layer: int) -> tuple[mx.array, mx.array]:
        """Every retained token of one layer: the bytes the dense cache would hold."""
        return self.gather(table, layer, table.first * self.block_size, table.lengths[layer])

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block takes across all layers of this pool."""
        return self.blocks.bytes_per_block

    # ---- internals --------------------------------------------------------

    def _write_index(self, table: BlockTable, start: int, n: int) -> tuple[mx.array, mx.array]:
        """(block id, offset) of tokens ``[start, start + n)``, shared by a step's layers."""
        key = (table.version, start, n)
        if table.write_key != key:
            bs = self.block_size
            lo, hi = start // bs, -(-(start + n) // bs)
            pos = mx.arange(start, start + n, dtype=mx.int32)
            ids = self._block_ids(table, lo, hi)[pos // bs - lo]
            table.write_index, table.write_key = (ids, pos % bs), key
        return table.write_index

    def _token_slots(self, table: BlockTable, start: int, end: int) -> mx.array:
        """``(1, T)`` pool slots of tokens ``[start, end)``, reused while table and span hold."""
        bs = self.block_size
        lo, hi = start // bs, -(-end // bs)
        assert lo >= table.first, f"tokens from {start} were already given back"
        key = (table.version, start, end)
        if table.slots_key != key:
            ids = self._block_ids(table, lo, hi)
            slots = (ids[:, None] * bs + mx.arange(bs, dtype=mx.int32)).reshape(-1)
            off = start - lo * bs
            table.slots, table.slots_key = slots[None, off : off + end - start], key
        return table.slots

    def _block_ids(self, table: BlockTable, lo: int, hi: int) -> mx.array:
        """Block ids for logical blocks ``[lo, hi)``, reused while the table is unchanged."""
        key = (table.version, lo, hi)
        if table.ids_key != key:
            table.ids = mx.array(table.blocks[lo - table.first : hi - table.first], dtype=mx.int32)
            table.ids_key = key
        return table.ids

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

    def _create_layer(self, layer: int, keys: mx.array, values: mx.array) -> None:
        dtype = self.kv_dtype or keys.dtype
        shape = (self.blocks.capacity, self.block_size)
        self.keys[layer] = mx.zeros((*shape, keys.shape[1], keys.shape[3]), dtype=dtype)
        self.values[layer] = mx.zeros((*shape, values.shape[1], values.shape[3]), dtype=dtype)
        self.input_dtypes[layer] = keys.dtype
        self._update_bytes_per_block()

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

    def _update_bytes_per_block(self) -> None:
        total = 0
        for k, v in zip(self.keys, self.values, strict=True):
            if k is not None:
                per_token = (
                    k.shape[2] * k.shape[3] * k.itemsize + v.shape[2] * v.shape[3] * v.itemsize
                )
                total += self.block_size * per_token
        self.blocks.bytes_per_block = total

    def to_storage(self, x: mx.array) -> mx.array:
        """``x`` in the storage dtype."""
        return (
            x.astype(self.kv_dtype) if self.kv_dtype is not None and x.dtype != self.kv_dtype else x
        )

    def _allocate(self, n: int) -> list[int]:
        capacity = self.blocks.capacity
        ids = self.blocks.allocate(n)
        if ids is None:
            raise PoolExhaustedError(
                f"the pool needs {n} more blocks but only {self.blocks.num_available} of "
                f"{capacity} can be freed; release sequences or build a larger pool."
            )
        if self.blocks.capacity != capacity:
            self._grow_arrays()
        return ids

    def _grow_arrays(self) -> None:
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

    def blocks_needed(self, table: BlockTable, start: int, end: int) -> int:
        """Blocks ``reserve(table, start, end)`` would take: new ones plus copies of shared ones."""
        return len(self._shared_in(table, start, end)) + self._missing(table, end)

    def reserve(self, table: BlockTable, start: int, end: int) -> None:
        """Give tokens ``[start, end)`` private blocks in ``table``, copying shared ones.

        Raises:
            ValueError: if the table would need more blocks than the pool has.
            PoolExhaustedError: if the blocks cannot be freed now; nothing changes.
        """
        bs = self.block_size
        span = -(-end // bs) - table.first
        if not self.blocks.growable and span > self.blocks.capacity:
            raise ValueError(
                f"{end} tokens need {span} blocks of {bs}, but the pool holds only "
                f"{self.blocks.capacity}; pass a larger num_blocks (or None to grow)."
            )
        shared = self._shared_in(table, start, end)
        missing = self._missing(table, end)
        if not self.blocks.can_allocate(len(shared) + missing):
            raise PoolExhaustedError(
                f"the pool needs {len(shared) + missing} more blocks but only "
                f"{self.blocks.num_available} of {self.blocks.capacity} can be freed; "
                "release sequences or build a larger pool."
            )
        for i in shared:
            self.copy_on_write_block(table, i)
        if missing:
            table.blocks.extend(self._allocate(missing))
            table.version += 1
        table.reserved_key = (table.version, start, end, self.blocks.shares)

    def _shared_in(self, table: BlockTable, start: int, end: int) -> list[int]:
        """Indices into ``table.blocks`` of shared blocks that tokens ``[start, end)`` touch."""
        bs = self.block_size
        lo, hi = start // bs - table.first, min(len(table.blocks), -(-end // bs) - table.first)
        return [i for i in range(lo, hi) if self.blocks.is_shared(table.blocks[i])]

    def _missing(self, table: BlockTable, end: int) -> int:
        """Blocks to append so that ``table`` reaches token ``end``."""
        return max(0, -(-end // self.block_size) - table.first - len(table.blocks))


def _release_quietly(pool: BlockPool, blocks: list[int]) -> None:
    """Finalizer: a table dropped without ``release`` gives its blocks back."""
    pool.release_all(blocks)
    blocks.clear()
