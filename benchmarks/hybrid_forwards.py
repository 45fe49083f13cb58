"""A hybrid's prefill forwards in ``PagedEngine``, one by one: new shapes against seen ones.

Waves of ``--waves`` arrivals, each a chat-templated question after one cached system
prompt (``hybrid_waves.prompts``), are added at once and run to their first tokens.
Every prefill forward is synchronized before and after and printed with its (rows,
tokens) shape, whether the process had run that shape before, and its milliseconds.
With ``--modules``, from the ``--modules``-th wave on, each call of the model's
recurrent layers, attention layers, MLPs, linear layers (every projection, inside the
others), depthwise convolutions and gated-delta recurrences is evaluated and timed on
its own (which adds a synchronization to each), and a forward's line also gives their
sums: which part of the model a new shape costs.

Usage:
    python benchmarks/hybrid_forwards.py --model /root/q35 --modules 6   # GPU
    python benchmarks/hybrid_forwards.py --model /root/q35 --row-buckets # padded row counts
    python benchmarks/hybrid_forwards.py --hidden 128 --layers 4 --waves 3 5 --modules 1
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable

import mlx.core as mx
from hybrid_waves import model_flags, model_of, prompts
from mlx_lm.models import gated_delta

from mlx_paged import PagedEngine, bucket_matmul_rows

#: The classes timed with ``--modules``, by name.
TIMED = (
    "GatedDeltaNet",
    "Qwen3NextGatedDeltaNet",
    "Attention",
    "Qwen3NextAttention",
    "MLP",
    "Qwen3NextMLP",
    "DepthwiseConv1d",
    "Linear",
    "FewRowsLinear",
    "RowBucketLinear",
    "RowBucketFewRowsLinear",
)


class Clock:
    """Milliseconds per part of the forward running now, while ``on``."""

    def __init__(self):
        self.on = False
        self.parts: dict[str, float] = defaultdict(float)

    def wrap(self, name: str, fn: Callable) -> Callable:
        def call(*args, **kwargs):
            if not self.on:
                return fn(*args, **kwargs)
            mx.eval([a for a in args if isinstance(a, mx.array)])
            mx.synchronize()
            tic = time.perf_counter()
            out = fn(*args, **kwargs)
            mx.eval(out)
            mx.synchronize()
            self.parts[name] += 1e3 * (time.perf_counter() - tic)
            return out

        return call


def instrument(engine: PagedEngine, clock: Clock, modules: list[bool]) -> None:
    """Print each prefill forward; time its parts where ``modules[0]`` holds."""
    seen: set[tuple[int, int]] = set()
    runner = engine.runner
    for kind in ("forward", "prefill"):
        run = getattr(runner, kind)

        def timed(reqs, n, *args, _run=run, _kind=kind, **kwargs):
            shape = (1 if _kind == "prefill" else len(reqs), n)
            new = shape not in seen
            seen.add(shape)
            clock.parts.clear()
            clock.on = modules[0]
            mx.synchronize()
            tic = time.perf_counter()
            out = _run(reqs, n, *args, **kwargs)
            mx.eval(out if out is not None else [])
            mx.synchronize()
            ms = 1e3 * (time.perf_counter() - tic)
            clock.on = False
            parts = " ".join(f"{k} {v:.1f}" for k, v in sorted(clock.parts.items()))
            label = "batched" if _kind == "forward" else "alone"
            fresh = "new " if new else "seen"
            print(f"  {label:7s} {shape[0]:3d} x {n:4d} {fresh} {ms:7.1f} ms  {parts}", flush=True)
            return out

        setattr(runner, kind, timed)


def main() -> None:
    ap = model_flags(__doc__.split("\n")[0])
    ap.add_argument("--waves", type=int, nargs="+", default=[5, 9, 5, 9, 13, 13, 24, 24, 31, 31])
    ap.add_argument("--modules", type=int, help="time the model's parts from this wave on")
    ap.add_argument(
        "--row-buckets", action="store_true", help="mlx_paged.bucket_matmul_rows(model) first"
    )
    args = ap.parse_args()
    model, tokenizer = model_of(args)
    if args.row_buckets:
        print(f"{bucket_matmul_rows(model)} layers pad a prompt's rows", flush=True)
    ids = prompts(1 + sum(args.waves), args.system, args.question, 16, tokenizer)
    engine = PagedEngine(model, block_size=16, max_batch_size=max(args.waves))
    clock, modules = Clock(), [False]
    if args.modules is not None:
        for _, m in model.named_modules():
            cls = type(m)
            if cls.__name__ in TIMED and not hasattr(cls.__call__, "timed"):
                cls.__call__ = clock.wrap(cls.__name__, cls.__call__)
                cls.__call__.timed = True
        gated_delta.gated_delta_ops = clock.wrap("gated_delta", gated_delta.gated_delta_ops)
    instrument(engine, clock, modules)
    print(f"device={mx.default_device()} prompts of {len(ids[0])} tokens; the system prompt:")
    engine.add_request(ids[0], 2)
    while engine.waiting or engine.running:
        engine.step()
    start = 1
    for i, k in enumerate(args.waves):
        modules[0] = args.modules is not None and i >= args.modules
        print(f"wave {i}: {k} arrivals{', parts timed' if modules[0] else ''}", flush=True)
        for p in ids[start : start + k]:
            engine.add_request(p, 2)
        start += k
        while engine.waiting or engine.running:
            engine.step()


if __name__ == "__main__":
    main()
