"""A layer group's arrays: full-precision K/V per layer, the cold tier, their checks and sizes.

``LayerArrays`` is the part of ``KVPool`` that owns arrays rather than moving
tokens: it creates a layer's arrays at its first write (checking every write's
shape and dtype), grows them with the pool, quantizes blocks into the cold tier
(``ColdStore``), reads whole blocks of either tier, and makes the queued
copy-on-write copies before anything reads or writes the arrays.
"""

from __future__ import annotations

import mlx.core as mx

from ..blocks import COLD, BlockTable, BlockTables, TieredBlockPool, TierStats, is_cold
from .cold import ColdLayout, ColdStore, Quantized, grow_rows
from .quant import KVQuant


class LayerArrays(BlockTables):
    """Per-layer K/V arrays of a layer group (layout A), and its cold tier.

    Args:
        num_layers: Layers in this group.
        block_size: Token slots per block.
        num_blocks: Fixed capacity (of full-precision blocks), or ``None`` to grow on demand.
        kv_dtype: Storage dtype; ``None`` stores the model's K/V dtype.
        quant: Quantize blocks behind each sequence's hot tail (see ``enable_quant``).
        cold_blocks: Capacity of the cold tier, or ``None`` to grow it on demand.
    """

    def __init__(
        self,
        num_layers: int,
        block_size: int,
        num_blocks: int | None = None,
        kv_dtype: mx.Dtype | None = None,
        quant: KVQuant | None = None,
        cold_blocks: int | None = None,
    ):
        pool = TieredBlockPool(num_blocks, block_size, cold_blocks)
        super().__init__(num_layers, block_size, num_blocks, pool)
        self.kv_dtype = kv_dtype
        self.cold: ColdStore | None = None
        if quant is not None:
            self._set_quant(quant)
        self._keys: list[mx.array | None] = [None] * num_layers
        self._values: list[mx.array | None] = [None] * num_layers
        # Copy-on-write copies queued since the arrays were last used: destination -> source.
        self._copies: dict[int, int] = {}
        self.input_dtypes: list[mx.Dtype | None] = [None] * num_layers
        #: Whether decode steps may return stand-ins for the K/V a fused kernel reads
        #: itself (set by ``make_pools`` for models that hand K/V straight to attention).
        self.defer_reads = False
        # Per layer, the (K shape, V shape, K dtype, V dtype) of a one-token write that passed.
        self._decode_ok: dict[int, tuple] = {}

    @property
    def keys(self) -> list[mx.array | None]:
        """Per layer, the K array (``None`` before the layer's first write), every queued
        copy made first."""
        if self._copies:
            self.flush_copies()
        return self._keys

    @property
    def values(self) -> list[mx.array | None]:
        """Per layer, the V array, as ``keys``."""
        if self._copies:
            self.flush_copies()
        return self._values

    def flush_copies(self) -> None:
        """Make the queued copy-on-write copies: per array, one read of every source block,
        evaluated, then one write. A write whose value still reads the array it writes keeps
        the array's buffer in use, and MLX then copies the whole array instead of updating it
        in place; one evaluation per copy waited for the device once per copy (BENCHMARKS.md,
        runs 284-286 and 291)."""
        copies, self._copies = self._copies, {}
        layers = [layer for layer in range(self.num_layers) if self._keys[layer] is not None]
        if not copies or not layers:
            return
        rows = [self.block_rows(layer, list(copies.values())) for layer in layers]
        mx.eval(rows)
        dst = mx.array(list(copies), dtype=mx.int32)
        for layer, (k, v) in zip(layers, rows, strict=True):
            self._keys[layer][dst] = k
            self._values[layer][dst] = v

    def grown(self) -> None:
        """Grow every layer's arrays to the pool's new capacity (zero-filled)."""
        for layer in range(self.num_layers):
            for arrays in (self.keys, self.values):
                arrays[layer] = grow_rows(arrays[layer], self.blocks.capacity)

    @property
    def quant(self) -> KVQuant | None:
        """The cold tier's settings, or ``None`` without one."""
        return None if self.cold is None else self.cold.quant

    def enable_quant(self, quant: KVQuant) -> None:
        """Quantize blocks behind each sequence's hot tail from the next write on.

        Raises:
            ValueError: if the pool already quantizes with other settings, or the
                group size does not divide a layer's head dims.
        """
        if self.quant is not None and (self.quant.bits, self.quant.group_size) != (
            quant.bits,
            quant.group_size,
        ):
            raise ValueError(
                f"this pool already quantizes to {self.quant.bits} bits in groups of "
                f"{self.quant.group_size}; cannot switch to {quant.bits}/{quant.group_size}."
            )
        for k, v in zip(self.keys, self.values, strict=True):
            if k is not None:
                quant.check_head_dims(k.shape[-1], v.shape[-1])
        if self.quant is None:
            self._set_quant(quant)

    def tier_stats(self) -> TierStats:
        """The cold tier's block counts and migrations."""
        return self.blocks.tier_stats()

    def has_cold(self, table: BlockTable) -> bool:
        """Whether ``table`` holds any cold block (memoized per table version)."""
        if self.quant is None and self.blocks.migrations == 0:
            return False
        return table.derived("has_cold", (table.version,), lambda: any(map(is_cold, table.blocks)))

    def cold_arrays(self, layer: int) -> tuple[mx.array, ColdLayout, int, int, int] | None:
        """A layer's cold tier for kernels that read it directly: the records of the
        layer's stack (``ColdStore``) and their layout, the bits, the group size and the
        layer's index in the stack; ``None`` before its first cold block."""
        if self.cold is None or self.cold.where[layer] is None:
            return None
        blob, layout, index = self.cold.stack(layer)
        return blob, layout, self.cold.quant.bits, self.cold.quant.group_size, index

    def block_rows(self, layer: int, ids: list[int]) -> tuple[mx.array, mx.array]:
        """Blocks ``ids`` (either tier) of one layer as ``(n, block_size, H, D)`` K and V.

        Cold blocks come back dequantized, in the storage dtype.
        """
        hot = mx.array([b if not is_cold(b) else 0 for b in ids], dtype=mx.int32)
        k, v = self.keys[layer][hot], self.values[layer][hot]
        cold = [i for i, b in enumerate(ids) if is_cold(b)]
        if not cold:
            return k, v
        at = mx.array([ids[i] - COLD for i in cold], dtype=mx.int32)
        rows = mx.array(cold, dtype=mx.int32)
        ck, cv = self.cold.read(layer, at)
        k[rows], v[rows] = ck.astype(k.dtype), cv.astype(v.dtype)
        return k, v

    def held_bytes(self, layer: int, ids: list[int]) -> int:
        """Bytes blocks ``ids`` (either tier, holes skipped) take in one layer."""
        k, v = self.keys[layer], self.values[layer]
        if k is None:
            return 0
        cold = sum(map(is_cold, ids))
        hot = sum(b >= 0 for b in ids) - cold
        total = hot * (k.nbytes + v.nbytes) // max(k.shape[0], 1)
        if cold:
            total += cold * self.cold.layer_bytes_per_block(layer)
        return total

    def to_storage(self, x: mx.array) -> mx.array:
        """``x`` in the storage dtype."""
        return (
            x.astype(self.kv_dtype) if self.kv_dtype is not None and x.dtype != self.kv_dtype else x
        )

    def check_write(self, layer: int, keys: mx.array, values: mx.array) -> None:
        """Raise ValueError unless ``(1, H, n, D)`` K/V fit the layer; create it on first use."""
        arrays = isinstance(keys, mx.array) and isinstance(values, mx.array)
        if arrays and self.passed_check(layer, keys, values):
            return  # the shapes of the layer's previous one-token write: checked then
        check_one_sequence(keys, values)
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

    def passed_check(self, layer: int, keys: mx.array, values: mx.array) -> bool:
        """Whether one token's K/V have the shapes and dtypes of the layer's last one-token
        write that passed ``check_write`` (which then has nothing to check)."""
        return self._decode_ok.get(layer) == (keys.shape, values.shape, keys.dtype, values.dtype)

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

    def adopt_cold(self, layer: int, keys: Quantized, values: Quantized) -> None:
        """Install existing cold arrays for a layer (every cold slot), e.g. from a saved cache."""
        if keys[0].shape[0] != self.blocks.cold.capacity:
            raise ValueError(
                f"expected {self.blocks.cold.capacity} cold blocks, got {keys[0].shape[0]}."
            )
        self.cold.adopt(layer, keys, values)
        self._update_bytes_per_block()

    def _create_layer(self, layer: int, keys: mx.array, values: mx.array) -> None:
        if self.quant is not None:
            self.quant.check_head_dims(keys.shape[3], values.shape[3])
        dtype = self.kv_dtype or keys.dtype
        shape = (self.blocks.capacity, self.block_size)
        self.keys[layer] = mx.zeros((*shape, keys.shape[1], keys.shape[3]), dtype=dtype)
        self.values[layer] = mx.zeros((*shape, values.shape[1], values.shape[3]), dtype=dtype)
        self.input_dtypes[layer] = keys.dtype
        self._update_bytes_per_block()

    def _set_quant(self, quant: KVQuant) -> None:
        self.cold = ColdStore(self.num_layers, quant)
        self.hot_tokens = quant.hot_tokens
        self.migrate_blocks = quant.migrate_blocks(self.block_size)

    def _quantize(self, src: list[int], dst: list[int]) -> None:
        """Quantize hot blocks ``src`` into cold slots ``dst``, every layer, dispatched at once:
        ``src`` goes back to the pool, where a decode kernel may store K/V into it in place
        (``PagedView.new_keys``, past MLX's copy-on-write) only after this read."""
        at, to = mx.array(src, dtype=mx.int32), mx.array(dst, dtype=mx.int32)
        mx.async_eval(
            self.cold.store_blocks(self.keys, self.values, at, to, self.blocks.cold.capacity)
        )
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
        if self.cold is not None:
            self.blocks.cold.bytes_per_block = self.cold.bytes_per_block()


def check_one_sequence(keys: object, values: object) -> None:
    """Raise ValueError unless ``keys`` and ``values`` are ``(1, H, n, D)`` arrays of one
    sequence that agree on heads, tokens and dtype."""
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
