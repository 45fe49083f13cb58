"""Attention over paged K/V: routing of mlx-lm's attention, the path choice and the kernels.

``routing`` sends layers with a paged cache to ``paged_attention`` (fused
kernels where one runs, else MLX's SDPA on gathered K/V); ``kernels`` holds the
CUDA and Metal kernels and their MLX reference; ``records`` the shared records.
"""

from .convolution import DepthwiseConv1d, conv_counts, route_convolutions
from .records import (
    ColdView,
    Fetched,
    PagedLayerCache,
    PagedView,
    PrefillView,
    Rope,
    stand_ins,
    table_width,
)
from .routing import (
    ATTENTION_PATHS,
    KERNELS,
    PREFILL_KERNELS,
    READERS,
    attention_path,
    fused_read,
    kernels_ready,
    kernels_write,
    one_token_read,
    paged_attention,
    path_counts,
    prefill_kernels_ready,
    read_counts,
    route_attention,
    route_model,
    scaled_dot_product_attention,
    set_attention_path,
    views_read_in_place,
)

__all__ = [
    "ATTENTION_PATHS",
    "KERNELS",
    "PREFILL_KERNELS",
    "READERS",
    "ColdView",
    "DepthwiseConv1d",
    "Fetched",
    "PagedLayerCache",
    "PagedView",
    "PrefillView",
    "Rope",
    "attention_path",
    "conv_counts",
    "fused_read",
    "kernels_ready",
    "kernels_write",
    "one_token_read",
    "paged_attention",
    "path_counts",
    "prefill_kernels_ready",
    "read_counts",
    "route_attention",
    "route_convolutions",
    "route_model",
    "scaled_dot_product_attention",
    "set_attention_path",
    "stand_ins",
    "table_width",
    "views_read_in_place",
]
