"""The quantized cold tier: how many requests one KV memory budget holds, and their speed.

Workload W (``--n`` requests, each a shared ``--system``-token prompt plus
``--unique`` tokens of its own, generating ``--gen``) runs through
``PagedEngine`` in the same KV memory budget (``--budget-blocks`` full-precision
blocks' worth of bytes) three ways: all full precision, and with an 8-bit and
a 4-bit cold tier behind a ``--hot-tokens`` hot tail. A tiered engine gets
``num_blocks`` full-precision blocks for the hot tails (what its requests hold
at most) and the rest of the budget as cold blocks.

For each tier it reports the largest N held without preemption (bisection,
one engine run per probe), then, at the full-precision tier's largest N:
generated tok/s, decode step time, and the decode attention time of one
layer (the layer's read and attention over every running request, timed
alone) times the layer count. ``--decode-rounds R`` also times decode steps
alone at that N, the three tiers' engines taking turns for R rounds.

Usage:
    python benchmarks/cold_tier.py --dtype float16                      # on a GPU
    python benchmarks/cold_tier.py --layers 2 --hidden 256 --system 256 --budget-blocks 120 \\
        --gen 16 --hot-tokens 32                                         # quick look, CPU
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).parent))
from engine import build_model  # noqa: E402

from mlx_paged import PagedEngine  # noqa: E402
from mlx_paged.attention import paged_attention  # noqa: E402
from mlx_paged.blocks import LayerKind  # noqa: E402
from mlx_paged.cache import DecodeBatch, StepPagedKVCache  # noqa: E402
from mlx_paged.storage import KVQuant  # noqa: E402


def block_bytes(args, bits: int | None) -> int:
    """Bytes of one block over every layer: full precision, or ``bits``-bit with scales."""
    heads = max(1, args.hidden // 64)
    kv_heads, d, item = max(1, heads // 4), 64, getattr(mx, args.dtype).size
    per_row = d * item if bits is None else d * bits // 8 + 2 * (d // args.group_size) * item
    return 2 * args.layers * args.block_size * kv_heads * per_row


def hot_blocks(args, n: int) -> int:
    """Full-precision blocks n requests hold at most with a cold tier behind the hot tail.

    Each request's own tokens, or its hot tail and the blocks waiting to move,
    whichever is less; and admission takes a whole prompt's blocks before
    any of them can move.
    """
    bs = args.block_size
    batch = KVQuant(8, args.group_size, args.hot_tokens).migrate_blocks(bs)
    own = -(-(args.unique + args.gen) // bs) + 1
    per_request = min(own, -(-(args.hot_tokens + 1) // bs) + batch + 2)
    first_prompt = -(-(args.system + args.unique) // bs) + 2
    return max(n * per_request + first_prompt, first_prompt + n)


def engine_for(model, args, bits: int | None, n: int) -> PagedEngine | None:
    """An engine in the budget for n requests, or None if the budget cannot split so."""
    common = dict(
        block_size=args.block_size,
        max_batch_size=n,
        prefill_step_size=args.prefill_step_size,
    )
    if bits is None:
        return PagedEngine(model, num_blocks=args.budget_blocks, **common)
    hot = min(hot_blocks(args, n), args.budget_blocks)
    left = (args.budget_blocks - hot) * block_bytes(args, None)
    cold = left // block_bytes(args, bits)
    if cold <= 0:
        return None
    return PagedEngine(
        model,
        num_blocks=hot,
        kv_bits=bits,
        kv_group_size=args.group_size,
        hot_tokens=args.hot_tokens,
        cold_blocks=cold,
        **common,
    )


def prompts(args, n: int) -> list[list[int]]:
    rng = random.Random(0)
    system = [rng.randrange(args.vocab) for _ in range(args.system)]
    return [system + [rng.randrange(args.vocab) for _ in range(args.unique)] for _ in range(n)]


def holds(model, args, bits: int | None, n: int) -> bool:
    """Whether n requests of W all run at once in the budget, none preempted or refused."""
    engine = engine_for(model, args, bits, n)
    if engine is None:
        return False
    try:
        for p in prompts(args, n):
            engine.add_request(p, args.gen)
        most = 0
        while engine.waiting or engine.running:
            engine.step()
            most = max(most, len(engine.running))
            if engine.stats().preemptions:
                return False
    except ValueError:
        return False
    return most == n


def largest_n(model, args, bits: int | None) -> int:
    lo, hi = 0, args.max_n + 1  # holds(lo), not holds(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if holds(model, args, bits, mid):
            lo = mid
        else:
            hi = mid
    return lo


def speed(model, args, bits: int | None, n: int) -> dict:
    """Generated tok/s, decode step time and one layer's decode attention time at n."""
    engine = engine_for(model, args, bits, n)
    for p in prompts(args, n):
        engine.add_request(p, args.gen)
    start, tokens, steps, decode_s = time.perf_counter(), 0, 0, 0.0
    attention_ms = None
    while engine.waiting or engine.running:
        full = not engine.waiting and len(engine.running) == n
        t = time.perf_counter()
        tokens += len(engine.step())
        if full:
            decode_s, steps = decode_s + time.perf_counter() - t, steps + 1
        if full and steps == 8:
            attention_ms = attention_time(engine, args)
    wall = time.perf_counter() - start
    stats = engine.stats()
    return dict(
        tok_s=tokens / wall,
        step_ms=1e3 * decode_s / max(steps, 1),
        attention_ms=attention_ms,
        preemptions=stats.preemptions,
        cold_blocks=stats.cold_blocks,
    )


