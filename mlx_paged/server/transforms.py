"""The server's model: loaded, then fused, sharded or routed as its flags say."""

from __future__ import annotations

import argparse
import logging
import time


def add_transform_flags(p: argparse.ArgumentParser) -> None:
    """The flags of ``load_transformed``'s transforms."""
    p.add_argument(
        "--fuse-projections",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Run each layer's q/k/v and gate/up projections as one matmul each (the same "
        "values, fewer primitives a step: mlx_paged.fuse_projections). Default: on, except "
        "for a model sharded under mlx.launch.",
    )
    p.add_argument(
        "--few-row-matmuls",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="On a CUDA GPU, multiply 2 to 48 rows by a float16 or bfloat16 linear layer's "
        "weight in a kernel of our own instead of cuBLAS, which costs a decode step more "
        "host time (mlx_paged.few_row_matmuls). Default: on, except for a sharded model.",
    )
    p.add_argument(
        "--matmul-row-buckets",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="On a CUDA GPU, pad a prompt's rows (over 64) to one of four counts an octave in "
        "each linear layer, so that cuBLAS plans few row counts (mlx_paged.bucket_matmul_rows). "
        "Default: off (it shortens the warm-up; first tokens measured no faster).",
    )
    p.add_argument(
        "--rope-in-kernel",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="On a CUDA GPU, let the decode kernel apply llama, qwen and gemma 3 layers' RoPE: "
        "two launches a layer fewer a decode step (mlx_paged.rope_in_kernel). "
        "Default: on, except for a sharded model.",
    )


def load_transformed(args: argparse.Namespace, group=None, warm: bool = False):
    """``(model, tokenizer)`` of ``args.model``: this rank's shard of it with a ``group`` of
    several ranks, else with its projections fused; then evaluated, and its layers routed
    to the few-row kernel, row buckets and the decode kernel's RoPE as the flags say (not
    a sharded model's). With ``warm``, row buckets are planned up to a prompt's largest
    forward (``--prefill-step-size`` rows)."""
    import mlx.core as mx

    from ..embedded import load_model
    from ..engine import bucket_matmul_rows, few_row_matmuls, fuse_projections, rope_in_kernel
    from ..engine.distributed import shard_model
    from ..engine.row_buckets import warm_row_buckets

    log = logging.getLogger("mlx_paged.server")
    sharded = group is not None and group.size() > 1
    # Lazy where the weights change first: each rank reads only its share, and fused
    # layers are read straight into their fused arrays (never both copies at once).
    lazy = sharded or args.fuse_projections
    model, tokenizer = load_model(args.model, dtype=args.model_dtype, lazy=lazy)
    if sharded:
        shard_model(model, group, pipeline=args.pipeline)
    elif args.fuse_projections:
        log.info("mlx_paged: fused %d projection groups", fuse_projections(model))
    mx.eval(model.parameters())
    if args.few_row_matmuls and not sharded:
        log.info("mlx_paged: %d layers take few rows in a kernel", few_row_matmuls(model))
    if args.matmul_row_buckets and not sharded:
        log.info("mlx_paged: %d layers pad a prompt's rows", bucket_matmul_rows(model))
        if warm:  # every bucket up to a prompt's largest forward, planned now
            tic = time.perf_counter()
            runs = warm_row_buckets(model, args.prefill_step_size)
            log.info("mlx_paged: %d row-bucket matmuls in %.2f s", runs, time.perf_counter() - tic)
    if args.rope_in_kernel and not sharded:
        log.info("mlx_paged: %d layers leave RoPE to the kernel", rope_in_kernel(model))
    return model, tokenizer
