"""A long prompt re-sent after a restart: its first token from the disk tier against recomputing it.

One engine with ``kv_disk_dir`` serves the prompt (timed: the recompute), writes
its cached blocks (``spill_cached``, as a server's shutdown does) and is
dropped. A new engine, as after a restart, serves the same prompt from the
directory (timed: the disk). A third engine without the tier serves it cold
again, in the same process state as the second (timed: the recompute, again).
Time to first token counts from ``add_request`` to the first token's event.

Usage:
    python benchmarks/disk_tier.py --shape 1b --tokens 32768      # on the GPU
    python benchmarks/disk_tier.py --tokens 4096                  # CPU: a small llama
    python benchmarks/disk_tier.py --shape 1b --tokens 32768 --kv-bits 4   # the cold tier
    python benchmarks/disk_tier.py --shape qwen3_5 --tokens 32768   # a hybrid (float16)

With ``--kv-bits`` every engine keeps a quantized cold tier: the prompt's blocks
behind its last ``--hot-tokens`` tokens are quantized, go to disk quantized and
come back into the cold tier, so the disk holds fewer bytes per token. The
recompute in the same configuration and a full-precision one are both printed.

Then the prompt comes back from disk while another request decodes, loaded
in one step, in the tier's default steps (``DiskTier.step_blocks`` and
``step_bytes``) or 128 blocks a step: the time to its first token, the steps
it took, and the longest the other request waits for a token meanwhile.

Each restarted engine makes and pins its staging buffers first, outside the
clock, and moves the objects made so far out of the garbage collector's
generations, as a server's warm-up does (``DiskTier.rehearse``, ``gc.freeze``;
``--no-gc-freeze`` leaves them there). The first two
restarts read the files from the page cache, as a restarted server would; the
ones after ask the kernel to drop its page cache first
(``/proc/sys/vm/drop_caches``, root only) and say whether it could. The first
restart pays the process's first-use work at the prompt's length. With
``--kv-disk-preload-bytes N`` each restart runs twice: as above, then with N bytes of the
newest entries read into host memory as the engine starts (``kv_disk_preload_bytes``),
waited for before the request; with ``--restore`` too, a third time, with the prefixes those
entries hold restored into the pool before the request (``DiskTier.restore``).

``--shape qwen3_5`` is the Qwen3.5-shaped hybrid of ``benchmarks/engine.py`` (about 1B
parameters, three GatedDeltaNet layers to one of attention): its restarts load blocks and
the deepest recurrent-state snapshot on disk.

With ``--cache`` it times ``make_paged_cache``'s disk prefixes instead of the engine's
tier: mlx-lm's ``generate_step`` runs the prompt on mlx-lm's own cache (the baseline); a
paged cache with ``kv_disk_dir`` runs the prompt up to its last block boundary, which
``save_prefix`` writes (with the state there, for a hybrid), then the rest. Then, as a new
process would (the store's registry emptied), a new cache is opened, ``load_prefix``
fills it and ``generate_step`` runs the rest to the first token.

Under ``mlx.launch`` (``mlx.launch -n 2 --backend nccl -- python benchmarks/disk_tier.py
...``) the random model is sharded by tensor across the ranks, every engine runs with the
group, each rank keeps its shard in its own part of the directory, and rank 0 prints.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm.models import llama

from mlx_paged import PagedEngine
from mlx_paged.engine.distributed import shard_model
from mlx_paged.storage.disk import READ_THREADS


def first_token(engine: PagedEngine, prompt: list[int], max_tokens: int = 1) -> float:
    """Seconds from adding ``prompt`` to its first token; the request then runs to its end."""
    start = time.perf_counter()
    uid = engine.add_request(prompt, max_tokens)
    seconds = None
    for event in engine.stream():
        if event.uid == uid and seconds is None:
            mx.synchronize()
            seconds = time.perf_counter() - start
    if seconds is None:
        raise RuntimeError("no token came")
    return seconds


SHAPES = {  # llama shapes with random weights: (hidden, layers, heads, KV heads, MLP, dtype)
    "small": (512, 8, 8, 4, 1024, "float32"),  # the CPU's
    "1b": (2048, 16, 32, 8, 8192, "float16"),  # llama-3.2-1B
    "8b": (4096, 32, 32, 8, 14336, "float16"),  # llama-3.1-8B
}


def random_llama(shape: str) -> llama.Model:
    if shape == "qwen3_5":
        from engine import build_model

        hybrid = dict(shape=shape, hidden=1536, layers=24, vocab=151936, dtype="float16")
        return build_model(argparse.Namespace(**hybrid))
    hidden, layers, heads, kv_heads, mlp, dtype = SHAPES[shape]
    config = llama.ModelArgs(
        model_type="llama",
        hidden_size=hidden,
        num_hidden_layers=layers,
        intermediate_size=mlp,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        rms_norm_eps=1e-5,
        vocab_size=4096 if shape == "small" else 49152,
    )
    model = llama.Model(config)
    model.set_dtype(getattr(mx, dtype))
    mx.eval(model.parameters())
    return model


def page_cache_rate(files: list[Path], pieces: int = 2 << 20) -> float:
    """GB/s of reading ``files`` in pieces of ``pieces`` bytes with ``os.preadv`` on the
    store's reader threads into one buffer made (and touched) beforehand, as a load reads
    into its staging buffers: the best of two passes."""
    sizes = [f.stat().st_size for f in files]
    buffer = np.ones(sum(sizes), dtype=np.uint8)
    fds = [os.open(f, os.O_RDONLY) for f in files]
    jobs, at = [], 0
    for fd, size in zip(fds, sizes, strict=True):
        jobs += [(fd, lo, at + lo, min(pieces, size - lo)) for lo in range(0, size, pieces)]
        at += size

    def read(job: tuple[int, int, int, int]) -> None:
        fd, lo, to, n = job
        os.preadv(fd, [buffer[to : to + n]], lo)

    best = float("inf")
    try:
        with ThreadPoolExecutor(READ_THREADS) as pool:
            for _ in range(2):
                start = time.perf_counter()
                list(pool.map(read, jobs))
                best = min(best, time.perf_counter() - start)
    finally:
        for fd in fds:
            os.close(fd)
    return buffer.size / 1e9 / best


def drop_page_cache() -> bool:
    """Ask the kernel to forget cached file pages (needs root); whether it did."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def while_decoding(
    engine: PagedEngine, prompt: list[int], other: list[int]
) -> tuple[float, float, int]:
    """Add ``prompt`` while ``other`` decodes: seconds to ``prompt``'s first token, the
    longest wait between two of ``other``'s tokens meanwhile, and the steps it took."""
    busy = engine.add_request(other, 100_000)
    for _ in range(3):
        engine.step()
    mx.synchronize()
    start = last = time.perf_counter()
    uid = engine.add_request(prompt, 1)
    gap, steps = 0.0, 0
    while True:
        events = engine.step()
        mx.synchronize()
        now, steps = time.perf_counter(), steps + 1
        if any(e.uid == busy for e in events):
            gap, last = max(gap, now - last), now
        if any(e.uid == uid for e in events):
            engine.abort(busy)
            return now - start, gap, steps


