"""Memory sizes and accounting: bytes per block (either tier) and per dense token,
``--kv-memory`` parsing."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import CacheList

from ..storage.cold import ColdLayout
from ..storage.quant import KVQuant
from .layout import make_paged_cache

# mlx-lm's KVCache grows in steps of this many tokens: what a dense cache really holds.
DENSE_STEP = 256
_UNITS = {"": 1, "B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12}
_UNITS.update({"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40})


def parse_memory(text: str) -> int:
    """``"2GB"`` -> 2_000_000_000 bytes; also ``512MiB``, ``1.5 GB``, ``4096`` (bytes).

    Raises:
        ValueError: if ``text`` is not a positive size.
    """
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", text)
    unit = m.group(2).upper() if m else ""
    if m and unit and not unit.endswith("B"):
        unit += "B"  # "2G" means 2GB
    if not m or unit not in _UNITS or float(m.group(1)) <= 0:
        raise ValueError(
            f"{text!r} is not a memory size; write e.g. 2GB, 512MB or 1.5GiB "
            "(units: B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)."
        )
    return int(float(m.group(1)) * _UNITS[unit])


@dataclass(frozen=True)
class KVFootprint:
    """Bytes per block of the paged pools, and per token of a dense cache, for one model."""

    bytes_per_block: int
    dense_bytes_per_token: int
    block_size: int

    def dense_bytes(self, tokens: int) -> int:
        """What mlx-lm's KVCache allocates for ``tokens`` (it grows in 256-token steps)."""
        return -(-tokens // DENSE_STEP) * DENSE_STEP * self.dense_bytes_per_token


def paged_pools(caches: list[Any]) -> list[Any]:
    """The distinct ``KVPool``s behind a cache list (CacheList entries included)."""
    pools: dict[int, Any] = {}
    for c in caches:
        if isinstance(c, CacheList):
            for p in paged_pools(list(c.caches)):
                pools[id(p)] = p
        elif hasattr(c, "pool"):
            pools[id(c.pool)] = c.pool
    return list(pools.values())


def kv_footprint(pools: list[Any], block_size: int) -> KVFootprint:
    """Measure bytes per block and per dense token from pools that have seen a write."""
    per_block = dense = 0
    for pool in pools:
        per_block += pool.blocks.bytes_per_block
        for k, v, dtype in zip(pool.keys, pool.values, pool.input_dtypes, strict=True):
            if k is not None:
                size = (k.shape[2] * k.shape[3] + v.shape[2] * v.shape[3]) * dtype.size
                dense += size
    return KVFootprint(per_block, dense, block_size)


def probe_footprint(model: nn.Module, block_size: int, kv_dtype: mx.Dtype | None) -> KVFootprint:
    """Run one token through a throwaway paged cache to learn the model's K/V sizes."""
    caches = make_paged_cache(model, block_size=block_size, kv_dtype=kv_dtype)
    mx.eval(model(mx.array([[0]]), cache=caches))
    return kv_footprint(paged_pools(caches), block_size)


def cold_bytes_per_block(
    model: nn.Module, block_size: int, kv_dtype: mx.Dtype | None, quant: KVQuant
) -> int:
    """Bytes one quantized block takes over the layers that quantize (full attention): each
    layer's cold record (``ColdLayout``), for K/V stored in ``kv_dtype`` (else the model's).
    Runs one token through a throwaway paged cache to learn the layers' shapes."""
    caches = make_paged_cache(
        model,
        block_size=block_size,
        kv_dtype=kv_dtype,
        kv_bits=quant.bits,
        kv_group_size=quant.group_size,
        hot_tokens=quant.hot_tokens,
    )
    mx.eval(model(mx.array([[0]]), cache=caches))
    total = 0
    for pool in paged_pools(caches):
        for k, v in zip(pool.keys, pool.values, strict=True):
            if pool.quant is not None and k is not None:
                one = [quant.quantize(mx.zeros((1, *x.shape[1:]), dtype=x.dtype)) for x in (k, v)]
                total += ColdLayout.of(*one).words * 4
    return total


def blocks_for_memory(nbytes: int, footprint: KVFootprint) -> int:
    """How many blocks (per pool) fit in ``nbytes``; raises ValueError if not even one."""
    if footprint.bytes_per_block == 0:
        raise ValueError(
            "this model has no attention layers, so nothing is paged and --kv-memory does not "
            "apply; leave it out."
        )
    return blocks_in(nbytes, footprint.bytes_per_block, "--kv-memory")


def blocks_in(nbytes: int, per_block: int, flag: str) -> int:
    """How many blocks of ``per_block`` (> 0) bytes fit in ``nbytes``, the size ``flag``
    gave; raises ValueError if not even one."""
    n = nbytes // per_block
    if n < 1:
        raise ValueError(
            f"{flag} of {nbytes} bytes holds no block; one block takes {per_block} bytes. "
            "Give more memory or a smaller --block-size."
        )
    return n


def cache_summary(caches: list[Any], block_size: int, kv_bits: int | None) -> str:
    """One line on what a single sequence's paged ``caches`` hold, against mlx-lm's dense
    cache for the same tokens (``mlx_paged.generate`` prints it)."""
    paged = [x for c in caches for x in getattr(c, "caches", [c]) if hasattr(x, "pool")]
    if not paged:
        return "KV cache: none paged (the model has recurrent layers only)"
    pools = paged_pools(caches)
    tiers = [p.tier_stats() for p in pools]
    held = sum(t.hot_blocks for t in tiers)
    nbytes = sum(t.hot_bytes + t.cold_bytes for t in tiers)
    tokens = max(c.offset for c in paged)
    cold = f" + {sum(t.cold_blocks for t in tiers)} {kv_bits}-bit" if kv_bits else ""
    dense = kv_footprint(pools, block_size).dense_bytes(tokens)
    return (
        f"KV cache: paged, {held}{cold} blocks of {block_size} for {tokens} tokens "
        f"({fmt_bytes(nbytes)}); a dense mlx-lm cache would hold {fmt_bytes(dense)}; "
        "prefix hits: 0 tokens (one request)"
    )


def fmt_bytes(n: float) -> str:
    """``1234567`` -> ``"1.23 MB"``."""
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return f"{n:.2f} GB"
