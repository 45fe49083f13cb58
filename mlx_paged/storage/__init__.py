"""K/V storage: the MLX arrays of the block pool, their writes, copies and reads."""

from .cold import STORERS, ColdLayout, ColdStore, TierPlan
from .kv_pool import KVPool, Reader
from .quant import KVQuant, check_kv_dtype, check_kv_quant
from .read import take_blocks, take_slots
from .states import StatePool, batch_bucket
from .transfer import copy_table

__all__ = [
    "STORERS",
    "ColdLayout",
    "ColdStore",
    "KVPool",
    "KVQuant",
    "Reader",
    "StatePool",
    "batch_bucket",
    "TierPlan",
    "check_kv_dtype",
    "check_kv_quant",
    "copy_table",
    "take_blocks",
    "take_slots",
]
