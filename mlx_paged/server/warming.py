"""The server's warm-up on its command line: whether it runs, and how wide a context it
prepares decode steps for (``engine/warmup.py``)."""

from __future__ import annotations

import argparse

from ..engine.warmup import WARM_CONTEXT


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Add ``--warm-up`` and ``--warm-up-context`` to the server's command line."""
    p.add_argument(
        "--warm-up",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="Before /health reports ready, decode a made-up burst once at every batch size "
        "up to --max-batch-size, so the first requests find kernels built and checked. "
        "Default: on a GPU; off on the CPU, which builds no kernels per batch size.",
    )
    p.add_argument(
        "--warm-up-context",
        type=int,
        default=WARM_CONTEXT,
        help="With the warm-up: trace the compiled decode step at every batch size for the "
        "block-table widths of contexts up to this many tokens (0: none beyond the burst's).",
    )


def check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Exit with a usage error for a negative ``--warm-up-context``."""
    if args.warm_up_context < 0:
        parser.error(f"--warm-up-context must be 0 or more, got {args.warm_up_context}.")


def warms_up(args: argparse.Namespace) -> bool:
    """``--warm-up``, or where neither flag is given, whether MLX runs on a GPU (Metal or
    CUDA): there the first use of each batch size builds kernels, on the CPU it does not."""
    import mlx.core as mx

    return args.warm_up if args.warm_up is not None else mx.default_device() == mx.gpu
