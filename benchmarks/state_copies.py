"""What copying a burst's recurrent-state snapshots costs: one-row gathers against slices
times one, each evaluated on its own against all in one ``mx.eval``.

After a hybrid burst's forward, each of its ``--rows`` prompts keeps a snapshot: a copy
of its slot's row of every state array (``StatePool._copy_out``). The arrays are shaped
as a Qwen3.5 1B's: per recurrent layer a float32 delta-rule state ``(16, 128, 128)`` and
a convolution state ``(3, 6144)`` in ``--dtype``. Prints, per way, the milliseconds for
one burst's snapshots, all kept (median of ``--repeats``), then ``StatePool``'s own in
the same run: ``--rows`` snapshots, then a flush.

Usage:
    python benchmarks/state_copies.py                        # a Qwen3.5 1B's shapes
    python benchmarks/state_copies.py --layers 4 --rows 8    # smaller, for this CPU
"""

from __future__ import annotations

import argparse
import statistics
import time

import mlx.core as mx

from mlx_paged.storage import StatePool


def timed(fn, repeats: int) -> float:
    """Median milliseconds of ``fn()`` (synchronized before and after)."""
    times = []
    for _ in range(repeats):
        mx.synchronize()
        start = time.perf_counter()
        fn()
        mx.synchronize()
        times.append(1e3 * (time.perf_counter() - start))
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=12, help="recurrent layers")
    ap.add_argument("--rows", type=int, default=26, help="snapshots a burst takes")
    ap.add_argument("--slots", type=int, default=32)
    ap.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    if not 0 < args.rows <= args.slots:
        raise SystemExit("--rows must be 1 to --slots")
    conv_dtype = getattr(mx, args.dtype)
    shapes = [((16, 128, 128), mx.float32), ((3, 6144), conv_dtype)]
    arrays = [
        [mx.random.normal((args.slots, *shape)).astype(dtype) for shape, dtype in shapes]
        for _ in range(args.layers)
    ]
    mx.eval(arrays)
    rows = range(args.rows)

    def gathered(r: int) -> list[mx.array]:
        at = mx.array([r], dtype=mx.int32)
        return [a[at] for layer in arrays for a in layer]

    def sliced(r: int) -> list[mx.array]:
        return [a[r : r + 1] * 1 for layer in arrays for a in layer]

    def each(copy) -> list:  # every snapshot is kept, as the pool keeps them
        kept = []
        for r in rows:
            kept.append(copy(r))
            mx.eval(kept[-1])
        return kept

    def once(copy) -> list:
        kept = [copy(r) for r in rows]
        mx.eval(kept)
        return kept

    for name, copy in (("one-row gathers", gathered), ("slices times one", sliced)):
        ms_each = timed(lambda copy=copy: each(copy), args.repeats)
        ms_once = timed(lambda copy=copy: once(copy), args.repeats)
        print(f"{name:17s}: each evaluated {ms_each:8.2f} ms, all in one eval {ms_once:8.2f} ms")

    pool = StatePool([2] * args.layers, num_slots=args.slots, num_snapshots=args.rows)
    for _ in range(args.slots):
        pool.take_slot()
    for layer, entries in enumerate(arrays):
        pool.write(layer, args.slots, [a + 0 for a in entries])
    mx.eval(pool.evaluated())

    def burst() -> None:
        for r in rows:
            pool.snapshot(r)  # the oldest are evicted: the cap is one burst's
        pool.flush()

    ms = timed(burst, args.repeats)
    print(f"StatePool        : {args.rows} snapshots and their flush {ms:8.2f} ms")


if __name__ == "__main__":
    main()
