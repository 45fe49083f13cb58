"""Fused paged kernels and the MLX reference they are checked against.

``dispatch.DEVICE_KERNELS`` (decode attention) are registered in
``mlx_paged.attention.KERNELS`` and ``dispatch.DEVICE_READERS`` (block reads for
prefill) in ``mlx_paged.attention.READERS``; ``reference_paged_decode`` is the
spec (plain MLX ops, runs anywhere).
"""

from .dispatch import (
    DEVICE_KERNELS,
    DEVICE_READERS,
    cuda_block_read,
    cuda_paged_decode,
    metal_block_read,
    metal_paged_decode,
)
from .plan import compiled_variants
from .reference import reference_paged_decode

__all__ = [
    "DEVICE_KERNELS",
    "DEVICE_READERS",
    "compiled_variants",
    "cuda_block_read",
    "cuda_paged_decode",
    "metal_block_read",
    "metal_paged_decode",
    "reference_paged_decode",
]
