"""A batched prefill's attention alone: the fused paged kernel against the paths it replaces.

Each case lays ``B`` sequences of ``--prefix`` cached tokens plus ``L`` new ones in a
shuffled pool (float16, ``--heads`` query heads over ``--kv-heads``, head dim
``--head-dim``) and times ``--layers`` attention calls evaluated together, as one
forward's layers would be: each layer reads a copy of the K/V of its own, and its queries
are the last layer's output. Without that chain the GPU runs the layers' calls side by side,
and a call of few thread blocks looks many times faster than it is in a forward.

- ``kernel``: ``paged_prefill_cuda`` reading the blocks in place, its keys in the
  planned number of splits (``S=auto``) or in each of ``--splits``, a block's rows over
  every head of a KV head (``PG=on``) or over one (``--pack-heads off``);
- ``ops``: the K/V gathered from the blocks, then ``attention_by_ops`` with the
  engine's boolean mask (the CUDA path before the kernel);
- ``sdpa``: MLX's fused attention on contiguous K/V with ``"causal"`` (cuDNN on CUDA, a
  graph built per new shape, paid outside the clock here): the dense cache's path.

One line per case: median milliseconds over ``--iters`` runs of each.

Usage:
    python benchmarks/prefill_attention.py --batch 8 32 --new 64 --prefix 2048
    python benchmarks/prefill_attention.py --batch 1 --new 2048 --prefix 0 8192 30720
    python benchmarks/prefill_attention.py --batch 1 4 --new 16 --prefix 32768 --splits auto 1 8
    python benchmarks/prefill_attention.py --batch 4 --new 16 --prefix 32768 --pack-heads on off
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time

import mlx.core as mx

from mlx_paged.attention.kernels import cuda_prefill
from mlx_paged.attention.kernels.cuda_prefill import paged_prefill_cuda
from mlx_paged.attention.kernels.synthetic import random_prefill_batch
from mlx_paged.attention.prefill import attention_by_ops
from mlx_paged.storage import take_blocks


def timed(fn, iters: int) -> float:
    """Median milliseconds of ``fn()`` evaluated, after two runs outside the clock."""
    for _ in range(2):
        mx.eval(fn())
    times = []
    for _ in range(iters):
        mx.synchronize()
        start = time.perf_counter()
        mx.eval(fn())
        mx.synchronize()
        times.append(1e3 * (time.perf_counter() - start))
    return statistics.median(times)


def case(args, b: int, n: int, prefix: int) -> str:
    """One line: the three paths' median milliseconds for one batch shape."""
    d, bs, layers = args.head_dim, args.block_size, range(args.layers)
    scale = d**-0.5
    q, view = random_prefill_batch(
        [prefix] * b, [n] * b, n, args.heads, args.kv_heads, d, bs, mx.float16
    )
    t = view.block_tables.shape[1] * bs
    slots = (view.block_tables[:, :, None] * bs + mx.arange(bs)).reshape(b, -1)
    pos = mx.arange(t)[None, None]
    query = view.offsets[:, None, None] + mx.arange(n)[None, :, None]
    mask = ((pos <= query) & (pos < view.lengths[:, None, None]))[:, None]
    keys, values = take_blocks(view.keys, view.values, slots)
    dense_k, dense_v = keys[:, :, : prefix + n], values[:, :, : prefix + n]
    views = [view._replace(keys=view.keys + 0, values=view.values + 0) for _ in layers]
    dense = [(dense_k + 0, dense_v + 0) for _ in layers]
    mx.eval(mask, views, dense)

    splits = None

    def kernel():
        outs = [q]
        for v in views:
            outs.append(paged_prefill_cuda(outs[-1], v, scale, num_splits=splits))
        return outs[1:]

    def ops():
        outs = [q]
        for each in views:
            k, v = take_blocks(each.keys, each.values, slots)
            outs.append(attention_by_ops(outs[-1], k, v, scale, mask))
        return outs[1:]

    def sdpa():
        outs = [q]
        for k, v in dense:
            attend = mx.fast.scaled_dot_product_attention
            outs.append(attend(outs[-1], k, v, scale=scale, mask="causal"))
        return outs[1:]

    line = f"B={b} new={n} prefix={prefix}:"
    for bq, pack, split in itertools.product(args.queries_per_block, args.pack_heads, args.splits):
        cuda_prefill.QUERIES_PER_BLOCK, cuda_prefill.PACK_HEADS = bq, pack == "on"
        cuda_prefill._launches = cuda_prefill.LaunchCache()
        splits = None if split == "auto" else int(split)
        shown = cuda_prefill.plan_splits(q, view) if splits is None else splits
        ms = timed(kernel, args.iters)
        line += f" kernel(BQ={bq} PG={pack} S={split}:{shown}) {ms:.2f} ms,"
    line += f" ops {timed(ops, args.iters):.2f} ms, sdpa {timed(sdpa, args.iters):.2f} ms"
    return line


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--new", type=int, nargs="+", default=[64], help="queries per sequence")
    ap.add_argument("--prefix", type=int, nargs="+", default=[2048], help="cached tokens")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument(
        "--queries-per-block",
        type=int,
        nargs="+",
        default=[cuda_prefill.QUERIES_PER_BLOCK],
        help="the kernel's queries per thread block (16 per warp)",
    )
    ap.add_argument(
        "--pack-heads",
        nargs="+",
        choices=["on", "off"],
        default=["on"],
        help="a block's rows over every query head of a KV head (on) or over one (off)",
    )
    ap.add_argument(
        "--splits", nargs="+", default=["auto"], help="key splits: auto (planned) or a number"
    )
    args = ap.parse_args()
    if not mx.cuda.is_available():
        raise SystemExit("prefill_attention.py times the CUDA prefill kernel: it needs a CUDA GPU.")
    for b, n, prefix in itertools.product(args.batch, args.new, args.prefix):
        print(case(args, b, n, prefix), flush=True)


if __name__ == "__main__":
    main()
