"""A burst of arrivals sharing a cached prefix: how long until every one has its first token.

``PagedEngine`` on an mlx-lm model directory caches a ``--system``-token prefix,
then takes bursts of ``--n`` requests that add a suffix of their own: all of
one length (``equal``) or of lengths drawn from ``--ragged LO HI`` (``ragged``).
Each request asks for one token: a burst is timed, with the device
synchronized, from its admission until every first token is out (``step``
until all have finished). One line per case: milliseconds per burst, in order
(the first holds the process's first-use work for the shapes), the prefill
forwards a burst took, and the peak memory of the case's rounds (with ``--dense``,
the dense runs' included). ``--dense`` adds mlx-lm's ``KVCache`` running each equal
burst as one batch over the same prefix (repeated per row outside the clock).

Usage:
    python benchmarks/prefill_burst.py --model /root/l1b --prefill-step-size 512 2048
    python benchmarks/prefill_burst.py --model DIR --system 64 --n 4 --rounds 2   # CPU
    python benchmarks/prefill_burst.py --model /root/l1b --prefill-step-size 512 --breakdown
    python benchmarks/prefill_burst.py --model /root/l1b --prefill-step-size 512 --warm-up
    python benchmarks/prefill_burst.py --model DIR --system 1030 --num-blocks 100000  # copies
    python benchmarks/prefill_burst.py --model /root/l1b --system 2048 --suffix 64 --n 32 64 \
        --prefill-step-size 2048 --overlap off on --dense    # overlapped prefills, dense baseline
    python benchmarks/prefill_burst.py --model /root/l1b --system 2048 --suffix 64 --n 32 64 \
        --prefill-kernel off on --dense    # the fused prefill kernel against attention by ops
"""

from __future__ import annotations

import argparse
import itertools
import random
import time

import mlx.core as mx
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache

from mlx_paged import PagedEngine
from mlx_paged.attention import PREFILL_KERNELS, path_counts
from mlx_paged.engine.warmup import warm_up


class Split:
    """Host seconds of a burst's prefill forwards: building their graphs (``build``), the
    whole forward with its evaluation (``forward``), and the rest of ``_prefill``
    (sampling, indexing) as ``other``."""

    def __init__(self, engine: PagedEngine):
        self.build = self.forward = 0.0
        runner = engine.runner
        batched, forward = runner._batched, runner._forward

        def timed_batched(*a, **k):
            t = time.perf_counter()
            out = batched(*a, **k)
            self.build += time.perf_counter() - t
            return out

        def timed_forward(*a, **k):
            t = time.perf_counter()
            out = forward(*a, **k)
            self.forward += time.perf_counter() - t
            return out

        runner._batched, runner._forward = timed_batched, timed_forward

    def reset(self) -> None:
        self.build = self.forward = 0.0


def burst(
    engine: PagedEngine, prompts: list[list[int]], split: Split | None = None
) -> tuple[float, int]:
    """Milliseconds until every one of ``prompts`` has its first token (``step``s of
    requests for one token each), and the prefill forwards taken."""
    forwards = 0
    prefill = engine.prefiller.prefill

    def counting(work, *args, **kwargs):
        nonlocal forwards
        forwards += len(work.steps)
        return prefill(work, *args, **kwargs)

    engine.prefiller.prefill = counting
    for p in prompts:
        engine.add_request(p, 1)
    mx.synchronize()
    if split is not None:
        split.reset()
    start = time.perf_counter()
    while engine.waiting or engine.running:
        engine.step()
    mx.synchronize()
    elapsed = 1000 * (time.perf_counter() - start)
    engine.prefiller.prefill = prefill
    return elapsed, forwards


