"""A decode step's matmuls one weight shape at a time: MLX's (cuBLAS) against the few-row
kernel, at a few row counts, each launch timed on the GPU by ``ncu``.

The shapes are those of a fused llama-style step (``q|k|v``, ``o``, ``gate|up``, ``down``
once a layer, and the head), with random float16 or bfloat16 weights. Under ``ncu``, each case
(rows, shape, implementation) is one marker kernel and then ``--repeats`` launches, each
evaluated on its own; ``--cases`` records the cases in order. ``--report`` reads ``ncu``'s CSV
and the cases back and prints each shape's mean kernel time and a step's sum (every layer
shape times the layers, plus the head). ``ncu`` flushes the caches between kernels, as a
step's weights would be cold.

``--tilings NT/WARPS/U ...`` also times the kernel with each of these tilings (8-column tiles
a block, warps, K chunks a warp loads at once; ``rows.TILINGS``), at up to
``rows.KERNEL_ROWS`` rows, and the report names the fastest for narrow and for wide weights
(``rows.NARROW``) at each row count: a new GPU's or model's ``TILINGS`` in one run.

Usage:
    ncu --clock-control none --profile-from-start off --metrics gpu__time_duration.sum \\
        --csv --page raw --log-file /tmp/mm.csv \\
        python benchmarks/matmul_shapes.py --rows 16 32 48 --cases /tmp/mm.cases
    python benchmarks/matmul_shapes.py --report /tmp/mm.csv --cases /tmp/mm.cases
    ncu ... python benchmarks/matmul_shapes.py --rows 64 --tilings 4/8/1 8/4/1 4/4/1 \
        --cases /tmp/mm.cases
"""

from __future__ import annotations

import argparse
import csv
import ctypes
import json

import mlx.core as mx

from mlx_paged.attention.kernels import rows

SHIPPED = "few-row kernel"  # the tilings of ``rows.TILINGS``


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
            for impl in impls(m, args.tilings):
                if impl == "mlx":
                    call = lambda x=x, w=w: x @ w.T  # noqa: E731
                else:
                    tiling = None if impl == SHIPPED else parse_tiling(impl)
                    call = lambda x=x, w=w, t=tiling: rows.few_rows_matmul(x, w, t)  # noqa: E731
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
    counts = {shape: count for shape, (_, _, count) in meta["shapes"].items()}
    wide = {shape: n > rows.NARROW for shape, (n, _, _) in meta["shapes"].items()}

    def step(m: int, impl: str, part: bool | None = None) -> float:
        """A step's µs at ``m`` rows (narrow or wide weights only, with ``part``)."""
        return sum(us[m, s, impl] * c for s, c in counts.items() if part in (None, wide[s]))

    for m in sorted({c["rows"] for c in meta["cases"]}):
        print(f"rows {m}: µs a matmul, and a step's {sum(counts.values())}")
        print(f"  {'':16s}" + "".join(f"{s:>9s}" for s in counts) + "      step")
        done = list(dict.fromkeys(c["impl"] for c in meta["cases"] if c["rows"] == m))
        for impl in done:
            ratio = f" ({step(m, impl) / step(m, 'mlx'):.2f}x)" if impl != "mlx" else ""
            times = "".join(f"{us[m, s, impl]:9.1f}" for s in counts)
            print(f"  {impl:16s}{times}{step(m, impl):10.0f}{ratio}")
        tilings = [i for i in done if i not in ("mlx", SHIPPED)]
        if tilings:
            best = [min(tilings, key=lambda i, p=part: step(m, i, p)) for part in (False, True)]
            total = step(m, best[0], False) + step(m, best[1], True)
            print(
                f"  fastest: {best[0]} narrow, {best[1]} wide: {total:.0f} µs"
                f" ({total / step(m, 'mlx'):.2f}x)"
            )


def impls(m: int, tilings: list[rows.Tiling]) -> list[str]:
    """What times ``m`` rows: MLX, the shipped tilings (up to ``MAX_ROWS``), ``tilings``."""
    named = ["/".join(map(str, t)) for t in tilings]
    return ["mlx", *([SHIPPED] if m <= rows.MAX_ROWS else []), *named]


def parse_tiling(text: str) -> rows.Tiling:
    """``"NT/WARPS/U"`` as a tiling."""
    try:
        tiling = tuple(int(v) for v in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a tiling is NT/WARPS/U, got {text!r}") from None
    return tiling  # type: ignore[return-value]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[16, 32, 48])
    parser.add_argument("--cases", required=True, help="the cases' file (written, or read)")
    parser.add_argument("--report", help="ncu's CSV of a run: print its table instead")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--tilings",
        nargs="+",
        type=parse_tiling,
        default=[],
        metavar="NT/WARPS/U",
        help="tilings to time as well",
    )
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
    most = rows.KERNEL_ROWS if args.tilings else rows.MAX_ROWS
    bad = [m for m in args.rows if not 1 <= m <= most]
    if bad:
        parser.error(f"--rows must be 1 to {most}, got {bad}")
    for tiling in args.tilings:
        reason = rows.tiling_reason(tiling, max(args.rows))
        if reason is not None:
            parser.error(f"--tilings: {reason}")
    run(args)


if __name__ == "__main__":
    main()
