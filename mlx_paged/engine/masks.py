"""Token-constraint work off the step's critical path.

A decode step's host time is mostly spent building and launching the forward,
so a grammar's mask computed after it adds straight to the step. Instead, right
after a step samples, one background thread has every constrained request
accept its token and fill its next mask (grammar engines release the GIL while
they do), while the main thread hands the events out and builds the next
forward. The next sample waits for that work, then stacks the rows.

Numpy and threads only: no MLX call leaves the engine's thread.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from .request import Request


class MaskWork:
    """The constrained requests' masks, computed a step ahead on one background thread."""

    def __init__(self):
        self._pool: ThreadPoolExecutor | None = None
        self._pending: Future | None = None

    def advance(self, pairs: list[tuple[Request, int, bool]], vocab: int) -> None:
        """In the background: each request accepts its sampled token and, if it goes on
        (the ``bool``), fills its next mask (``vocab`` tokens wide). A token its
        constraint refuses leaves an error that the request's next sample reports."""
        if not pairs:
            return
        self.wait()
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="mlx_paged-masks")
        self._pending = self._pool.submit(_advance, pairs, vocab)

    def wait(self) -> None:
        """Block until the background work is done."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()

    def words(self, reqs: list[Request], vocab: int) -> tuple[np.ndarray, dict[int, str]]:
        """The batch's bitmask ``(B, ceil(vocab / 32))`` (all ones for unconstrained rows),
        and the errors of rows whose constraint failed, by batch index. A request
        without a mask ready (its first token) fills one now."""
        self.wait()
        words = np.full((len(reqs), (vocab + 31) // 32), -1, dtype=np.int32)
        errors = {}
        for i, r in enumerate(reqs):
            if r.constraint is None:
                continue
            if r.mask_error is not None:
                errors[i] = r.mask_error
            elif r.mask is not None and r.mask.shape[0] == words.shape[1]:
                words[i] = r.mask
            else:
                _fill(r, vocab)
                if r.mask_error is not None:
                    errors[i] = r.mask_error
                else:
                    words[i] = r.mask
            r.mask = None  # used: the next one comes with the next token
        return words, errors


def _advance(pairs: list[tuple[Request, int, bool]], vocab: int) -> None:
    fill: dict[type, list[Request]] = {}
    for req, token, more in pairs:
        try:
            ok = req.constraint.accept(token)
        except Exception as e:  # the request's own code: end it, not the batch
            req.mask_error = f"{type(e).__name__}: {e}"
            continue
        if not ok:
            req.mask_error = f"token {token} breaks the request's constraint"
            continue
        if more:
            fill.setdefault(type(req.constraint), []).append(req)
    for kind, reqs in fill.items():
        many = getattr(kind, "fill_many", None)
        if many is not None and len(reqs) > 1:
            rows = np.empty((len(reqs), (vocab + 31) // 32), dtype=np.int32)
            try:
                many([r.constraint for r in reqs], rows)
            except Exception:  # find which one fails, one by one
                pass
            else:
                for r, row in zip(reqs, rows, strict=True):
                    r.mask = row
                continue
        for r in reqs:
            _fill(r, vocab)


def _fill(req: Request, vocab: int) -> None:
    row = np.empty((vocab + 31) // 32, dtype=np.int32)
    try:
        req.constraint.fill(row)
    except Exception as e:
        req.mask_error = f"{type(e).__name__}: {e}"
        return
    req.mask = row