def dense_burst(model, system: list[int], suffixes: list[list[int]]) -> float:
    """Milliseconds for mlx-lm's ``KVCache`` to run ``suffixes`` (equal lengths) as one
    batch after ``system`` and give each row's last logits, ``system`` prefilled once
    and repeated per row outside the clock."""
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array(system)[None], cache=cache))
    for c in cache:
        c.keys = mx.repeat(c.keys[:, :, : c.offset], len(suffixes), axis=0)
        c.values = mx.repeat(c.values[:, :, : c.offset], len(suffixes), axis=0)
    mx.eval([c.state for c in cache])
    mx.synchronize()
    start = time.perf_counter()
    logits = model(mx.array(suffixes), cache=cache)[:, -1]
    mx.eval(logits, [c.state for c in cache])
    return 1000 * (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="mlx-lm model directory")
    ap.add_argument("--prefill-step-size", type=int, nargs="+", default=[512, 2048])
    ap.add_argument("--system", type=int, default=1024, help="cached prefix tokens")
    ap.add_argument("--suffix", type=int, default=70, help="tokens of each equal suffix")
    ap.add_argument("--ragged", type=int, nargs=2, default=[60, 80], help="ragged suffix range")
    ap.add_argument("--n", type=int, nargs="+", default=[32, 1], help="requests per burst")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument(
        "--prefill-batch-tokens", type=int, nargs="+", default=[None], help="PagedEngine's"
    )
    ap.add_argument(
        "--breakdown",
        action="store_true",
        help="also print the last burst's ms building the forwards' graphs, in the forwards "
        "with their evaluation, and in the rest (sampling, indexing; with --overlap on, the "
        "wait for an overlapped forward too)",
    )
    ap.add_argument("--warm-up", action="store_true", help="run the server's warm-up first")
    ap.add_argument(
        "--overlap",
        nargs="+",
        choices=["on", "off"],
        default=["on"],
        help="PagedEngine's overlap: batched prefills dispatched before the previous one's "
        "first tokens are read (on), or each read first (off)",
    )
    ap.add_argument(
        "--prefill-kernel",
        nargs="+",
        choices=["on", "off"],
        default=["on"],
        help="offer batched prefills to the fused paged prefill kernels (on: where one runs) "
        "or keep attention over gathered K/V (off)",
    )
    ap.add_argument(
        "--dense",
        action="store_true",
        help="also time mlx-lm's KVCache on each equal burst, as one batch (the baseline)",
    )
    ap.add_argument(
        "--num-blocks",
        type=int,
        default=None,
        help="a fixed pool of this many blocks (default: grown on demand); with a --system "
        "that is not a multiple of the block size, each request copies the partial block",
    )
    args = ap.parse_args()
    model, _ = load(args.model)
    kernels = list(PREFILL_KERNELS)
    settings = itertools.product(
        args.prefill_kernel, args.prefill_step_size, args.prefill_batch_tokens, args.overlap
    )
    for kernel, step, batch_tokens, overlap in settings:
        PREFILL_KERNELS[:] = kernels if kernel == "on" else []
        engine = PagedEngine(
            model,
            max_batch_size=max(args.n),
            prefill_step_size=step,
            prefill_batch_tokens=batch_tokens,
            num_blocks=args.num_blocks,
            overlap=overlap == "on",
        )
        if args.warm_up:
            print(f"warm-up: {warm_up(engine):.2f} s", flush=True)
        vocab = engine.vocab_size or 256
        rng = random.Random(0)
        system = [rng.randrange(vocab) for _ in range(args.system)]
        engine.generate([system + [1]], max_tokens=1)  # cache the prefix
        split = Split(engine) if args.breakdown else None
        for n in args.n:
            for kind in ("equal", "ragged"):
                times, dense = [], []
                mx.reset_peak_memory()
                for _ in range(args.rounds):
                    lo, hi = (args.suffix, args.suffix) if kind == "equal" else args.ragged
                    lengths = [rng.randint(lo, hi) for _ in range(n)]
                    suffixes = [[rng.randrange(vocab) for _ in range(k)] for k in lengths]
                    kernel_calls = sum(path_counts[k.__name__] for k in kernels)
                    times.append(burst(engine, [system + x for x in suffixes], split))
                    kernel_calls = sum(path_counts[k.__name__] for k in kernels) - kernel_calls
                    if args.dense and kind == "equal":
                        dense.append(dense_burst(model, system, suffixes))
                ms = " ".join(f"{t:.1f}" for t, _ in times)
                line = f"prefill kernel {kernel} prefill_step_size {step} batch tokens "
                line += f"{batch_tokens} overlap {overlap} "
                line += f"n={n} {kind}: "
                line += f"ms per burst {ms}; "
                if dense:
                    line += f"dense {' '.join(f'{t:.1f}' for t in dense)}; "
                line += f"forwards {times[-1][1]}, prefill kernel calls {kernel_calls}, "
                line += f"peak {mx.get_peak_memory() / 1e9:.2f} GB"
                if split is not None:
                    other = times[-1][0] - 1e3 * split.forward
                    line += (
                        f"; last burst: build {1e3 * split.build:.1f} ms, forwards with "
                        f"their evaluation {1e3 * split.forward:.1f} ms, other {other:.1f} ms"
                    )
                print(line, flush=True)


if __name__ == "__main__":
    main()
