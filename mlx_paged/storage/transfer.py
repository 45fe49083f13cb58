"""Copying a sequence's blocks from one pool into another (``merge`` of separate caches)."""

from __future__ import annotations

import mlx.core as mx

from ..blocks import BlockTable
from .kv_pool import KVPool


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
    for layer in range(dst.num_layers):
        k, v = src.keys[layer], src.values[layer]
        if k is None:
            continue
        rows = src.block_rows(layer, table.blocks)  # cold blocks come back dequantized
        if dst.keys[layer] is None:
            n = dst.blocks.capacity
            empty = [mx.zeros((n, *x.shape[1:]), dtype=x.dtype) for x in (k, v)]
            dst.adopt_layer(layer, *empty, src.input_dtypes[layer])
        elif dst.keys[layer].shape[1:] != k.shape[1:] or dst.keys[layer].dtype != k.dtype:
            raise ValueError(
                f"layer {layer}: blocks {k.shape[1:]} {k.dtype} do not fit the pool's "
                f"{dst.keys[layer].shape[1:]} {dst.keys[layer].dtype}."
            )
        dst.keys[layer][to], dst.values[layer][to] = rows
    return copy
