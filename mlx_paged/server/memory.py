"""The server's memory: its flags checked, MLX's buffer cache bounded, and what it gives
back at rest.

MLX keeps the buffers that arrays free, to hand them to later arrays of the same sizes.
Its limit is the device's memory by default, and a server's steps free buffers of ever
new sizes (batch sizes, prompt lengths, block-table widths), so under load that never
rests the cache only grows: a llama-1B's engine held 12 GB in it over eight waves of
requests whose arrays never passed 4.3 GB (BENCHMARKS.md, run 453). With the limit at
1 GB it stayed at 1 GB, and tokens/s did not differ beyond the host's spread.
``--mlx-cache-limit`` sets that limit; the engine thread also hands the whole cache back
at rest (``worker``).
"""

from __future__ import annotations

import argparse
import logging

import mlx.core as mx
import mlx.nn as nn

from ..cache.memory import (
    blocks_for_memory,
    blocks_in,
    cold_bytes_per_block,
    parse_memory,
    probe_footprint,
)
from ..engine import PagedEngine
from ..storage.quant import KVQuant

logger = logging.getLogger("mlx_paged.server")

#: Bytes ``--mlx-cache-limit auto`` lets MLX keep at least (run 453: a llama-1B lost no
#: speed at 1 GB).
AUTO_FLOOR = 1 << 30


def add_argument(p: argparse.ArgumentParser) -> None:
    """Add ``--cold-blocks``/``--cold-memory`` and ``--mlx-cache-limit`` to the server's
    command line."""
    g = p.add_mutually_exclusive_group()
    g.add_argument(
        "--cold-blocks",
        type=int,
        default=None,
        help="With --kv-bits: the quantized tier's capacity in blocks, allocated at its first "
        "block (default: it grows on demand).",
    )
    g.add_argument(
        "--cold-memory",
        default=None,
        help="With --kv-bits: the quantized tier's size, e.g. 2GB, as --cold-blocks.",
    )
    p.add_argument(
        "--mlx-cache-limit",
        default="auto",
        help="Most bytes of freed buffers MLX keeps for reuse while the server runs, e.g. "
        "2GB (mx.set_cache_limit). auto: the most the warm-up's steps held beyond their "
        "arrays, at least 1 GiB.",
    )


def check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Exit with a usage error for a memory flag that is not a positive size, or a
    ``--cold-blocks`` that is not a positive count of a cold tier."""
    for flag, value in (("--cold-blocks", args.cold_blocks), ("--cold-memory", args.cold_memory)):
        if value is not None and args.kv_bits is None:
            parser.error(f"{flag} needs --kv-bits (the tier it sizes).")
    if args.cold_blocks is not None and args.cold_blocks <= 0:
        parser.error(f"--cold-blocks must be a positive integer, got {args.cold_blocks}.")
    flags = {
        "--kv-memory": args.kv_memory,
        "--cold-memory": args.cold_memory,
        "--kv-disk-bytes": args.kv_disk_bytes,
        "--kv-disk-preload-bytes": args.kv_disk_preload_bytes,
        "--mlx-cache-limit": None if args.mlx_cache_limit == "auto" else args.mlx_cache_limit,
    }
    for flag, value in flags.items():
        try:
            if value is not None and parse_memory(value) <= 0:  # "0.1B"
                parser.error(f"{flag} must be more than 0 bytes, got {value}.")
        except ValueError as e:
            auto = " Or auto." if flag == "--mlx-cache-limit" else ""
            parser.error(f"{flag}: {e}{auto}")


def pool_sizes(
    args: argparse.Namespace, model: nn.Module, kv_dtype: mx.Dtype | None
) -> tuple[int | None, int | None]:
    """The engine's ``num_blocks`` and ``cold_blocks`` from the flags: counts as given, or
    the blocks ``--kv-memory`` and ``--cold-memory`` hold (``None``: grow on demand)."""
    num_blocks, cold_blocks = args.num_blocks, args.cold_blocks
    if args.kv_memory is not None:
        footprint = probe_footprint(model, args.block_size, kv_dtype)
        num_blocks = blocks_for_memory(parse_memory(args.kv_memory), footprint)
    if args.cold_memory is not None:
        quant = KVQuant(args.kv_bits, args.kv_group_size, args.hot_tokens)
        per_block = cold_bytes_per_block(model, args.block_size, kv_dtype, quant)
        if per_block == 0:
            raise ValueError(
                "this model has no full-attention layers, so nothing is quantized and "
                "--cold-memory does not apply; leave it out."
            )
        cold_blocks = blocks_in(parse_memory(args.cold_memory), per_block, "--cold-memory")
        logger.info("mlx_paged: the cold tier holds %d blocks of %d bytes", cold_blocks, per_block)
    return num_blocks, cold_blocks


def bound_cache(setting: str) -> int:
    """Set MLX's cache limit from ``--mlx-cache-limit`` and return it. ``auto`` takes the
    most MLX held beyond its live arrays since its peak was last reset (the loader resets
    it before the warm-up), or ``AUTO_FLOOR`` if that is less."""
    if setting == "auto":
        limit = max(AUTO_FLOOR, mx.get_peak_memory() - mx.get_active_memory())
    else:
        limit = parse_memory(setting)
    mx.set_cache_limit(limit)
    logger.info("mlx_paged: MLX keeps at most %.2f GB of freed buffers", limit / 1e9)
    return limit


def at_rest(engine: PagedEngine, cleared: bool) -> bool:
    """What the engine thread gives back with nothing to run: a disk preload's host memory
    whose hold has ended, and, unless ``cleared`` (done since the last step), MLX's cached
    buffers, so that a server at rest holds what it holds, not its peak. Returns True."""
    if engine.disk is not None and engine.disk.preloaded is not None:
        engine.disk.preloaded.release()
    if not cleared:
        mx.clear_cache()
    return True


def held() -> tuple[int, int]:
    """MLX's live and cached bytes in this process."""
    return mx.get_active_memory(), mx.get_cache_memory()
