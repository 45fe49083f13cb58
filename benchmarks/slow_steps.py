"""Every decode step of a full-precision engine and a cold-tier one, and what the slow ones did.

B requests share a ``--system``-token prompt and add ``--unique`` tokens each (request i
``--stagger`` times i more), as in ``decode_step.py``. The two engines (``--kv-bits`` for
the cold one) run in one process, taking turns for ``--rounds`` rounds of ``--steps`` steps
(with ``--turn N``, every N steps within a round, so that a change in the host's speed falls
on both engines alike). Each step's wall time is kept with what happened in it: blocks moved
to the cold tier (``migrate``, and its host milliseconds), new traces of the compiled step
(and their host milliseconds), and whether a block pool grew. Per engine and round it prints
the mean and median step, the total, the time of the steps that migrated, traced or grew,
the engine's host time a step by phase (``StepClock``; ``wait`` is the read of the previous
step's tokens, which waits for the GPU), for an engine that migrated each phase's median
over its migrating steps and over the steps right after them, and the steps slower than
twice the median; then the ratio of each round's totals and of all rounds' together.
``--num-blocks`` and ``--cold-blocks`` size the pools up front, as a server with
``--kv-memory`` and ``--cold-blocks`` runs; by default every pool grows on demand, and each
growth traces the compiled step again. ``--mlx-migrations`` adds a third engine, a cold one
that quantizes its migrations with MLX ops instead of the CUDA kernel
(``mlx_paged.storage.STORERS`` emptied during its turns).

Usage:
    python benchmarks/slow_steps.py --model /root/l1b --batch 14 --kv-bits 8 \\
        --fuse-projections --few-row-matmuls
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass

import mlx.core as mx
from decode_step import ready_engine, workloads
from mlx_lm import load

from mlx_paged import PagedEngine, few_row_matmuls, fuse_projections
from mlx_paged.storage import STORERS


@dataclass
class Step:
    ms: float
    migrated: int  # blocks moved to the cold tier
    migrate_ms: float
    traces: int  # new traces of the compiled step
    trace_ms: float
    grew: bool  # a block pool's capacity changed
    phases: dict[str, float]  # the engine's host ms in each StepClock phase


def timed_steps(engine: PagedEngine, steps: int) -> list[Step]:
    """``steps`` engine steps, each with what it did (its ``StepClock`` keeps adding)."""
    runner, compiled = engine.runner, engine.runner.compiled
    pools = list(runner.pools.values())
    moved = [0, 0.0]
    migrate = runner.migrate

    def counted(reqs):
        tic = time.perf_counter()
        n = migrate(reqs)
        moved[0] += n
        moved[1] += (time.perf_counter() - tic) * 1e3 if n else 0.0
        return n

    runner.migrate = counted
    clock = engine.clock
    out = []
    try:
        mx.synchronize()  # the other engine's steps are done
        for _ in range(steps):
            traces = compiled.traces if compiled else 0
            traced = compiled.trace_seconds if compiled else 0.0
            before = (list(moved), [p.blocks.capacity for p in pools])
            seconds = dict(clock.seconds)
            tic = time.perf_counter()
            engine.step()
            ms = (time.perf_counter() - tic) * 1e3
            phases = {k: (v - seconds[k]) * 1e3 for k, v in clock.seconds.items()}
            out.append(
                Step(
                    ms,
                    moved[0] - before[0][0],
                    moved[1] - before[0][1],
                    (compiled.traces - traces) if compiled else 0,
                    ((compiled.trace_seconds - traced) * 1e3) if compiled else 0.0,
                    [p.blocks.capacity for p in pools] != before[1],
                    phases,
                )
            )
    finally:
        runner.migrate = migrate
    return out


def one_round(
    engines: dict[str, PagedEngine], order: list[str], steps: int, turn: int, mlx: str = ""
) -> dict[str, list[Step]]:
    """Each engine's ``steps`` steps, the engines taking turns every ``turn`` steps; the
    engine named ``mlx`` with no ``STORERS`` entry."""
    out: dict[str, list[Step]] = {name: [] for name in order}
    storers = list(STORERS)
    for name in order:
        engines[name].clock.reset()
    for start in range(0, steps, turn):
        for name in order:
            STORERS[:] = [] if name == mlx else storers
            try:
                out[name] += timed_steps(engines[name], min(turn, steps - start))
            finally:
                STORERS[:] = storers
    return out


def report(name: str, steps: list[Step], engine: PagedEngine) -> float:
    """Print one engine's round; return its total milliseconds."""
    ms = [s.ms for s in steps]
    p50 = statistics.median(ms)

    def part(label: str, picked: list[Step]) -> str:
        return f"{label} {len(picked)} ({sum(s.ms for s in picked):.1f} ms)"

    migrating = [s for s in steps if s.migrated]
    print(
        f"{name}: mean {statistics.mean(ms):.3f}, p50 {p50:.3f}, total {sum(ms):.1f} ms; "
        f"{part('migrating', migrating)}, migrate {sum(s.migrate_ms for s in migrating):.1f} ms; "
        f"{part('tracing', [s for s in steps if s.traces])}, "
        f"{part('growing', [s for s in steps if s.grew])}",
        flush=True,
    )
    slow = [
        f"{s.ms:.1f} ms (moved {s.migrated}, traces {s.traces} in {s.trace_ms:.1f} ms"
        + (", grew)" if s.grew else ")")
        for s in steps
        if s.ms > 2 * p50
    ]
    n = max(engine.clock.decode_steps, 1)
    phases = {k: round(v / n * 1e3, 3) for k, v in engine.clock.seconds.items() if v}
    print(f"  host ms a step, by phase: {phases}", flush=True)
    if migrating:  # each phase's median over the migrating steps, and over the next ones
        after = [steps[i + 1] for i, s in enumerate(steps[:-1]) if s.migrated]
        for label, picked in (("migrating", migrating), ("after one", after)):
            med = {k: round(statistics.median(s.phases[k] for s in picked), 3) for k in phases}
            print(f"  {label} steps, median host ms by phase: {med}", flush=True)
    print(f"  slower than twice the median: {'; '.join(slow) or 'none'}", flush=True)
    return sum(ms)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="an mlx-lm model directory")
    parser.add_argument("--batch", type=int, nargs="+", default=[14])
    parser.add_argument("--system", type=int, default=2048)
    parser.add_argument("--unique", type=int, default=64)
    parser.add_argument(
        "--stagger", type=int, default=0, help="request i adds i * STAGGER more unique tokens"
    )
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--turn",
        type=int,
        default=0,
        help="within a round the engines take turns every TURN steps (0: the whole round)",
    )
    parser.add_argument("--kv-bits", type=int, choices=[4, 8], default=8)
    parser.add_argument("--kv-group-size", type=int, default=64)
    parser.add_argument("--hot-tokens", type=int, default=64)
    parser.add_argument(
        "--num-blocks", type=int, default=None, help="both engines' full-precision blocks"
    )
    parser.add_argument(
        "--cold-blocks", type=int, default=None, help="the cold engine's quantized blocks"
    )
    parser.add_argument("--fuse-projections", action="store_true")
    parser.add_argument("--few-row-matmuls", action="store_true", help="(CUDA)")
    parser.add_argument(
        "--mlx-migrations",
        action="store_true",
        help="a third engine: the cold tier with migrations in MLX ops, not the kernel",
    )
    args = parser.parse_args()
    # What ready_engine reads: enough tokens left for every round.
    args.tiers, args.fused, args.few_rows, args.writes = args.rounds, 0, 0, 0
    model, _ = load(args.model)
    if args.fuse_projections:
        fuse_projections(model)
    if args.few_row_matmuls:
        few_row_matmuls(model)
    for prompts in workloads(model.args.vocab_size, args):
        b = len(prompts)
        cold = f"{args.kv_bits}-bit cold"
        mlx = f"{cold}, MLX migrations" if args.mlx_migrations else ""
        engines = {
            "full": ready_engine(model, prompts, args, None),
            cold: ready_engine(model, prompts, args, args.kv_bits),
        }
        if mlx:
            STORERS[:], storers = [], list(STORERS)
            engines[mlx] = ready_engine(model, prompts, args, args.kv_bits)
            STORERS[:] = storers
        sums = dict.fromkeys(engines, 0.0)
        colds = [name for name in engines if name != "full"]
        for r in range(args.rounds):  # the first to go alternates
            order = list(engines) if r % 2 == 0 else list(reversed(engines))
            steps = one_round(engines, order, args.steps, args.turn or args.steps, mlx)
            total = {
                name: report(f"round {r} {name} B={b}", steps[name], engines[name])
                for name in order
            }
            for name in colds:
                ratio = total["full"] / total[name]
                print(f"round {r} B={b}: {name} / full tokens/s {ratio:.3f}x", flush=True)
            sums = {name: sums[name] + total[name] for name in sums}
        for name in colds:
            ratio = sums["full"] / sums[name]
            print(f"all rounds B={b}: {name} / full tokens/s {ratio:.3f}x", flush=True)


if __name__ == "__main__":
    main()
