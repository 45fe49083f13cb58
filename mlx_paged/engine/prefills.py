"""How a prefill is cut into forwards: chunks of one long prompt, and batches of short ones.

On MLX's CUDA backend the first matmul of each new shape costs about 4 ms (cuBLAS
picks its algorithm then), and a prefill forward runs several (BENCHMARKS.md, run
146). There a forward's tokens per row are padded up to a multiple of ``PAD_TOKENS``
(``prefill_granule``), so every projection's row count is a multiple of it up to
``prefill_step_size``: a few shapes, which the warm-up runs before serving. Elsewhere
the granule is 1 and nothing is padded beyond what batching needs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from ..attention.prefill import on_cuda
from .request import Prefill, Request

#: The most of a batched prefill's tokens that may be padding.
MAX_PADDING = 0.25

#: Tokens per row that a prefill forward is padded to a multiple of, on CUDA.
PAD_TOKENS = 32


def prefill_granule(recurrent: bool) -> int:
    """Pad prefill rows to a multiple of this: ``PAD_TOKENS`` on CUDA, 1 elsewhere or for a
    model with recurrent layers (padding tokens would advance their state)."""
    return 1 if recurrent or not on_cuda() else PAD_TOKENS


def padded(n: int, granule: int, budget: int) -> int:
    """``n`` tokens rounded up to a multiple of ``granule``, but past ``budget`` only as far
    as ``n`` itself."""
    return min(-(-n // granule) * granule, max(n, budget))


def batched_prefills(
    reqs: list[Request],
    steps: tuple[int, ...],
    budget: int,
    target: Callable[[Request], int],
    granule: int = 1,
) -> Iterator[Prefill]:
    """Batched forwards of at most ``budget`` tokens each, padding included, in order.

    With ``steps`` every request runs those chunks. Without, each runs its
    remaining ``target(r) - r.written`` tokens in one forward, padded on the right
    to the longest of its forward rounded up to a multiple of ``granule``. Shortest
    first, so that lengths alike share a forward; a forward takes no more padding
    than ``MAX_PADDING`` of its tokens beyond the granule's (padding costs compute;
    each forward costs host time).
    """
    if steps:
        per_forward = max(1, budget // max(steps))
        for i in range(0, len(reqs), per_forward):
            yield Prefill(reqs[i : i + per_forward], list(steps), alone=False)
        return

    def forward(group: list[Request], counts: list[int]) -> Prefill:
        width = padded(max(counts), granule, budget)
        if min(counts) == width:  # nothing to pad
            return Prefill(group, [width], alone=False)
        return Prefill(group, [width], alone=False, counts=tuple(counts))

    group: list[Request] = []
    counts: list[int] = []
    for n, r in sorted(((target(r) - r.written, r) for r in reqs), key=lambda p: p[0]):
        tokens = (len(group) + 1) * padded(n, granule, budget)  # n is the longest so far
        extra = (len(group) + 1) * n - sum(counts) - n  # padding to the longest
        if group and (tokens > budget or extra > MAX_PADDING * (len(group) + 1) * n):
            yield forward(group, counts)
            group, counts = [], []
        group.append(r)
        counts.append(n)
    if group:
        yield forward(group, counts)


def prefill_steps(start: int, end: int, chunk: int, cuts: frozenset[int]) -> list[int]:
    """Forwards for tokens ``[start, end)``, at most ``chunk`` each, also ending at every
    position in ``cuts``.

    A new request's first token comes from its last forward's last position. Running
    that token in a forward of its own costs a pass through the model (host-bound on
    a GPU: a few ms), more than the head over the rest of the chunk (run 101).
    """
    stops = sorted({*(c for c in cuts if start < c < end), end})
    steps, pos = [], start
    for stop in stops:
        while pos < stop:
            steps.append(min(chunk, stop - pos))
            pos += steps[-1]
    return steps
