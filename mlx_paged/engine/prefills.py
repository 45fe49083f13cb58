"""How a prefill is cut into forwards: chunks of one long prompt, and batches of short ones."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from .request import Prefill, Request

#: The most of a batched prefill's tokens that may be padding.
MAX_PADDING = 0.25


def batched_prefills(
    reqs: list[Request], steps: tuple[int, ...], budget: int, target: Callable[[Request], int]
) -> Iterator[Prefill]:
    """Batched forwards of at most ``budget`` tokens each, padding included, in order.

    With ``steps`` every request runs those chunks. Without, each runs its
    remaining ``target(r) - r.written`` tokens in one forward, padded on the right
    to the longest of its forward. Shortest first, so that lengths alike share a
    forward; a forward takes no more padding than ``MAX_PADDING`` of its tokens
    (padding costs compute; each forward costs host time).
    """
    if steps:
        per_forward = max(1, budget // max(steps))
        for i in range(0, len(reqs), per_forward):
            yield Prefill(reqs[i : i + per_forward], list(steps), alone=False)
        return

    def forward(group: list[Request], counts: list[int]) -> Prefill:
        if len(set(counts)) == 1:  # nothing to pad
            return Prefill(group, counts[:1], alone=False)
        return Prefill(group, [max(counts)], alone=False, counts=tuple(counts))

    group: list[Request] = []
    counts: list[int] = []
    for n, r in sorted(((target(r) - r.written, r) for r in reqs), key=lambda p: p[0]):
        padded = (len(group) + 1) * n  # n is the longest so far
        if group and (padded > budget or padded - sum(counts) - n > MAX_PADDING * padded):
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