def decode_turns(model, args, n: int, rounds: int, warm: int = 16) -> dict:
    """ms per decode step of n running requests, for each tier, the tiers taking turns.

    One engine per tier holds n requests of W at once (prefilled, ``warm`` steps
    run, blocks moved into the cold tier); then each round runs an equal share of
    the rest of ``--gen``'s decode steps (a round's worth kept as room) of every engine in turn.
    Returns ``{tier: (best, median, phases)}`` over the rounds, ``phases`` the engine's
    host ms a step by phase (``StepClock``) over all of them; taking turns keeps the
    host's and the GPU's swings from deciding which tier looks faster.
    """
    tiers = [None, 8, 4]
    steps = (args.gen - warm) // (rounds + 1)  # a round's worth of room for admission
    if steps < 1:
        raise ValueError(f"--gen {args.gen} leaves no decode steps for {rounds} rounds")
    engines = {}
    for bits in tiers:
        engine = engine_for(model, args, bits, n)
        for p in prompts(args, n):
            engine.add_request(p, args.gen)
        while engine.waiting or len(engine.running) < n:
            engine.step()
        for _ in range(warm):  # past the first moves into the tier
            engine.step()
        engine.clock.reset()
        engines[bits] = engine
    times: dict = {bits: [] for bits in tiers}
    for _ in range(rounds):
        for bits, engine in engines.items():
            start = time.perf_counter()
            for _ in range(steps):
                engine.step()
            mx.synchronize()
            times[bits].append(1e3 * (time.perf_counter() - start) / steps)
            assert len(engine.running) == n and not engine.stats().preemptions
    out = {}
    for bits, t in times.items():
        clock = engines[bits].clock
        phases = {k: round(1e3 * v / clock.decode_steps, 2) for k, v in clock.seconds.items() if v}
        out[bits] = (min(t), sorted(t)[len(t) // 2], phases)
    return out


def attention_time(engine: PagedEngine, args, iters: int = 20) -> float:
    """ms of one layer's decode read + attention over the running requests, x layers."""
    pool = engine.runner.pools[LayerKind()]
    reqs = list(engine.running)
    for r in reqs:  # the slot the next token goes to is already private
        t = r.tables[LayerKind()]
        pool.reserve(t, t.lengths[0], t.lengths[0] + 1)
    batch = DecodeBatch(pool, [r.tables[LayerKind()] for r in reqs], None, 1)
    cache = StepPagedKVCache(pool, batch, 0, None)
    heads = max(1, args.hidden // 64)
    kv_heads, dtype = max(1, heads // 4), getattr(mx, args.dtype)
    q = mx.random.normal((len(reqs), heads, 1, 64)).astype(dtype)
    kv = mx.random.normal((len(reqs), kv_heads, 1, 64)).astype(dtype)

    def one() -> mx.array:
        k, v = cache.update_and_fetch(kv, kv)
        return paged_attention(q, k, v, cache, 0.125, cache.make_mask(1))

    mx.eval(one())
    t = time.perf_counter()
    for _ in range(iters):
        mx.eval(one())
    return 1e3 * (time.perf_counter() - t) / iters * args.layers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--system", type=int, default=2048)
    parser.add_argument("--unique", type=int, default=64)
    parser.add_argument("--gen", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--prefill-step-size", type=int, default=512)
    parser.add_argument("--budget-blocks", type=int, default=1000)
    parser.add_argument("--hot-tokens", type=int, nargs="+", default=[64])
    parser.add_argument("--group-size", type=int, default=64)
    parser.add_argument("--max-n", type=int, default=256)
    parser.add_argument(
        "--decode-rounds",
        type=int,
        default=0,
        help="also time decode steps at the full-precision tier's largest N, the tiers "
        "taking turns for this many rounds (--gen's steps split among them)",
    )
    args = parser.parse_args()
    args.shape = "llama"  # engine.build_model: a llama with head_dim 64
    model = build_model(args)
    print(
        f"device={mx.default_device()} dtype={args.dtype} layers={args.layers} "
        f"hidden={args.hidden} W: {args.system} shared + {args.unique} unique, gen {args.gen}; "
        f"budget {args.budget_blocks} full-precision blocks of {args.block_size} "
        f"({args.budget_blocks * block_bytes(args, None) / 1e6:.1f} MB)",
        flush=True,
    )
    holds(model, args, None, 4)  # compile kernels outside the clock
    hot_choices = args.hot_tokens
    args.hot_tokens = hot_choices[0]
    base = largest_n(model, args, None)
    fp = speed(model, args, None, base)
    print(f"full precision: largest N {base}; at N={base}: {fp}", flush=True)
    if args.decode_rounds:
        turns = decode_turns(model, args, base, args.decode_rounds)
        for bits, (best, median, phases) in turns.items():
            ratio = turns[None][1] / median
            print(
                f"decode steps at N={base}, {bits or 'full precision'}"
                f"{'-bit cold' if bits else ''}: best {best:.2f} ms, median {median:.2f} ms, "
                f"{base / median * 1e3:.0f} tok/s ({ratio:.2f}x full precision's median); "
                f"host ms a step {phases}",
                flush=True,
            )
    for hot in hot_choices:
        args.hot_tokens = hot
        for bits in (8, 4):
            n = largest_n(model, args, bits)
            s = speed(model, args, bits, base) if holds(model, args, bits, base) else None
            print(
                f"{bits}-bit cold, hot_tokens {hot}: largest N {n} ({n / max(base, 1):.2f}x); "
                f"at N={base}: {s}",
                flush=True,
            )


if __name__ == "__main__":
    main()
