"""mlx-lm's own ``batch_generate``: its dense caches against ``install_paged_cache``.

N prompts share a system prompt and differ in a short suffix; both cases run
mlx-lm's ``batch_generate`` unchanged (greedy), the paged one after
``install_paged_cache(model)``. mlx-lm's batching path has no prefix sharing,
so both compute every prompt in full: this measures what the paged batch
protocol costs or saves (padding, the merge copy, step-sized buffers), not
prefix reuse (``engine.py`` measures that). Prints one line per case: wall
time, generated tokens/s, mlx-lm's prompt and generation tokens/s, peak memory.

Usage:
    python benchmarks/batch_generate.py --dtype float16              # on a GPU
    python benchmarks/batch_generate.py --n 4 --system 64 --gen 8 --layers 2   # quick, CPU
"""

from __future__ import annotations

import argparse
import gc
import random
import time

import mlx.core as mx
from decode import llama_1b
from mlx_lm.generate import batch_generate

from mlx_paged import install_paged_cache, uninstall_paged_cache
from mlx_paged.attention import path_counts


class Tokenizer:
    """No EOS: every request generates exactly ``--gen`` tokens."""

    eos_token_ids: set[int] = set()

    def decode(self, tokens: list[int]) -> str:
        return ""


def run(
    model, prompts: list[list[int]], gen: int, step: int, prefill_batch: int
) -> tuple[dict, list[list[int]]]:
    gc.collect()
    mx.clear_cache()
    mx.reset_peak_memory()
    start = time.perf_counter()
    out = batch_generate(
        model,
        Tokenizer(),
        prompts,
        max_tokens=gen,
        return_token_ids=True,
        prefill_step_size=step,
        completion_batch_size=len(prompts),
        prefill_batch_size=prefill_batch,
    )
    wall = time.perf_counter() - start
    tokens = sum(len(t) for t in out.token_ids)
    stats = dict(
        wall_s=wall,
        tok_s=tokens / wall,
        prompt_tps=out.stats.prompt_tps,
        generation_tps=out.stats.generation_tps,
        peak_gb=mx.get_peak_memory() / 1e9,
    )
    return stats, out.token_ids


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--n", type=int, default=32)
    parser.add_argument("--system", type=int, default=2048)
    parser.add_argument("--unique", type=int, default=64)
    parser.add_argument("--gen", type=int, default=128)
    parser.add_argument("--prefill-step-size", type=int, default=512)
    parser.add_argument("--prefill-batch", type=int, default=8, help="prompts prefilled together")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument(
        "--cases",
        nargs="+",
        default=["dense", "paged", "paged-sized"],
        help="paged: the pool grows on demand; paged-sized: num_blocks fits the run exactly",
    )
    args = parser.parse_args()
    model = llama_1b(getattr(mx, args.dtype), args.layers)
    rng = random.Random(0)
    system = [rng.randrange(1000, 100000) for _ in range(args.system)]
    suffix = [[rng.randrange(1000, 100000) for _ in range(args.unique)] for _ in range(args.n)]
    prompts = [system + s for s in suffix]
    print(
        f"device={mx.default_device()} dtype={args.dtype} layers={args.layers} N={args.n} "
        f"prompt={args.system}+{args.unique} gen={args.gen} block_size={args.block_size}"
    )
    bs = args.block_size
    sized = args.n * -(-(args.system + args.unique + args.gen) // bs)  # blocks the run holds
    tokens = {}
    for case in args.cases:
        if case.startswith("paged"):
            blocks = sized if case == "paged-sized" else None
            install_paged_cache(model, block_size=bs, num_blocks=blocks)
        stats, tokens[case] = run(
            model, prompts, args.gen, args.prefill_step_size, args.prefill_batch
        )
        uninstall_paged_cache(model)
        print(
            f"{case:6s} wall {stats['wall_s']:7.2f} s  {stats['tok_s']:8.1f} tok/s  "
            f"prompt {stats['prompt_tps']:9.1f} tok/s  generation {stats['generation_tps']:8.1f} "
            f"tok/s  peak {stats['peak_gb']:6.2f} GB",
            flush=True,
        )
    for case in tokens:
        if case != "dense" and "dense" in tokens:
            same = sum(a == b for a, b in zip(tokens["dense"], tokens[case], strict=True))
            print(f"{case}: requests with the same tokens as dense: {same}/{args.n}")
    print(f"attention calls by path: {dict(path_counts)}")


if __name__ == "__main__":
    main()
