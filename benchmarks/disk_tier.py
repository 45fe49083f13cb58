"""A long prompt re-sent after a restart: its first token from the disk tier against recomputing it.

One engine with ``kv_disk_dir`` serves the prompt (timed: the recompute), writes
its cached blocks (``spill_cached``, as a server's shutdown does) and is
dropped. A new engine, as after a restart, serves the same prompt from the
directory (timed: the disk). A third engine without the tier serves it cold
again, in the same process state as the second (timed: the recompute, again).
Time to first token counts from ``add_request`` to the first token's event.

Usage:
    python benchmarks/disk_tier.py --model /root/l1b --tokens 32768      # on the GPU
    python benchmarks/disk_tier.py --tokens 4096                         # CPU: a small llama
"""

from __future__ import annotations

import argparse
import random
import shutil
import tempfile
import time

import mlx.core as mx
from mlx_lm.models import llama

from mlx_paged import PagedEngine


def first_token(engine: PagedEngine, prompt: list[int]) -> float:
    """Seconds from adding ``prompt`` to its first token."""
    start = time.perf_counter()
    uid = engine.add_request(prompt, 1)
    for event in engine.stream():
        if event.uid == uid:
            mx.synchronize()
            return time.perf_counter() - start
    raise RuntimeError("no token came")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="mlx-lm model directory (default: a small llama)")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--prefill-step-size", type=int, default=2048)
    ap.add_argument("--dir", default=None, help="the disk tier's directory (default: a temp one)")
    args = ap.parse_args()
    if args.model:
        from mlx_lm import load

        model, _ = load(args.model)
    else:
        config = llama.ModelArgs(
            model_type="llama",
            hidden_size=512,
            num_hidden_layers=8,
            intermediate_size=1024,
            num_attention_heads=8,
            num_key_value_heads=4,
            rms_norm_eps=1e-5,
            vocab_size=4096,
        )
        model = llama.Model(config)
        model.set_dtype(mx.float32)
        mx.eval(model.parameters())
    vocab = model.args.vocab_size
    rng = random.Random(0)
    prompt = [rng.randrange(vocab) for _ in range(args.tokens)]
    path = args.dir or tempfile.mkdtemp(prefix="mlx_paged_disk_")
    kw = dict(prefill_step_size=args.prefill_step_size)
    try:
        warm = PagedEngine(model, **kw)  # the process's first-use work, outside the clock
        first_token(warm, [rng.randrange(vocab) for _ in range(args.prefill_step_size + 100)])
        first = PagedEngine(model, kv_disk_dir=path, kv_disk_bytes=10**12, **kw)
        recompute = first_token(first, prompt)
        start = time.perf_counter()
        written = first.disk.spill_cached()
        spill = time.perf_counter() - start
        del first
        restarted = PagedEngine(model, kv_disk_dir=path, kv_disk_bytes=10**12, **kw)
        disk = first_token(restarted, prompt)
        hit = restarted.stats().disk_hit_tokens
        cold = first_token(PagedEngine(model, **kw), prompt)
        size = restarted.disk.store.bytes
    finally:
        if args.dir is None:
            shutil.rmtree(path, ignore_errors=True)
    print(
        f"{args.tokens} tokens: recompute {recompute:.3f} s and {cold:.3f} s, from disk "
        f"{disk:.3f} s ({disk / min(recompute, cold):.3f}x of the faster recompute); "
        f"{hit} tokens loaded, {written} blocks ({size / 1e6:.1f} MB) written in {spill:.3f} s",
        flush=True,
    )


if __name__ == "__main__":
    main()
