"""Where a hybrid model's batched decode step goes: PagedEngine against mlx-lm's batch caches.

``B`` requests, each a shared ``--system`` prompt plus ``--unique`` tokens, all
prefilled; then ``--steps`` decode steps are timed one by one:

- ``dense``: mlx-lm's own caches of the same requests merged into one batch
  (``ArraysCache.merge`` / ``KVCache.merge``, what ``BatchGenerator`` decodes
  over), one forward + argmax + transfer per step;
- ``paged``: ``PagedEngine.step()`` in steady decode, split into the runner's
  graph build (``decode``) and the wait for the sampled tokens (``sample``);
- ``state``: the recurrent-state traffic alone, the gathers and scatters of every
  recurrent layer's slots for one step when the batch is not in slot order (in
  slot order, as the engine decodes, there are none).

``--stream`` times one request instead (``--uncompiled``: the engine's decode
steps not compiled): mlx-lm's ``generate_step`` (which
overlaps each step's graph building with the previous step on the device, as the
engine does) and ``PagedEngine.step()`` advance one token each in turn, so drift
in the host's speed reaches both alike; the engine's host phases per step are
printed beside them. ``--model DIR`` loads a model directory instead of building
a random one.

Usage:
    python benchmarks/hybrid_decode.py --dtype float16      # on a GPU
    python benchmarks/hybrid_decode.py --hidden 128 --layers 4 --vocab 1000 --system 64 --b 4
    python benchmarks/hybrid_decode.py --model /path/to/model --stream --steps 240
    python benchmarks/hybrid_decode.py --dtype float16 --stream --rope-in-kernel   # as served
"""

from __future__ import annotations

import argparse
import copy
import random
import statistics
import time

import mlx.core as mx
from engine import build_model
from mlx_lm import load
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache

from mlx_paged import PagedEngine, rope_in_kernel
from mlx_paged.engine.engine import vocab_size


def dense_steps(model, prompts, steps) -> list[float]:
    caches = []
    base = make_prompt_cache(model)
    model(mx.array(prompts[0][:-1])[None], cache=base)
    mx.eval([c.state for c in base])
    for p in prompts:  # every request has the same length: the merged batch has no padding
        c = copy.deepcopy(base)
        mx.eval(model(mx.array(p[-1:])[None], cache=c))
        caches.append(c)
    batch = [type(layer[0]).merge(list(layer)) for layer in zip(*caches, strict=True)]
    y = mx.array([[p[-1]] for p in prompts])
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        y = mx.argmax(model(y, cache=batch)[:, -1, :], axis=-1)[:, None]
        y.tolist()
        times.append(time.perf_counter() - t)
    return times


def paged_steps(model, prompts, steps, args) -> tuple[list[float], list[float], list[float]]:
    engine = PagedEngine(model, max_batch_size=len(prompts), prefill_step_size=2048)
    engine.generate([prompts[0]], max_tokens=1)
    for p in prompts:
        engine.add_request(p, steps + 8)
    while engine.waiting or any(not r.generated for r in engine.running):
        engine.step()
    runner = engine.runner
    build, wait = [], []
    decode, sample = runner.decode, runner.sample

    def timed_decode(*args):
        t = time.perf_counter()
        out = decode(*args)
        build.append(time.perf_counter() - t)
        return out

    def timed_sample(*args):
        t = time.perf_counter()
        out = sample(*args)
        wait.append(time.perf_counter() - t)
        return out

    runner.decode, runner.sample = timed_decode, timed_sample
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    return times, build, wait


def state_steps(model, prompts, steps) -> list[float]:
    """The slot gathers and scatters of one decode step, alone."""
    engine = PagedEngine(model, max_batch_size=len(prompts))
    # The requests stay running, so the state arrays hold their slots: an index past the rows
    # held would read and write outside them (MLX does not check gathers).
    for p in prompts:
        engine.add_request(p[:32], 8)
    while engine.waiting or any(not r.generated for r in engine.running):
        engine.step()
    pool = engine.runner.states
    slots = [r.slot for r in engine.running][::-1]  # out of order: gathers and scatters
    assert len(slots) == len(prompts) and max(slots) < pool.rows_held
    rows = pool.rows(slots)
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        for layer in range(pool.num_layers):
            pool.write(layer, rows, [x * 1 for x in pool.read(layer, rows)])
        mx.eval(pool.evaluated())
        times.append(time.perf_counter() - t)
    return times


