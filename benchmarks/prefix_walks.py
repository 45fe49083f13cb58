"""The prefix index's host work for requests that share a long cached prefix.

Per request, the scheduler walks the prompt's blocks to match it, takes a reference
on each adopted block, indexes what each prefill forward wrote (``index_written``)
and, when the request ends, indexes its blocks again and drops its references
(``_detach``). This times those calls on a ``PrefixIndex`` and ``BlockPool`` alone
(no model), the index's inserts walking from the root (``root``) against resuming
from each request's ``Cursor`` (``cursor``), in the same process:

- ``burst``: a request with a ``--prefix``-token cached prefix and a 16-token suffix
  prefilled in one forward;
- ``chunked``: a new ``--prefix``-token prompt prefilled in ``--step``-token chunks,
  each forward's blocks indexed.

One line per case: median milliseconds per request over ``--rounds``.

Usage:
    python benchmarks/prefix_walks.py --prefix 1024 8192 32768
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from mlx_paged.blocks import BlockPool, Cursor, PrefixIndex

BS = 16


def request(index: PrefixIndex, pool: BlockPool, tokens: list[int], steps: list[int], cursor):
    """One request's index work: match and adopt, an insert per forward, finish."""
    m = index.match(tokens[:-1])
    hit = m.length if m else 0
    table = list(m.blocks[0]) if m else []
    pool.retain_all(table)
    table += pool.allocate(-(-len(tokens) // BS) - len(table))
    mark = (m.cursor if m else Cursor()) if cursor else None
    for end in steps:
        if end > hit:
            index.insert(tokens, [(0, table)], end, partial=False, cursor=mark)
    index.insert(tokens, [(0, table)], cursor=mark)
    pool.release_all(table)


def case(prefix: int, kind: str, cursor: bool, rounds: int, step: int) -> float:
    """Median milliseconds of one request's index work."""
    rng = random.Random(0)
    pool = BlockPool((rounds + 2) * (prefix // BS + 2), BS)  # room for every prompt
    index = PrefixIndex([pool], [None])
    system = [rng.randrange(50000) for _ in range(prefix)]
    request(index, pool, system + [1], [prefix + 1], cursor)
    times = []
    for _ in range(rounds):
        if kind == "burst":
            tokens = system + [rng.randrange(50000) for _ in range(16)]
            steps = [len(tokens)]
        else:
            tokens = [rng.randrange(50000) for _ in range(prefix)]
            steps = list(range(step, len(tokens), step)) + [len(tokens)]
        start = time.perf_counter()
        request(index, pool, tokens, steps, cursor)
        times.append(1e3 * (time.perf_counter() - start))
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prefix", type=int, nargs="+", default=[1024, 8192, 32768])
    ap.add_argument("--step", type=int, default=2048, help="a chunked prompt's forward width")
    ap.add_argument("--rounds", type=int, default=20)
    args = ap.parse_args()
    for kind in ("burst", "chunked"):
        for prefix in args.prefix:
            root = case(prefix, kind, False, args.rounds, args.step)
            cur = case(prefix, kind, True, args.rounds, args.step)
            print(
                f"{kind} prefix={prefix}: root {root:.3f} ms, cursor {cur:.3f} ms "
                f"({cur / root:.2f}x)",
                flush=True,
            )


if __name__ == "__main__":
    main()
