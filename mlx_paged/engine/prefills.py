"""How a prefill is cut into forwards (chunks of one long prompt, batches of short ones), and
the blocks it takes."""

from __future__ import annotations

from collections.abc import Iterator

from ..blocks import BlockTable, BlockTables, LayerKind
from .request import Prefill, Request

#: The most of a batched prefill's tokens that may be padding.
MAX_PADDING = 0.25


def batched_prefills(work: list[tuple[Request, list[int]]], budget: int) -> Iterator[Prefill]:
    """Batched forwards of requests, each with its own steps (all with as many), in order.

    Forward ``k`` of a batch runs every request's ``steps[k]`` tokens, padded on the
    right to the longest, at most ``budget`` tokens, padding included. Alike steps
    first, so that lengths alike share a batch; a batch takes no more padding than
    ``MAX_PADDING`` of its tokens (padding costs compute; each forward costs host time).
    """
    group: list[Request] = []
    rows: list[list[int]] = []
    for req, steps in sorted(work, key=lambda p: p[1]):
        trial = [*rows, steps]
        widths = [max(col) for col in zip(*trial, strict=True)]
        padded = len(trial) * sum(widths)
        padding = padded - sum(map(sum, trial))
        if group and (len(trial) * max(widths) > budget or padding > MAX_PADDING * padded):
            yield _batch(group, rows)
            group, rows = [], []
        group.append(req)
        rows.append(steps)
    if group:
        yield _batch(group, rows)


def _batch(group: list[Request], rows: list[list[int]]) -> Prefill:
    if all(r == rows[0] for r in rows):  # nothing to pad
        return Prefill(group, list(rows[0]), alone=False)
    counts = tuple(zip(*rows, strict=True))
    return Prefill(group, [max(c) for c in counts], alone=False, counts=counts)


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


def blocks_to_write(
    group: BlockTables, kind: LayerKind, table: BlockTable, start: int, end: int, step: int
) -> int:
    """Blocks a prefill of ``[start, end)`` in chunks of ``step`` tokens takes; a window
    keeps only its last blocks."""
    need = group.blocks_needed(table, start, end)
    return min(need, peak_blocks(group, kind.window, min(step, end - start), end))


def peak_blocks(group: BlockTables, window: int | None, chunk: int, total: int) -> int:
    """Most blocks one sequence of ``total`` tokens holds at once while prefilling in
    forwards of ``chunk`` tokens."""
    bs = group.block_size
    span = -(-total // bs) + 1
    if window is None:  # a cold tier bounds the full-precision blocks too
        return min(span, group.hot_span(chunk) or span)
    return min(span, -(-(window + chunk) // bs) + 1)
