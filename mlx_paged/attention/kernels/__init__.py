"""Fused paged kernels and the MLX reference they are checked against.

``dispatch.DEVICE_KERNELS`` (decode attention) are registered in
``mlx_paged.attention.KERNELS``, ``dispatch.DEVICE_PREFILL_KERNELS`` (batched
prefill attention, CUDA only) in ``mlx_paged.attention.PREFILL_KERNELS`` and
``dispatch.DEVICE_READERS`` (block reads for prefill) in
``mlx_paged.attention.READERS`` and ``dispatch.DEVICE_STORERS`` (a migration's
quantization, CUDA only) in ``mlx_paged.storage.STORERS``. ``reference_paged_decode`` and
``reference_paged_prefill`` are their specs (plain MLX ops, run anywhere).
"""

from .dispatch import (
    DEVICE_KERNELS,
    DEVICE_PREFILL_KERNELS,
    DEVICE_READERS,
    DEVICE_STORERS,
    cuda_block_read,
    cuda_cold_store,
    cuda_paged_decode,
    cuda_paged_prefill,
    metal_block_read,
    metal_paged_decode,
    prebuild_kernels,
)
from .plan import compiled_variants
from .reference import reference_paged_decode, reference_paged_prefill

__all__ = [
    "DEVICE_KERNELS",
    "DEVICE_PREFILL_KERNELS",
    "DEVICE_READERS",
    "DEVICE_STORERS",
    "compiled_variants",
    "cuda_block_read",
    "cuda_cold_store",
    "cuda_paged_decode",
    "cuda_paged_prefill",
    "metal_block_read",
    "metal_paged_decode",
    "prebuild_kernels",
    "reference_paged_decode",
    "reference_paged_prefill",
]
