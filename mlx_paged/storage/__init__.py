"""K/V storage: the MLX arrays of the block pool, their writes, copies and reads."""

from .kv_pool import KVPool, Reader, copy_table
from .read import take_blocks, take_slots

__all__ = ["KVPool", "Reader", "copy_table", "take_blocks", "take_slots"]