def restart(
    model, path: str, freeze: bool, preload: int = 0, restore: bool = False, **kw
) -> PagedEngine:
    """A new engine over ``path``, ready as a server's warm-up leaves it: its staging
    buffers made and pinned (``DiskTier.rehearse``), its ``preload`` bytes of entries read
    (``kv_disk_preload_bytes``), with ``restore`` the prefixes they hold loaded into the
    pool (``DiskTier.restore``) and, with ``freeze``, every object so far out of the
    garbage collector's generations (``gc.freeze``)."""
    gc.unfreeze()  # the last engine's objects can go
    gc.collect()
    engine = PagedEngine(
        model, kv_disk_dir=path, kv_disk_bytes=10**12, kv_disk_preload_bytes=preload, **kw
    )
    engine.disk.rehearse()
    if preload:
        engine.disk.preloaded.wait()
    if restore:
        start = time.perf_counter()
        engine.disk.restore()
        seconds = engine.disk.seconds  # from here on, the request's load alone
        seconds.update(dict.fromkeys(seconds, 0.0), restore=time.perf_counter() - start)
    if freeze:
        gc.collect()
        gc.freeze()
    return engine


def cache_restarts(model, prompt: list[int], path: str, block_size: int, n: int) -> None:
    """``make_paged_cache``'s ``save_prefix`` and ``load_prefix`` against mlx-lm's own cache."""
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

    from mlx_paged import load_prefix, make_paged_cache, save_prefix
    from mlx_paged.cache import disk_prefix

    def first(toks: list[int], cache: list) -> float:
        start = time.perf_counter()
        next(generate_step(mx.array(toks), model, prompt_cache=cache))  # its .item() waits
        return time.perf_counter() - start

    def opened() -> list:
        return make_paged_cache(
            model, block_size=block_size, kv_disk_dir=path, kv_disk_bytes=10**12
        )

    tag = f"make_paged_cache bs={block_size} {len(prompt)} tokens"
    first(prompt[:2100], make_prompt_cache(model))  # first-use work at a short length
    # The second: the first at this length pays the process's first-use work.
    dense = [first(prompt, make_prompt_cache(model)) for _ in range(2)][-1]
    held = (len(prompt) - 1) // block_size * block_size  # what a load can bring back
    dense_cache = make_prompt_cache(model)
    first(prompt[: held + 1], dense_cache)
    trim_prompt_cache(dense_cache, 1)
    dense_rest = first(prompt[held:], dense_cache)
    cache = opened()
    start = time.perf_counter()
    for i in range(0, held, 2048):  # up to the block boundary a hybrid's state is saved at
        model(mx.array(prompt[i : min(i + 2048, held)])[None], cache=cache)
        mx.eval([c.state for c in cache])
    paged = time.perf_counter() - start
    start = time.perf_counter()
    saved = save_prefix(cache, prompt[:held])
    save = time.perf_counter() - start
    paged += first(prompt[held:], cache)
    print(
        f"{tag}: mlx-lm's cache {dense:.3f} s, paged {paged:.3f} s to the first token; "
        f"mlx-lm's cache holding the first {held} tokens: the rest {dense_rest:.3f} s; "
        f"save_prefix wrote {saved} tokens in {save:.3f} s",
        flush=True,
    )
    del cache
    for i in range(n):
        disk_prefix._STORES.clear()  # what a new process sees
        gc.collect()
        start = time.perf_counter()
        cache = opened()
        opening = time.perf_counter() - start
        start = time.perf_counter()
        loaded = load_prefix(cache, prompt)
        load = time.perf_counter() - start
        rest = first(prompt[loaded:], cache)
        print(
            f"{tag} restart {i + 1}: opening the directory {opening:.3f} s; load_prefix "
            f"{loaded} tokens {load:.3f} s; the rest to the first token {rest:.3f} s; "
            f"from disk {load + rest:.3f} s = {(load + rest) / dense:.3f}x of mlx-lm's cache",
            flush=True,
        )
        del cache


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="mlx-lm model directory (default: --shape)")
    ap.add_argument(
        "--shape", choices=[*SHAPES, "qwen3_5"], default="small", help="a random model's shape"
    )
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--prefill-step-size", type=int, default=2048)
    ap.add_argument("--block-size", type=int, default=16, help="tokens per block (and file)")
    ap.add_argument("--dir", default=None, help="the disk tier's directory (default: a temp one)")
    ap.add_argument(
        "--restarts", type=int, default=3, help="engines that read the prompt back from disk"
    )
    ap.add_argument("--kv-bits", type=int, choices=(4, 8), default=None, help="a cold tier's bits")
    ap.add_argument("--kv-group-size", type=int, default=64)
    ap.add_argument("--hot-tokens", type=int, default=256)
    ap.add_argument(
        "--cache", action="store_true", help="time make_paged_cache's save_prefix/load_prefix"
    )
    ap.add_argument(
        "--kv-disk-preload-bytes",
        type=int,
        default=0,
        help="also time each restart with this many bytes of entries preloaded before the "
        "request (kv_disk_preload_bytes), after the same restart without",
    )
    ap.add_argument(
        "--restore",
        action="store_true",
        help="with --kv-disk-preload-bytes, also time each restart with the preloaded "
        "prefixes restored into the pool before the request (DiskTier.restore)",
    )
    ap.add_argument(
        "--no-gc-freeze",
        action="store_true",
        help="leave the objects made before a restart's request in the collector's "
        "generations (the server moves them out after its warm-up)",
    )
    args = ap.parse_args()
    group = mx.distributed.init()
    if args.cache and group.size() > 1:
        ap.error("--cache times make_paged_cache in one process; run it without mlx.launch")
    if args.model:
        from mlx_lm import load

        model, _ = load(args.model)
    else:
        mx.random.seed(0)  # the same weights on every rank
        model = random_llama(args.shape)
    say = print if group.rank() == 0 else (lambda *a, **k: None)
    if group.size() > 1:
        shard_model(model, group)
        mx.eval(model.parameters())
    vocab = 151936 if args.shape == "qwen3_5" and not args.model else model.args.vocab_size
    rng = random.Random(0)
    prompt = [rng.randrange(vocab) for _ in range(args.tokens)]
    path = args.dir or tempfile.mkdtemp(prefix="mlx_paged_disk_")
    if args.cache:
        try:
            cache_restarts(model, prompt, path, args.block_size, args.restarts)
        finally:
            if args.dir is None:
                shutil.rmtree(path, ignore_errors=True)
        return
    full = dict(prefill_step_size=args.prefill_step_size, block_size=args.block_size)
    if group.size() > 1:
        full["group"] = group
    kw = dict(full)
    tag = f"{args.model or args.shape} bs={args.block_size}"
    tag += f" ranks={group.size()}" if group.size() > 1 else ""
    if args.kv_bits:
        kw.update(
            kv_bits=args.kv_bits, kv_group_size=args.kv_group_size, hot_tokens=args.hot_tokens
        )
        tag += f" kv_bits={args.kv_bits}"
    try:
        # The process's first-use work, outside the clock, as a server's warm-up does it.
        warm = PagedEngine(model, kv_disk_dir=path + "-warm", kv_disk_bytes=10**12, **kw)
        warm_prompt = [rng.randrange(vocab) for _ in range(args.prefill_step_size + 100)]
        first_token(warm, warm_prompt, 2 if args.kv_bits else 1)
        warm.disk.rehearse()
        del warm
        shutil.rmtree(path + "-warm", ignore_errors=True)
        first = PagedEngine(model, kv_disk_dir=path, kv_disk_bytes=10**12, **kw)
        # With a cold tier, a second token's step quantizes the blocks behind the hot tail,
        # as a served request's decode does, so that they are parked (and spilled) cold.
        recompute = first_token(first, prompt, 2 if args.kv_bits else 1)
        start = time.perf_counter()
        written = first.disk.spill_cached()
        spill = time.perf_counter() - start
        size, cold = first.disk.store.bytes, first.stats().cold_blocks
        del first
        say(
            f"{tag} {args.tokens} tokens: recompute (first engine) {recompute:.3f} s; "
            f"{written} blocks ({cold} cold, {size / 1e6:.1f} MB) written in {spill:.3f} s",
            flush=True,
        )
        own = f"rank-{group.rank()}-of-{group.size()}" if group.size() > 1 else ""
        files = list((Path(path) / own).glob("*.kv*"))  # entry files and packs
        start = time.perf_counter()
        with ThreadPoolExecutor(READ_THREADS) as pool:
            raw = sum(pool.map(lambda f: len(f.read_bytes()), files))
        fresh = raw / 1e9 / (time.perf_counter() - start)
        say(
            f"{tag} raw read of the {len(files)} files ({READ_THREADS} threads, page cache "
            f"kept): {fresh:.2f} GB/s into new buffers, {page_cache_rate(files):.2f} GB/s "
            "into one reused buffer (as a load reads)",
            flush=True,
        )
        n = args.kv_disk_preload_bytes
        kinds = [(0, False)] + [(n, False), (n, True)][: (n > 0) * (1 + args.restore)]
        for i, (preload, restore) in ((i, k) for i in range(args.restarts) for k in kinds):
            dropped = drop_page_cache() if i >= 2 else False
            restarted = restart(model, path, not args.no_gc_freeze, preload, restore, **kw)
            pre = restarted.disk.preloaded
            disk = first_token(restarted, prompt)
            tier, phases = restarted.disk, restarted.clock.seconds
            preloaded = (
                f"{pre.entries} entries ({pre.bytes / 1e9:.2f} GB) preloaded in "
                f"{pre.seconds:.3f} s before the request; "
                if pre
                else ""
            )
            if restore:
                preloaded += (
                    f"{restarted.disk.restored_tokens} tokens restored in "
                    f"{restarted.disk.seconds['restore']:.3f} s before the request; "
                )
            say(
                f"{tag} restart {i + 1}: {preloaded}from disk {disk:.3f} s; "
                f"admission {phases['admit']:.3f} s (the load in it), the first token's "
                f"prefill {phases['prefill']:.3f} s; "
                f"{restarted.stats().disk_hit_tokens} tokens loaded in "
                f"{tier.seconds['load']:.3f} s "
                f"(waiting on reads {tier.seconds['load_wait']:.3f} s, starting the copies "
                f"into MLX {tier.seconds['load_copy']:.3f} s, starting and waiting for the "
                f"pool writes {tier.seconds['load_eval']:.3f} s; reads and checks took "
                f"{tier.store.seconds['read']:.3f} s on their threads); "
                f"page cache {'dropped' if dropped else 'kept'}; "
                f"{restarted.stats().cold_blocks} cold blocks",
                flush=True,
            )
            del restarted
        # The whole load in one step, the default steps, and 128 blocks a step.
        for steps in ("all", "default", "128 blocks"):
            restarted = restart(model, path, not args.no_gc_freeze, **kw)
            if steps != "default":
                restarted.disk.step_bytes = 1 << 62
                restarted.disk.step_blocks = 128 if steps == "128 blocks" else 1 << 62
            other = [rng.randrange(vocab) for _ in range(64)]
            ttft, gap, n = while_decoding(restarted, prompt, other)
            say(
                f"{tag} from disk while another request decodes, {steps} a step: first "
                f"token {ttft:.3f} s after {n} steps; the other's longest gap between "
                f"tokens {gap * 1e3:.1f} ms",
                flush=True,
            )
            del restarted
        gc.unfreeze()
        cold = first_token(PagedEngine(model, **kw), prompt)
        say(
            f"{tag} recompute (engine without the tier) {cold:.3f} s; last from disk "
            f"{disk / min(recompute, cold):.3f}x of the faster recompute",
            flush=True,
        )
        if args.kv_bits:
            plain = first_token(PagedEngine(model, **full), prompt)
            say(
                f"{tag} recompute at full precision (no cold tier) {plain:.3f} s; last from "
                f"disk {disk / plain:.3f}x of it",
                flush=True,
            )
    finally:
        if args.dir is None:
            shutil.rmtree(path, ignore_errors=True)


if __name__ == "__main__":
    main()