def stream_steps(
    model, prompt, steps, compile_decode=None
) -> tuple[list[float], list[float], dict[str, float]]:
    """One request's decode steps, ``generate_step`` and ``PagedEngine`` in turn: each one's
    step times, and the engine's host seconds per step by phase."""
    engine = PagedEngine(model, prefill_step_size=2048, compile_decode=compile_decode)
    engine.add_request(prompt, steps + 16)
    dense = generate_step(mx.array(prompt), model, max_tokens=steps + 16)
    while not engine.running or not engine.running[0].generated:
        engine.step()
    for _ in range(5):  # past the first steps of both
        engine.step()
        next(dense)
    engine.clock.reset()
    times: dict[str, list[float]] = {"dense": [], "paged": []}
    for i in range(steps):
        for name in ("dense", "paged") if i % 2 else ("paged", "dense"):
            t = time.perf_counter()
            engine.step() if name == "paged" else next(dense)
            times[name].append(time.perf_counter() - t)
    n = engine.clock.decode_steps
    phases = {k: v / n for k, v in engine.clock.seconds.items()}
    return times["dense"], times["paged"], phases


def ms(xs: list[float]) -> str:
    """The median in ms; "-" where nothing was timed (a compiled step runs neither hook)."""
    return f"{statistics.median(xs) * 1e3:7.2f} ms" if xs else "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--hidden", type=int, default=1536)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--system", type=int, default=2048)
    parser.add_argument("--unique", type=int, default=64)
    parser.add_argument("--b", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--model", help="an mlx-lm model directory (default: a random model)")
    parser.add_argument("--stream", action="store_true", help="one request, in turn with mlx-lm")
    parser.add_argument(
        "--uncompiled", action="store_true", help="with --stream: decode steps not compiled"
    )
    parser.add_argument(
        "--rope-in-kernel",
        action="store_true",
        help="the engine's decode kernel applies the attention layers' RoPE (CUDA), as "
        "mlx_paged.server runs it; mlx-lm's caches rotate in the layers as before",
    )
    args = parser.parse_args()
    args.shape = "qwen3_5"
    if args.model:
        model = load(args.model)[0]
        args.vocab = vocab_size(model)
    else:
        model = build_model(args)
    if args.rope_in_kernel:
        print(f"{rope_in_kernel(model)} attention layers leave RoPE to the kernel", flush=True)
    rng = random.Random(0)
    system = [rng.randrange(args.vocab) for _ in range(args.system)]
    print(f"device={mx.default_device()} dtype={args.dtype} system={args.system}", flush=True)
    if args.stream:
        prompt = system + [rng.randrange(args.vocab) for _ in range(args.unique)]
        compiled = False if args.uncompiled else None
        dense, paged, phases = stream_steps(model, prompt, args.steps, compiled)
        host = ", ".join(f"{k} {v * 1e3:.2f}" for k, v in phases.items() if v)
        print(
            f"one stream: dense {ms(dense)}  paged {ms(paged)}  "
            f"paged/dense {statistics.median(paged) / statistics.median(dense):.3f}x  "
            f"(paged host ms per step: {host})",
            flush=True,
        )
        return
    for b in args.b:
        prompts = [
            system + [rng.randrange(args.vocab) for _ in range(args.unique)] for _ in range(b)
        ]
        dense = dense_steps(model, prompts, args.steps)
        paged, build, wait = paged_steps(model, prompts, args.steps, args)
        state = state_steps(model, prompts, args.steps)
        print(
            f"B={b:3d}: dense {ms(dense)}  paged {ms(paged)} "
            f"(build {ms(build)}, wait {ms(wait)})  state traffic {ms(state)}  "
            f"paged/dense {statistics.median(paged) / statistics.median(dense):.2f}x",
            flush=True,
        )


if __name__ == "__main__":
    main()
