"""Host time of a decode step's block tables: ``DecodeBatch`` and ``arrays()`` per step.

    python benchmarks/step_tables.py [--steps 300] [--cases 1x130 14x130 64x70 64x130 64x260]

Each case is ``BxW``: B tables of about W blocks of 16 tokens, every table growing one
token a step, so its row changes as it crosses into a new block (bookkeeping only: no
model, no K/V). Prints the median milliseconds a step of building the step's
``DecodeBatch`` and the arrays a compiled step takes.
"""

from __future__ import annotations

import argparse
import statistics
import time

from mlx_paged.cache import DecodeBatch
from mlx_paged.engine.compiled import width_bucket
from mlx_paged.storage import KVPool

BLOCK = 16


def step_ms(rows: int, blocks: int, steps: int) -> float:
    """Median ms a step of ``DecodeBatch`` and ``arrays()`` over ``rows`` growing tables."""
    pool = KVPool(num_layers=1, block_size=BLOCK)
    tables = [pool.new_table() for _ in range(rows)]
    for i, t in enumerate(tables):
        n = max(blocks * BLOCK - 1 - i, 1)  # rows cross into new blocks on different steps
        pool.reserve(t, 0, n + 1)
        t.lengths[0] = n
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        batch = DecodeBatch(pool, tables, None)
        batch.arrays(width_bucket(batch.width // BLOCK))
        times.append(time.perf_counter() - start)
        for t in tables:
            t.lengths[0] += 1
            pool.reserve(t, t.lengths[0], t.lengths[0] + 1)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument(
        "--cases", nargs="+", default=["1x130", "14x130", "64x70", "64x130", "64x260"]
    )
    args = parser.parse_args()
    for case in args.cases:
        rows, blocks = map(int, case.split("x"))
        print(f"B={rows} W={blocks}: {step_ms(rows, blocks, args.steps):.3f} ms a step", flush=True)


if __name__ == "__main__":
    main()
