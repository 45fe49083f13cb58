"""Many requests sharing a system prompt: PagedEngine against mlx-lm's BatchGenerator.

Workload W: N requests, each a shared ``--system`` token system prompt plus
``--unique`` tokens of its own, generating ``--gen`` tokens, all arriving at
once. Compared in the same run:

- ``batchgen``: mlx-lm's ``BatchGenerator``, every request prefilled in full;
- ``batchgen+prefix``: ``BatchGenerator`` with the system prompt prefilled once
  and ``copy.deepcopy``'d into each request's cache (what mlx_lm.server does);
- ``paged``: ``PagedEngine``, which adopts the shared blocks by reference.

Time to first token counts from a request's arrival to the moment the engine
hands the token out (``step(on_event=...)``, when ``mlx_paged.server`` streams
it); for the median request it is split into the engine's phases. Cold cases compute the
system prompt inside the clock; ``-warm`` cases start with it cached (a server
that has served it before).

The mixed workload draws prompt lengths from 64 to 4096 and staggers arrivals.
Reports wall time, generated tok/s, time to first token (p50 and max) and peak
memory (``mx.get_peak_memory``, which includes the model's weights).

Usage:
    python benchmarks/engine.py --dtype float16                 # on a GPU
    python benchmarks/engine.py --layers 2 --hidden 256 --n 4 --system 128 --gen 8   # quick look
    python benchmarks/engine.py --dtype float16 --n 64 --mixed 0 --rounds 3 \
        --cases batchgen+prefix paged          # W three times, the cases taking turns
    python benchmarks/engine.py --dtype float16 --n 64 --mixed 0 --first-batch --cases paged
        # a fresh process's first batch (one case per process)
    python benchmarks/engine.py --dtype float16 --n 64 --mixed 0 --cases paged --fuse-projections
        # the paged cases' model with q/k/v and gate/up as one matmul each, as the server runs it
    python benchmarks/engine.py --dtype float16 --shape qwen3_5 --hidden 1536 --layers 24 \
        --vocab 151936 --n 64 --mixed 0 --cases batchgen+prefix-warm paged-warm   # hybrid
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import random
import statistics
import time
from collections.abc import Callable

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.generate import BatchGenerator
from mlx_lm.models import llama
from mlx_lm.models.cache import make_prompt_cache

from mlx_paged import PagedEngine, few_row_matmuls, fuse_projections, rope_in_kernel
from mlx_paged.attention import path_counts
from mlx_paged.attention.kernels import compiled_variants

#: ``--shape qwen3_5``: a Qwen3.5-shaped hybrid of about 1B parameters at the defaults
#: (hidden 1536, 24 layers): three of every four layers GatedDeltaNet, the fourth full
#: attention with 2 KV heads of 256.
QWEN3_5 = dict(
    model_type="qwen3_5",
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=256,
    linear_num_value_heads=16,
    linear_num_key_heads=16,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_conv_kernel_dim=4,
    full_attention_interval=4,
    tie_word_embeddings=True,
    rms_norm_eps=1e-6,
    rope_parameters={"type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
)


def build_model(args, tied: bool = True):
    """A random-weight model of ``args``' shape (``--shape``, llama unless given); a llama's
    head is its embedding unless ``tied`` is false."""
    if getattr(args, "shape", "llama") == "qwen3_5":
        from mlx_lm.models import qwen3_5

        config = dict(
            QWEN3_5,
            hidden_size=args.hidden,
            num_hidden_layers=args.layers,
            intermediate_size=args.hidden * 3,
            vocab_size=args.vocab,
        )
        model = qwen3_5.Model(qwen3_5.ModelArgs.from_dict(config))
        model.set_dtype(getattr(mx, args.dtype))
        mx.eval(model.parameters())
        return model
    heads = max(1, args.hidden // 64)
    model = llama.Model(
        llama.ModelArgs(
            model_type="llama",
            hidden_size=args.hidden,
            num_hidden_layers=args.layers,
            intermediate_size=args.hidden * 4,
            num_attention_heads=heads,
            num_key_value_heads=max(1, heads // 4),
            rms_norm_eps=1e-5,
            vocab_size=args.vocab,
            rope_theta=500000.0,
            tie_word_embeddings=tied,
        )
    )
    model.set_dtype(getattr(mx, args.dtype))
    mx.eval(model.parameters())
    return model


class Recorder:
    """First-token times and token counts per request."""

    def __init__(self):
        self.start = time.perf_counter()
        self.arrival: dict[int, float] = {}
        self.first: dict[int, float] = {}
        self.tokens = 0

    def arrived(self, uid: int, at: float) -> None:
        """``uid`` was due ``at`` seconds after the start (TTFT counts from then)."""
        self.arrival[uid] = self.start + at

    def token(self, uid: int) -> None:
        self.tokens += 1
        self.first.setdefault(uid, time.perf_counter())

    def result(self, name: str) -> dict:
        wall = time.perf_counter() - self.start
        ttft = sorted(self.first[u] - self.arrival[u] for u in self.first)
        return dict(
            case=name,
            wall_s=wall,
            tok_s=self.tokens / wall,
            ttft_p50_s=statistics.median(ttft),
            ttft_max_s=ttft[-1],
            peak_gb=mx.get_peak_memory() / 1e9,
            requests=len(self.first),
        )


class Timeline:
    """The engine's phases (the runner's calls) with their times, to split a request's
    time to first token into where it went.

    The prefill calls evaluate their forwards themselves. A decode call only builds its
    step's graph, which the device runs while the host goes on (the overlapped decode), so
    its span is the graph build; the timeline evaluates nothing itself, which would make
    every decode step wait for the device and leave the engine's overlap out of the clock.
    """

    PHASES = {
        "prefill": "prefill alone",
        "forward": "prefill batched",
        "decode": "decode build",
        "sample": "sample",
    }

    def __init__(self, engine: PagedEngine):
        self.spans: list[tuple[str, float, float]] = []
        for name, label in self.PHASES.items():
            inner = getattr(engine.runner, name)

            def timed(*args, inner=inner, label=label, **kwargs):
                start = time.perf_counter()
                out = inner(*args, **kwargs)
                self.spans.append((label, start, time.perf_counter()))
                return out

            setattr(engine.runner, name, timed)

    def between(self, t0: float, t1: float) -> dict[str, float]:
        """Seconds of each phase inside ``[t0, t1]``; ``other`` is the rest (host work
        between the runner's calls: admission, scheduling, events)."""
        out = dict.fromkeys(self.PHASES.values(), 0.0)
        for label, a, b in self.spans:
            out[label] += max(0.0, min(b, t1) - max(a, t0))
        out["other"] = (t1 - t0) - sum(out.values())
        return out


def prefill_prefix(model, prefix: list[int], step: int) -> list:
    cache = make_prompt_cache(model)
    for i in range(0, len(prefix), step):
        model(mx.array(prefix[i : i + step])[None], cache=cache)
        mx.eval([c.state for c in cache])
    return cache


def run_batchgen(
    model, prompts, arrivals, gen, step, prefix=None, batch=64, warm=False
) -> Recorder:
    """BatchGenerator; with ``prefix``, each request starts from a deepcopy of its cache.

    ``warm``: the prefix cache exists before the clock starts (a server that
    has seen the system prompt); otherwise its prefill counts.
    """
    base = prefill_prefix(model, prefix, step) if prefix and warm else None
    rec = Recorder()
    bg = BatchGenerator(
        model,
        max_tokens=gen,
        completion_batch_size=batch,
        prefill_batch_size=min(batch, 8),
        prefill_step_size=step,
    )
    if prefix and not warm:
        base = prefill_prefix(model, prefix, step)
    pending = list(range(len(prompts)))
    done = 0
    while done < len(prompts):
        now = time.perf_counter() - rec.start
        ready = [i for i in pending if arrivals[i] <= now]
        if ready:
            pending = [i for i in pending if arrivals[i] > now]
            suffixes = [prompts[i][len(prefix) :] if prefix else prompts[i] for i in ready]
            caches = [copy.deepcopy(base) for _ in ready] if prefix else None
            uids = bg.insert(suffixes, [gen] * len(ready), caches=caches)
            for uid, i in zip(uids, ready, strict=True):
                rec.arrived(uid, arrivals[i])
        if not (bg._unprocessed_sequences or bg._prompt_batch.uids or bg._generation_batch.uids):
            time.sleep(0.001)
            continue
        for r in bg.next_generated():
            rec.token(r.uid)
            done += r.finish_reason is not None
    bg.close()
    return rec


def run_paged(model, prompts, arrivals, gen, args, prefix=None) -> tuple[Recorder, dict]:
    """PagedEngine; with ``prefix``, one request with it runs before the clock starts."""
    engine = PagedEngine(
        model,
        block_size=args.block_size,
        max_batch_size=args.batch,
        prefill_step_size=args.prefill_step_size,
        prefill_budget=args.prefill_budget,
        state_snapshot_interval=args.state_snapshot_interval,
    )
    if prefix:
        engine.generate([prefix], max_tokens=1)
        if args.memory_trace:
            print(f"  prefix request: peak {mx.get_peak_memory() / 1e9:6.2f} GB", flush=True)
            mx.reset_peak_memory()
    rec = Recorder()
    timeline = Timeline(engine)
    pending = list(range(len(prompts)))
    done = 0

    def heard(e) -> None:  # when the engine hands a token out (a server streams it then)
        nonlocal done
        rec.token(e.uid)
        done += e.finish_reason is not None

    while done < len(prompts):
        now = time.perf_counter() - rec.start
        for i in [i for i in pending if arrivals[i] <= now]:
            rec.arrived(engine.add_request(prompts[i], gen), arrivals[i])
        pending = [i for i in pending if arrivals[i] > now]
        if not (engine.waiting or engine.running):
            time.sleep(0.001)
            continue
        engine.step(on_event=heard)
        if args.memory_trace:
            gb = [mx.get_active_memory(), mx.get_peak_memory(), engine.stats().bytes]
            print(
                f"  t={time.perf_counter() - rec.start:6.3f} s, {len(rec.first):3d} started: "
                f"active {gb[0] / 1e9:6.2f} GB, "
                f"peak {gb[1] / 1e9:6.2f} GB, pool {gb[2] / 1e9:5.2f} GB",
                flush=True,
            )
    # Where the median request's time to first token went.
    uid = sorted(rec.first, key=lambda u: rec.first[u] - rec.arrival[u])[len(rec.first) // 2]
    parts = timeline.between(rec.arrival[uid], rec.first[uid])
    return rec, dict(engine.stats().__dict__, ttft_p50_parts_s=parts)


def measure(name: str, fn: Callable, results: list) -> None:
    gc.collect()
    mx.clear_cache()
    mx.reset_peak_memory()
    out = fn()
    rec, extra = out if isinstance(out, tuple) else (out, {})
    r = rec.result(name)
    keep = ("prefix_hit_tokens", "prefilled_tokens", "ttft_p50_parts_s")
    r.update({k: extra[k] for k in keep if k in extra})
    results.append(r)
    print(
        f"{r['case']:28s} wall {r['wall_s']:7.2f} s  {r['tok_s']:8.1f} tok/s  "
        f"TTFT p50 {r['ttft_p50_s']:6.3f} s max {r['ttft_max_s']:6.3f} s  "
        f"peak {r['peak_gb']:6.2f} GB",
        flush=True,
    )
    if "ttft_p50_parts_s" in r:
        parts = ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in r["ttft_p50_parts_s"].items())
        print(f"{'':28s} TTFT p50 request: {parts}", flush=True)


def summarize(n: int, rounds: list[tuple[str, dict]]) -> None:
    """Each case's median over W's rounds, and the paged cases' ratio to the median
    ``BatchGenerator`` + copied prefix of the same warmth (where both ran)."""
    by_case: dict[str, list[dict]] = {}
    for name, r in rounds:
        by_case.setdefault(name, []).append(r)
    tok_s = {k: statistics.median(r["tok_s"] for r in rs) for k, rs in by_case.items()}
    for name, rs in by_case.items():
        base = "batchgen+prefix-warm" if name.endswith("-warm") else "batchgen+prefix"
        ratio = ""
        if name != base and base in tok_s:
            ratio = f" ({tok_s[name] / tok_s[base]:.2f}x {base})"
        spread = f"{min(r['tok_s'] for r in rs):.1f}-{max(r['tok_s'] for r in rs):.1f}"
        ttft = statistics.median(r["ttft_p50_s"] for r in rs)
        print(
            f"W N={n} {name} median of {len(rs)}: {tok_s[name]:8.1f} tok/s{ratio}, "
            f"range {spread}; TTFT p50 {ttft:.3f} s",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    parser.add_argument(
        "--shape",
        default="llama",
        choices=["llama", "qwen3_5"],
        help="llama, or a Qwen3.5-shaped hybrid (GatedDeltaNet + attention)",
    )
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--n", type=int, nargs="+", default=[32, 64])
    parser.add_argument("--system", type=int, default=2048)
    parser.add_argument("--unique", type=int, default=64)
    parser.add_argument("--gen", type=int, default=128)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument(
        "--prefill-step-size",
        type=int,
        default=2048,
        help="for both systems (their default: PagedEngine's and BatchGenerator's)",
    )
    parser.add_argument(
        "--prefill-budget", type=int, default=None, help="the engine's prompt tokens per step"
    )
    parser.add_argument(
        "--state-snapshot-interval", type=int, default=None, help="hybrid models (engine default)"
    )
    parser.add_argument(
        "--rounds", type=int, default=1, help="run W's cases this many times, in turn"
    )
    parser.add_argument("--mixed", type=int, default=32, help="requests in the mixed run (0: skip)")
    parser.add_argument("--mixed-max", type=int, default=4096)
    parser.add_argument("--mixed-gap", type=float, default=0.05, help="seconds between arrivals")
    parser.add_argument(
        "--cases",
        nargs="+",
        default=["batchgen", "batchgen+prefix", "paged", "batchgen+prefix-warm", "paged-warm"],
    )
    parser.add_argument(
        "--memory-trace", action="store_true", help="print memory after every engine step"
    )
    parser.add_argument(
        "--first-batch",
        action="store_true",
        help="skip the warm-up, so the first case times a fresh process's first batch "
        "(kernel compiles and self-checks included); run one case per process",
    )
    parser.add_argument("--json", help="write the results here")
    parser.add_argument(
        "--fuse-projections",
        action="store_true",
        help="the paged cases' model with q/k/v and gate/up as one matmul each, as "
        "mlx_paged.server runs it (mlx-lm's cases keep the model as loaded)",
    )
    parser.add_argument(
        "--few-row-matmuls",
        action="store_true",
        help="the paged cases' linear layers take 2-48 rows in the few-row kernel (CUDA), "
        "as mlx_paged.server runs them",
    )
    parser.add_argument(
        "--rope-in-kernel",
        action="store_true",
        help="the paged cases' decode kernel applies the layers' RoPE (CUDA), as "
        "mlx_paged.server runs it",
    )
    args = parser.parse_args()

    model = paged_model = build_model(args)
    if args.fuse_projections or args.few_row_matmuls or args.rope_in_kernel:
        paged_model = build_model(args)
        paged_model.update(model.parameters())  # the same weights, then fused or routed
    if args.fuse_projections:
        print(f"fused {fuse_projections(paged_model)} projection groups of the paged cases' model")
    if args.few_row_matmuls:
        routed = few_row_matmuls(paged_model)
        print(f"{routed} layers of the paged cases' model take few rows in a kernel")
    if args.rope_in_kernel:
        rotated = rope_in_kernel(paged_model)
        print(f"{rotated} layers of the paged cases' model leave RoPE to the kernel")
    weights_gb = sum(v.nbytes for _, v in tree_flatten(model.parameters())) / 1e9
    print(
        f"device={mx.default_device()} shape={args.shape} dtype={args.dtype} layers={args.layers} "
        f"hidden={args.hidden} weights={weights_gb:.2f} GB block_size={args.block_size}",
        flush=True,
    )
    rng = random.Random(0)
    step = args.prefill_step_size

    def toks(n: int) -> list[int]:
        return [rng.randrange(args.vocab) for _ in range(n)]

    if not args.first_batch:
        # Warm up (kernel compilation, per-shape plans) on the largest W run of each path.
        n = max(args.n)
        warm_system = toks(args.system)
        warm = [warm_system + toks(args.unique) for _ in range(n)]
        run_batchgen(model, warm, [0.0] * n, args.gen, step, prefix=warm_system, batch=n)
        run_paged(paged_model, warm, [0.0] * n, args.gen, args)

    results: list[dict] = []
    system = toks(args.system)
    for n in args.n:
        prompts = [system + toks(args.unique) for _ in range(n)]
        at = [0.0] * n
        cases = {
            "batchgen": lambda p=prompts, a=at, n=n: run_batchgen(
                model, p, a, args.gen, step, batch=n
            ),
            "batchgen+prefix": lambda p=prompts, a=at, n=n: run_batchgen(
                model, p, a, args.gen, step, prefix=system, batch=n
            ),
            "paged": lambda p=prompts, a=at: run_paged(paged_model, p, a, args.gen, args),
            "batchgen+prefix-warm": lambda p=prompts, a=at, n=n: run_batchgen(
                model, p, a, args.gen, step, prefix=system, batch=n, warm=True
            ),
            "paged-warm": lambda p=prompts, a=at: run_paged(
                paged_model, p, a, args.gen, args, prefix=system
            ),
        }
        rounds = []
        for r in range(args.rounds):
            label = f" #{r + 1}" if args.rounds > 1 else ""
            for name in args.cases:
                measure(f"W N={n} {name}{label}", cases[name], results)
                rounds.append((name, results[-1]))
        if args.rounds > 1:
            summarize(n, rounds)

    if args.mixed:
        prompts = [toks(rng.randrange(64, args.mixed_max + 1)) for _ in range(args.mixed)]
        at = [i * args.mixed_gap for i in range(args.mixed)]
        for name in args.cases:
            if name not in ("batchgen", "paged"):
                continue  # no shared prefix in this workload
            fn = (
                (lambda: run_paged(paged_model, prompts, at, args.gen, args))
                if name == "paged"
                else (lambda: run_batchgen(model, prompts, at, args.gen, step, batch=args.batch))
            )
            measure(f"mixed N={args.mixed} {name}", fn, results)

    print(f"attention calls by path: {dict(path_counts)}")
    print(f"compiled kernel variants: {compiled_variants()}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(weights_gb=weights_gb, results=results), f, indent=1)


if __name__ == "__main__":
    main()
