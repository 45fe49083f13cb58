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

Usage:
    python benchmarks/hybrid_decode.py --dtype float16      # on a GPU
    python benchmarks/hybrid_decode.py --hidden 128 --layers 4 --vocab 1000 --system 64 --b 4
"""

from __future__ import annotations

import argparse
import copy
import random
import statistics
import time

import mlx.core as mx
from engine import build_model
from mlx_lm.models.cache import make_prompt_cache

from mlx_paged import PagedEngine


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

    def timed_decode(reqs):
        t = time.perf_counter()
        out = decode(reqs)
        build.append(time.perf_counter() - t)
        return out

    def timed_sample(reqs, logits):
        t = time.perf_counter()
        out = sample(reqs, logits)
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
    engine.generate([prompts[0][:32]], max_tokens=1)  # allocates the state arrays
    pool = engine.runner.states
    rows = pool.rows(list(range(len(prompts)))[::-1])  # out of order: gathers and scatters
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        for layer in range(pool.num_layers):
            pool.write(layer, rows, [x * 1 for x in pool.read(layer, rows)])
        mx.eval(pool.evaluated())
        times.append(time.perf_counter() - t)
    return times


def ms(xs: list[float]) -> str:
    return f"{statistics.median(xs) * 1e3:7.2f} ms"


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
    args = parser.parse_args()
    args.shape = "qwen3_5"
    model = build_model(args)
    rng = random.Random(0)
    system = [rng.randrange(args.vocab) for _ in range(args.system)]
    print(f"device={mx.default_device()} dtype={args.dtype} system={args.system}", flush=True)
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
