"""Many engines in one process, each loading a long prompt from the disk tier while another
request decodes: every load must succeed, however many engines came and went before it.

One engine computes the prompt and spills its blocks; then ``--engines`` new engines, one
after the other, each serve it from disk (the whole load in one step) beside a decoding
request. One line per engine: its time to first token and MLX's active and cached memory.

Usage:
    python benchmarks/disk_engines.py --engines 6                 # on the GPU
    python benchmarks/disk_engines.py --shape small --tokens 512 --engines 3   # CPU
"""

from __future__ import annotations

import argparse
import random
import shutil
import tempfile

import mlx.core as mx
from disk_tier import SHAPES, first_token, random_llama, while_decoding

from mlx_paged import PagedEngine


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", choices=SHAPES, default="1b", help="a random llama's shape")
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--engines", type=int, default=6)
    args = ap.parse_args()
    model = random_llama(args.shape)
    rng = random.Random(0)
    vocab = model.args.vocab_size
    prompt = [rng.randrange(vocab) for _ in range(args.tokens)]
    path = tempfile.mkdtemp(prefix="mlx_paged_engines_")
    kw = dict(prefill_step_size=2048, block_size=args.block_size)
    try:
        first = PagedEngine(model, kv_disk_dir=path, kv_disk_bytes=10**12, **kw)
        first_token(first, prompt)
        first.disk.spill_cached()
        del first
        for i in range(args.engines):
            engine = PagedEngine(model, kv_disk_dir=path, kv_disk_bytes=10**12, **kw)
            engine.disk.step_blocks = 1 << 30  # the whole load in one step
            other = [rng.randrange(vocab) for _ in range(64)]
            ttft, _ = while_decoding(engine, prompt, other)
            active, cached = mx.get_active_memory() / 1e9, mx.get_cache_memory() / 1e9
            print(
                f"engine {i + 1}: first token from disk {ttft:.3f} s; MLX active "
                f"{active:.2f} GB, cached {cached:.2f} GB",
                flush=True,
            )
            del engine
    finally:
        shutil.rmtree(path, ignore_errors=True)


if __name__ == "__main__":
    main()
