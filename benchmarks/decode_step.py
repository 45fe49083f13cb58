"""Workload W's decode step at batch B: the engine's host phases against a dense batch.

B requests share a ``--system``-token prompt and add ``--unique`` tokens each (request i
``--stagger`` times i more, so that their lengths differ).
``paged``: once every request has its first token, ``--steps`` engine steps
(overlapped, compiled: as the server runs them), with the step's wall time
(p10, p50, p90) and the engine's host phases per step (``StepClock``: ``build``
is the step's graph, ``dispatch`` the picks and ``mx.async_eval``, ``wait`` the
previous step's read). ``dense``: mlx-lm's ``KVCache`` of the same prompts
merged into one ``BatchKVCache``, one synchronous step at a time (argmax read
each step). ``--graph`` prints the primitives of one step's graph by kind
instead of timing; ``--kv-bits`` gives the paged engine a quantized cold tier
behind ``--hot-tokens``. ``--profile`` brackets three timed steps with
``cuProfilerStart``/``Stop``, for ``ncu --profile-from-start off``.
``--tiers ROUNDS`` (with ``--kv-bits``) times the full-precision and the
cold-tier engines in one process, taking turns, and prints the ratio of their
tokens/s per round: the lent host changes speed between and within processes.
``--functions`` also prints the host time a step of the engine's own functions that run
per request (scheduling, the step's tables and arrays, the picks' read, the events) and of
the compiled step's call, which includes the tables and arrays.
``--fuse-projections`` runs both cases on the model with its q/k/v and gate/up
projections fused (``mlx_paged.fuse_projections``): fewer matmuls a layer; ``--fused ROUNDS``
times engines on the model as loaded and on a fused copy in one process, taking turns.
``--few-row-matmuls`` routes the model's linear layers through the few-row kernel
(``mlx_paged.few_row_matmuls``, CUDA); ``--few-rows ROUNDS`` times engines on the model and on
a routed copy (both fused with ``--fuse-projections``) in one process, taking turns.
``--writes ROUNDS`` times an engine whose steps write their K/V with a scatter a layer before
the decode kernel and one whose kernel stores them (``PagedView.new_keys``, CUDA), taking turns.
``--rope ROUNDS`` times engines on the model and on a copy whose layers leave their RoPE to the
decode kernel (``mlx_paged.rope_in_kernel``, CUDA; both as the other flags make them), taking
turns; ``--rope-in-kernel`` makes that change to the model itself (as the server does).

Usage:
    python benchmarks/decode_step.py --model /root/l1b --batch 64 32 --cases paged dense
    python benchmarks/decode_step.py --model /root/l1b --batch 64 --cases paged --graph
    python benchmarks/decode_step.py --model /root/l1b --batch 64 1 --cases paged --functions
    python benchmarks/decode_step.py --model /root/l1b --batch 1 --cases paged --kv-bits 8
    python benchmarks/decode_step.py --model /root/l1b --batch 1 14 --cases paged --kv-bits 8 \\
        --tiers 8 --steps 200
    python benchmarks/decode_step.py --model /root/l1b --batch 1 8 64 --cases paged --writes 6
    python benchmarks/decode_step.py --model /root/l1b --batch 1 14 --cases paged --rope 6 \
        --fuse-projections --few-row-matmuls
    ncu --clock-control none --profile-from-start off --metrics gpu__time_duration.sum \\
        python benchmarks/decode_step.py --model /root/l1b --batch 64 --cases paged --profile
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import copy
import ctypes
import io
import random
import re
import statistics
import time
from collections.abc import Callable, Iterator

import mlx.core as mx
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache

from mlx_paged import PagedEngine, few_row_matmuls, fuse_projections, rope_in_kernel
from mlx_paged.attention import routing
from mlx_paged.attention.kernels import dispatch
from mlx_paged.attention.kernels.plan import kernel_templates
from mlx_paged.cache import DecodeBatch
from mlx_paged.engine import compiled, decode, picks, scheduler

#: ``--functions``: what is timed, as (owner, attribute, label).
FUNCTIONS = (
    (scheduler.Scheduler, "schedule_decode", "schedule_decode"),
    (DecodeBatch, "__init__", "DecodeBatch"),
    (DecodeBatch, "arrays", "arrays"),
    (compiled.CompiledDecode, "__call__", "compiled call"),
    (decode, "pick", "pick"),
    (picks.Picks, "read", "picks read"),
    (decode, "emit", "emit"),
)


def profiler(on: bool) -> None:
    """Start or stop the CUDA profiler's range (for ncu), the device synchronized."""
    mx.synchronize()
    lib = ctypes.CDLL("libcuda.so.1")
    (lib.cuProfilerStart if on else lib.cuProfilerStop)()


