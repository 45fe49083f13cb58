"""A decode step's matmuls one weight shape at a time: MLX's (cuBLAS) against the few-row
kernel, at a few row counts, each launch timed on the GPU by ``ncu``.

The shapes are those of a fused llama-style step (``q|k|v``, ``o``, ``gate|up``, ``down``
once a layer, and the head), with random float16 or bfloat16 weights. Under ``ncu``, each case
(rows, shape, implementation) is one marker kernel and then ``--repeats`` launches, each
evaluated on its own; ``--cases`` records the cases in order. ``--report`` reads ``ncu``'s CSV
and the cases back and prints each shape's mean kernel time and a step's sum (every layer
shape times the layers, plus the head). ``ncu`` flushes the caches between kernels, as a
step's weights would be cold.

Usage:
    ncu --clock-control none --profile-from-start off --metrics gpu__time_duration.sum \\
        --csv --page raw --log-file /tmp/mm.csv \\
        python benchmarks/matmul_shapes.py --rows 16 32 48 --cases /tmp/mm.cases
    python benchmarks/matmul_shapes.py --report /tmp/mm.csv --cases /tmp/mm.cases
"""

from __future__ import annotations

import argparse
import csv
import ctypes
import json
from collections import defaultdict

import mlx.core as mx

from mlx_paged.attention.kernels import rows

IMPLS = ("mlx", "few-row kernel")


def shapes(args: argparse.Namespace) -> dict[str, tuple[int, int, int]]:
    """``name: (N, K, count in a step)`` of a fused llama-style step's weights."""
    h, q, kv = args.hidden, args.q_heads * args.head_dim, args.kv_heads * args.head_dim
    return {
        "q|k|v": (q + 2 * kv, h, args.layers),
        "o": (h, q, args.layers),
        "gate|up": (2 * args.intermediate, h, args.layers),
        "down": (h, args.intermediate, args.layers),
        "head": (args.vocab, h, 1),
    }


def run(args: argparse.Namespace) -> None:
    if not rows.available():
        raise SystemExit("matmul_shapes.py times the few-row kernel: it needs a CUDA GPU.")
    dtype = getattr(mx, args.dtype)
    mark = mx.fast.cuda_kernel("mark", ["a"], ["o"], "o[0] = a[0];")
    seed = mx.zeros((1,))

    def marker() -> None:
        launch = dict(grid=(32, 1, 1), threadgroup=(32, 1, 1), output_shapes=[(1,)])
        mx.eval(mark(inputs=[seed], output_dtypes=[mx.float32], **launch)[0])

    weights = {
        name: (mx.random.normal((n, k)) * 0.02).astype(dtype)
        for name, (n, k, _) in shapes(args).items()
    }
    cases, calls = [], []
    for m in args.rows:
        for name, w in weights.items():
            x = mx.random.normal((m, w.shape[1])).astype(dtype)
            for impl in IMPLS:
                call = (
                    (lambda x=x, w=w: x @ w.T)
                    if impl == "mlx"
                    else (lambda x=x, w=w: rows.few_rows_matmul(x, w))
                )
                mx.eval(call())  # built, and its inputs made, before the profiled range
                cases.append({"rows": m, "shape": name, "impl": impl})
                calls.append(call)
    marker()
    mx.synchronize()
    cuda = ctypes.CDLL("libcuda.so.1")
    cuda.cuProfilerStart()
    for call in calls:
        marker()
        for _ in range(args.repeats):
            mx.eval(call())
    mx.synchronize()
    cuda.cuProfilerStop()
    with open(args.cases, "w") as f:
        json.dump({"shapes": shapes(args), "repeats": args.repeats, "cases": cases}, f)
    print(f"{len(cases)} cases written to {args.cases}")


def report(args: argparse.Namespace) -> None:
    with open(args.cases) as f:
        meta = json.load(f)
    with open(args.report) as f:
        table = [r for r in csv.reader(f) if len(r) > 1]
    header = next(r for r in table if "Kernel Name" in r)
    name, value = header.index("Kernel Name"), header.index("gpu__time_duration.sum")
    groups: list[list[float]] | None = None
    for r in table[table.index(header) + 1 :]:
        if len(r) != len(header) or not r[value].replace(",", "").replace(".", "").isdigit():
            continue
        if "mark" in r[name]:
            groups = [] if groups is None else groups
            groups.append([])
        elif groups is not None:
            groups[-1].append(float(r[value].replace(",", "")))
    if groups is None or len(groups) != len(meta["cases"]):
        raise SystemExit(
            f"found {len(groups or [])} cases in {args.report}, expected "
            f"{len(meta['cases'])}: not the same run?"
        )
    us = {}
    for case, kernels in zip(meta["cases"], groups, strict=True):
        us[case["rows"], case["shape"], case["impl"]] = sum(kernels) / meta["repeats"] / 1e3
    steps: dict[tuple[int, str], float] = defaultdict(float)
    for m in sorted({c["rows"] for c in meta["cases"]}):
        print(f"rows {m}: µs a matmul, {' / '.join(IMPLS)}")
        for shape, (n, k, count) in meta["shapes"].items():
            times = [us[m, shape, impl] for impl in IMPLS]
            for impl, t in zip(IMPLS, times, strict=True):
                steps[m, impl] += t * count
            print(
                f"  {shape:8s} {n:6d}x{k:<6d} {times[0]:8.1f} / {times[1]:8.1f}"
                f"  ({times[1] / times[0]:.2f}x)"
            )
        total = [steps[m, impl] for impl in IMPLS]
        print(
            f"  a step's {sum(c for *_, c in meta['shapes'].values())} matmuls: "
            f"{total[0]:.0f} / {total[1]:.0f} µs ({total[1] / total[0]:.2f}x)"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[16, 32, 48])
    parser.add_argument("--cases", required=True, help="the cases' file (written, or read)")
    parser.add_argument("--report", help="ncu's CSV of a run: print its table instead")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", choices=["float16", "bfloat16"], default="float16")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=8192)
    parser.add_argument("--q-heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--layers", type=int, default=16)
    args = parser.parse_args()
    if args.report:
        report(args)
        return
    bad = [m for m in args.rows if not 1 <= m <= rows.MAX_ROWS]
    if bad:
        parser.error(f"--rows must be 1 to {rows.MAX_ROWS}, got {bad}")
    run(args)


if __name__ == "__main__":
    main()
