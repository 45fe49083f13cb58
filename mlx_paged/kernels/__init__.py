"""Fused paged decode attention kernels and the MLX reference they are checked against.

``dispatch.DEVICE_KERNELS`` are registered in ``mlx_paged.attention.KERNELS``;
``reference_paged_decode`` is the spec (plain MLX ops, runs anywhere).
"""

from .dispatch import DEVICE_KERNELS, cuda_paged_decode, metal_paged_decode
from .reference import reference_paged_decode

__all__ = ["DEVICE_KERNELS", "cuda_paged_decode", "metal_paged_decode", "reference_paged_decode"]