def graph_counts(arr: mx.array) -> collections.Counter[str]:
    """The primitives of ``arr``'s graph, by kind."""
    out = io.StringIO()
    mx.export_to_dot(out, arr)
    return collections.Counter(re.findall(r'label ="([A-Za-z_0-9]+)', out.getvalue()))


@contextlib.contextmanager
def timed_functions():
    """Seconds spent in each of ``FUNCTIONS`` while the block runs, by label."""
    seconds: collections.Counter[str] = collections.Counter()
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in FUNCTIONS]

    def timed(fn, label):
        def call(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                seconds[label] += time.perf_counter() - start

        return call

    for (owner, name, fn), (_, _, label) in zip(saved, FUNCTIONS, strict=True):
        setattr(owner, name, timed(fn, label))
    try:
        yield seconds
    finally:
        for owner, name, fn in saved:
            setattr(owner, name, fn)


def timed_steps(step, n: int, profile: bool) -> list[float]:
    times = []
    if profile:
        profiler(True)
    for _ in range(3 if profile else n):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    if profile:
        profiler(False)
    return times


def spread(times: list[float]) -> str:
    q = statistics.quantiles(times, n=10) if len(times) > 1 else times * 9
    return (
        f"p10 {q[0] * 1e3:.2f}, p50 {statistics.median(times) * 1e3:.2f}, p90 {q[-1] * 1e3:.2f} ms"
    )


def workloads(vocab: int, args) -> Iterator[list[list[int]]]:
    """Each ``--batch`` size's prompts: the ``--system`` tokens they share, then ``--unique``
    tokens each (request i ``--stagger`` times i more)."""
    rng = random.Random(0)
    system = [rng.randrange(vocab) for _ in range(args.system)]
    for b in args.batch:
        unique = [args.unique + i * args.stagger for i in range(b)]
        yield [system + [rng.randrange(vocab) for _ in range(n)] for n in unique]


def ready_engine(model, prompts: list[list[int]], args, kv_bits: int | None) -> PagedEngine:
    """A ``PagedEngine`` whose requests all decode (their step's shapes traced), with enough
    tokens left for every timed step."""
    tier = {}
    if kv_bits:
        tier = dict(kv_bits=kv_bits, kv_group_size=args.kv_group_size, hot_tokens=args.hot_tokens)
        tier["cold_blocks"] = getattr(args, "cold_blocks", None)
    engine = PagedEngine(
        model,
        max_batch_size=len(prompts),
        prefill_step_size=2048,
        num_blocks=getattr(args, "num_blocks", None),
        **tier,
    )
    engine.generate([prompts[0]], max_tokens=1)  # caches the shared prompt
    for p in prompts:
        rounds = max(args.tiers, args.fused, args.few_rows, args.writes, args.rope, 1)
        engine.add_request(p, args.steps * rounds + 40)
    while engine.waiting or any(not r.generated for r in engine.running):
        engine.step()
    for _ in range(10):  # the step's shapes traced
        engine.step()
    return engine


def paged(model, prompts: list[list[int]], args) -> None:
    b = len(prompts)
    if args.tiers:
        tiers(model, prompts, args)
        return
    if args.fused or args.few_rows or args.rope:
        fusion(model, args.fused_model, prompts, args)
        return
    if args.writes:
        writes(model, prompts, args)
        return
    engine = ready_engine(model, prompts, args, args.kv_bits)
    if args.graph:
        decode = engine.runner.decode

        def spy(reqs, tokens=None):
            logits = decode(reqs, tokens)
            counts = graph_counts(logits)
            print(f"paged B={b}: {sum(counts.values())} primitives: {dict(counts.most_common())}")
            return logits

        engine.runner.decode = spy
        engine.step()
        return
    mx.synchronize()
    engine.clock.reset()
    with timed_functions() if args.functions else contextlib.nullcontext() as seconds:
        times = timed_steps(engine.step, args.steps, args.profile)
    steps = engine.clock.decode_steps
    phases = {k: round(v / steps * 1e3, 2) for k, v in engine.clock.seconds.items() if v}
    print(f"paged B={b}: step {spread(times)}; host ms/step {phases}", flush=True)
    if seconds is not None:
        each = {k: round(v / steps * 1e3, 3) for k, v in seconds.items()}
        print(f"paged B={b}: functions, host ms/step {each}", flush=True)


def tiers(model, prompts: list[list[int]], args) -> None:
    """The full-precision engine and the ``--kv-bits`` one in one process, taking turns."""
    engines = [ready_engine(model, prompts, args, bits) for bits in (None, args.kv_bits)]
    turns(["full", f"{args.kv_bits}-bit cold"], engines, args.tiers, args, "tiers")


def fusion(model, fused_model, prompts: list[list[int]], args) -> None:
    """An engine on the model and one on its fused (or routed) copy, taking turns."""
    engines = [ready_engine(m, prompts, args, args.kv_bits) for m in (model, fused_model)]
    if args.few_rows:
        turns(["cuBLAS", "few-row kernel"], engines, args.few_rows, args, "few-rows")
    elif args.rope:
        turns(["layers rotate", "kernel rotates"], engines, args.rope, args, "rope")
    else:
        turns(["as loaded", "fused"], engines, args.fused, args, "fused")


def kernel_writes(on: bool) -> None:
    """Let the CUDA decode kernel store the step's K/V (the default), or not: the caches then
    write them with a scatter first. Decided where a step's graph is traced."""
    dispatch.cuda_paged_decode.writes = on
    routing._ready.clear()  # the cached answer of ``kernels_write``


def writes(model, prompts: list[list[int]], args) -> None:
    """An engine whose steps scatter their K/V and one whose kernel stores them, taking turns."""
    engines = []
    for on in (False, True):
        kernel_writes(on)
        engines.append(ready_engine(model, prompts, args, args.kv_bits))
    stores = sum(("FW", True) in t for t in kernel_templates)
    print(f"writes B={len(prompts)}: {stores} decode kernel builds store rows", flush=True)
    setup = lambda i: kernel_writes(i == 1)  # noqa: E731
    turns(["scatter", "kernel stores"], engines, args.writes, args, "writes", setup)


def turns(
    names: list[str],
    engines: list[PagedEngine],
    rounds: int,
    args,
    tag: str,
    setup: Callable[[int], None] | None = None,
) -> None:
    """Two engines in one process, taking turns for ``rounds`` rounds of ``--steps`` steps
    (the first to go alternates), so that each round's pair meets the same host speed; the
    ratio is the second's tokens/s over the first's. ``setup(i)`` runs before engine ``i``'s
    turn."""
    b = len(engines[0].running)
    p50s: list[list[float]] = [[], []]
    phases: list[list[dict[str, float]]] = [[], []]  # per round: host ms a step, by phase
    for r in range(rounds):
        for i in (0, 1) if r % 2 == 0 else (1, 0):
            engine = engines[i]
            if setup is not None:
                setup(i)
            mx.synchronize()
            engine.clock.reset()
            p50s[i].append(statistics.median(timed_steps(engine.step, args.steps, False)))
            n = engine.clock.decode_steps
            phases[i].append({k: v / n * 1e3 for k, v in engine.clock.seconds.items()})
        first, second = p50s[0][-1], p50s[1][-1]
        print(
            f"{tag} B={b} round {r + 1}: step p50 {names[0]} {first * 1e3:.2f} ms, "
            f"{names[1]} {second * 1e3:.2f} ms, {names[1]}/{names[0]} tok/s "
            f"{first / second:.2f}x",
            flush=True,
        )
    ratios = sorted(f / c for f, c in zip(*p50s, strict=True))
    print(
        f"{tag} B={b}: {names[1]}/{names[0]} tok/s median {statistics.median(ratios):.2f}x "
        f"(range {ratios[0]:.2f}x-{ratios[-1]:.2f}x over {rounds} rounds)",
        flush=True,
    )
    for name, rounds_, engine in zip(names, phases, engines, strict=True):
        medians = {k: round(statistics.median(r[k] for r in rounds_), 2) for k in rounds_[0]}
        compiled = engine.runner.compiled
        traces = f"; {compiled.traces} traces" if compiled is not None else ""
        print(f"{tag} B={b} {name}: host ms/step, median of rounds {medians}{traces}", flush=True)


def dense(model, prompts: list[list[int]], args) -> None:
    b = len(prompts)
    shared = make_prompt_cache(model)
    model(mx.array(prompts[0][: args.system])[None], cache=shared)
    mx.eval([c.state for c in shared])
    caches = []
    for p in prompts:  # the shared prompt copied, then each request's own tokens
        c = copy.deepcopy(shared)
        mx.eval(model(mx.array(p[args.system :])[None], cache=c))
        caches.append(c)
    batch = [type(layer[0]).merge(list(layer)) for layer in zip(*caches, strict=True)]
    y = mx.array([[p[-1]] for p in prompts])

    def step() -> None:
        nonlocal y
        y = mx.argmax(model(y, cache=batch)[:, -1, :], axis=-1)[:, None]
        y.tolist()

    if args.graph:
        counts = graph_counts(model(y, cache=batch)[:, -1, :])
        print(f"dense B={b}: {sum(counts.values())} primitives: {dict(counts.most_common())}")
        return
    for _ in range(5):
        step()
    print(f"dense B={b}: step {spread(timed_steps(step, args.steps, args.profile))} (synchronous)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="an mlx-lm model directory")
    parser.add_argument("--batch", type=int, nargs="+", default=[64])
    parser.add_argument(
        "--cases", nargs="+", default=["paged", "dense"], choices=["paged", "dense"]
    )
    parser.add_argument("--system", type=int, default=2048)
    parser.add_argument("--unique", type=int, default=64)
    parser.add_argument(
        "--stagger", type=int, default=0, help="request i adds i * STAGGER more unique tokens"
    )
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--graph", action="store_true", help="count one step's primitives")
    parser.add_argument("--kv-bits", type=int, choices=[4, 8], help="paged: a quantized cold tier")
    parser.add_argument("--kv-group-size", type=int, default=64, help="with --kv-bits")
    parser.add_argument("--hot-tokens", type=int, default=64, help="with --kv-bits")
    parser.add_argument("--profile", action="store_true", help="three steps in a profiler range")
    parser.add_argument(
        "--functions", action="store_true", help="paged: the host time of the engine's functions"
    )
    parser.add_argument(
        "--tiers",
        type=int,
        default=0,
        metavar="ROUNDS",
        help="paged, with --kv-bits: the full-precision and cold-tier engines in one process, "
        "taking turns for ROUNDS rounds of --steps steps",
    )
    parser.add_argument(
        "--fuse-projections", action="store_true", help="q/k/v and gate/up as one matmul each"
    )
    parser.add_argument(
        "--fused",
        type=int,
        default=0,
        metavar="ROUNDS",
        help="paged: engines on the model as loaded and on a fused copy in one process, "
        "taking turns for ROUNDS rounds of --steps steps",
    )
    parser.add_argument(
        "--few-row-matmuls", action="store_true", help="2-48 rows in the few-row kernel (CUDA)"
    )
    parser.add_argument(
        "--few-rows",
        type=int,
        default=0,
        metavar="ROUNDS",
        help="paged: engines on the model and on a copy with --few-row-matmuls in one "
        "process, taking turns for ROUNDS rounds of --steps steps",
    )
    parser.add_argument(
        "--writes",
        type=int,
        default=0,
        metavar="ROUNDS",
        help="paged: engines that scatter each step's K/V and whose kernel stores them, in one "
        "process, taking turns for ROUNDS rounds of --steps steps",
    )
    parser.add_argument(
        "--rope",
        type=int,
        default=0,
        metavar="ROUNDS",
        help="paged: engines on the model and on a copy whose layers leave their RoPE to the "
        "decode kernel, in one process, taking turns for ROUNDS rounds of --steps steps",
    )
    parser.add_argument(
        "--rope-in-kernel", action="store_true", help="the decode kernel applies RoPE (CUDA)"
    )
    args = parser.parse_args()
    if args.tiers and not args.kv_bits:
        parser.error("--tiers needs --kv-bits")
    if sum(map(bool, (args.tiers, args.fused, args.few_rows, args.writes, args.rope))) > 1:
        parser.error(
            "--tiers, --fused, --few-rows, --writes and --rope each take turns of their own: "
            "one at a time"
        )
    model, _ = load(args.model)
    if args.fused:
        args.fused_model, _ = load(args.model)
        print(f"fused {fuse_projections(args.fused_model)} projection groups of the copy")
    if args.few_rows:
        args.fused_model, _ = load(args.model)
        if args.fuse_projections:
            fuse_projections(args.fused_model)
        print(f"{few_row_matmuls(args.fused_model)} layers of the copy take few rows in a kernel")
    if args.rope:
        args.fused_model, _ = load(args.model)
        if args.fuse_projections:
            fuse_projections(args.fused_model)
        if args.few_row_matmuls:
            few_row_matmuls(args.fused_model)
        print(f"{rope_in_kernel(args.fused_model)} layers of the copy leave RoPE to the kernel")
    if args.fuse_projections:
        print(f"fused {fuse_projections(model)} projection groups")
    if args.few_row_matmuls:
        print(f"{few_row_matmuls(model)} layers take few rows in a kernel")
    if args.rope_in_kernel:
        print(f"{rope_in_kernel(model)} layers leave RoPE to the kernel")
    for prompts in workloads(model.args.vocab_size, args):
        for case in args.cases:
            {"paged": paged, "dense": dense}[case](model, prompts, args)


if __name__ == "__main__":
    main()
