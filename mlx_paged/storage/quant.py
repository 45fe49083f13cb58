"""The quantized cold tier's settings, and its per-block storage in MLX's affine format."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

#: Bits ``kv_bits`` may take.
KV_BITS = (4, 8)
#: Group sizes ``mx.quantize`` supports.
GROUP_SIZES = (32, 64, 128)
#: Blocks move to the cold tier once this many of a sequence's tokens are due, whole
#: blocks at a time (at least one block); the due blocks of every other sequence move
#: with them.
MIGRATE_TOKENS = 64


@dataclass(frozen=True)
class KVQuant:
    """How a pool quantizes blocks that fall behind the hot tail.

    ``bits`` and ``group_size`` as mlx-lm's ``QuantizedKVCache`` (affine,
    ``mx.quantize``); the last ``hot_tokens`` tokens of every sequence stay in
    full precision.
    """

    bits: int
    group_size: int = 64
    hot_tokens: int = 256

    def migrate_blocks(self, block_size: int) -> int:
        """Blocks a sequence waits to have due before they move together."""
        return max(1, MIGRATE_TOKENS // block_size)

    def quantize(self, x: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        """``(..., D)`` to packed values, scales and biases (``mx.quantize``)."""
        return mx.quantize(x, group_size=self.group_size, bits=self.bits)

    def dequantize(self, parts: tuple[mx.array, mx.array, mx.array]) -> mx.array:
        """Packed values, scales and biases back to ``(..., D)`` in the scales' dtype."""
        return mx.dequantize(*parts, group_size=self.group_size, bits=self.bits)

    def check_head_dims(self, *dims: int) -> None:
        """Raise ValueError unless ``group_size`` divides every head dim."""
        for d in dims:
            if d % self.group_size:
                raise ValueError(
                    f"kv_group_size {self.group_size} does not divide the head dim {d}; "
                    f"pick one of {GROUP_SIZES} that does."
                )


def check_kv_quant(
    kv_bits: object, kv_group_size: object = 64, hot_tokens: object = 256
) -> KVQuant | None:
    """The ``KVQuant`` these options ask for (``None`` when ``kv_bits`` is ``None``).

    Raises:
        ValueError: ``kv_bits`` not 4 or 8, a group size ``mx.quantize`` does not
            take, or a negative ``hot_tokens``.
    """
    if kv_bits is None:
        return None
    if kv_bits not in KV_BITS or isinstance(kv_bits, bool):
        raise ValueError(f"kv_bits must be one of {KV_BITS} or None, got {kv_bits!r}.")
    if kv_group_size not in GROUP_SIZES or isinstance(kv_group_size, bool):
        raise ValueError(f"kv_group_size must be one of {GROUP_SIZES}, got {kv_group_size!r}.")
    if isinstance(hot_tokens, bool) or not isinstance(hot_tokens, int) or hot_tokens < 0:
        raise ValueError(f"hot_tokens must be an int >= 0, got {hot_tokens!r}.")
    return KVQuant(int(kv_bits), int(kv_group_size), hot_tokens)


def check_kv_dtype(kv_dtype: object) -> None:
    """Raise ValueError unless ``kv_dtype`` is ``None`` or a floating ``mx.Dtype``."""
    if kv_dtype is None:
        return
    if not isinstance(kv_dtype, mx.Dtype) or not mx.issubdtype(kv_dtype, mx.floating):
        raise ValueError(
            f"kv_dtype must be a floating mx.Dtype such as mx.float16, got {kv_dtype!r}; "
            "for quantized K/V pass kv_bits=8 or 4."
        )
