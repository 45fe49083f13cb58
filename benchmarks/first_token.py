"""Where one request's time to first token goes: ``PagedEngine`` against mlx-lm's prompt cache.

One request at a time (a server at concurrency 1): a shared ``--system`` token
prompt that is already cached, plus ``--question`` new tokens. Dense: what
mlx_lm.server does, ``copy.deepcopy`` of a prompt cache holding the system
prompt, then ``generate_step`` until its first token. Paged: ``add_request``
and ``step(on_event=...)`` until the first token is heard, with the engine's
phases timed (admission, each prefill forward, sampling). Each case runs
``--repeat`` times with a new question of a different length, as a server sees.

Usage:
    python benchmarks/first_token.py --model DIR          # an mlx-lm model directory
    python benchmarks/first_token.py --system 256 --question 16 --repeat 3   # CPU, embedded model
"""

from __future__ import annotations

import argparse
import copy
import random
import statistics
import time
from collections import defaultdict

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache

from mlx_paged import PagedEngine
from mlx_paged.embedded import load_model


class Phases:
    """Wall time per named phase, summed over calls (each call's MLX work evaluated)."""

    def __init__(self) -> None:
        self.ms: dict[str, float] = defaultdict(float)

    def wrap(self, obj: object, name: str, label: str) -> None:
        inner = getattr(obj, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            out = inner(*args, **kwargs)
            if isinstance(out, mx.array):
                mx.eval(out)
            self.ms[label] += 1000 * (time.perf_counter() - start)
            return out

        setattr(obj, name, timed)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="mlx-lm model directory (default: embedded)")
    ap.add_argument("--system", type=int, default=1024)
    ap.add_argument("--question", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=8)
    args = ap.parse_args()
    model, _ = load_model(args.model)
    rng = random.Random(0)
    system = [rng.randrange(100, 30000) for _ in range(args.system)]
    questions = [
        [rng.randrange(100, 30000) for _ in range(args.question + i)]
        for i in range(args.repeat + 1)
    ]

    base = make_prompt_cache(model)
    mx.eval(model(mx.array(system)[None], cache=base)[:, -1])
    dense = []
    for q in questions:
        start = time.perf_counter()
        cache = copy.deepcopy(base)
        token, _ = next(generate_step(mx.array(q), model, prompt_cache=cache, max_tokens=1))
        dense.append(time.perf_counter() - start)

    engine = PagedEngine(model)
    engine.generate([system], max_tokens=1)  # the system prompt is cached from here on
    phases = Phases()
    phases.wrap(engine.runner, "forward", "prefill forwards (batched)")
    phases.wrap(engine.runner, "prefill", "prefill forwards (alone)")
    phases.wrap(engine.runner, "sample", "sampling")
    phases.wrap(engine.scheduler, "index_written", "indexing written blocks")
    paged, hits = [], []
    for q in questions:
        heard: list[float] = []
        start = time.perf_counter()
        uid = engine.add_request(system + q, 1)
        req = engine.request(uid)
        while not heard:
            engine.step(on_event=lambda e, heard=heard: heard.append(time.perf_counter()))
        paged.append(heard[0] - start)
        hits.append(req.prefix_hit)
    # The first question of each case compiles kernels for its shapes: left out.
    d, p = statistics.median(dense[1:]), statistics.median(paged[1:])
    print(f"system {args.system} tokens cached, question {args.question}+ tokens")
    print(f"dense first token: median {1000 * d:.1f} ms over {len(dense) - 1}")
    print(f"paged first token: median {1000 * p:.1f} ms ({p / d:.2f}x dense), prefix hits {hits}")
    runs = len(questions)
    for label, ms in phases.ms.items():
        print(f"  paged {label}: {ms / runs:.1f} ms per request (all {runs} runs)")


if __name__ == "__main__":
    main()
