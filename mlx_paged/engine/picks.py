"""A step's tokens sampled lazily: one vector of picks, and their log-probs, read at once.

``pick`` samples every request of a batch: its logits processors first, then the
argmax or its sampler's pick (samplers sharing a ``batch_key`` in one call), and
for requests that ask for log-probs the sampled token's and the most likely
ones'. Nothing is read until ``Picks.read``, so an overlapped step can be
dispatched before the previous one's picks are read (``engine/decode.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from .request import Request, Sampled


@dataclass(frozen=True)
class Picks:
    """Lazy picks of a batch: tokens ``(B,)`` int32, the rows whose sampler failed, and
    for the rows asking for log-probs (``rows``) the picked token's log-prob ``(n,)`` and
    the ``K`` most likely tokens and log-probs ``(n, K)``, most likely first."""

    tokens: mx.array
    errors: dict[int, str]
    rows: tuple[int, ...] = ()
    chosen: mx.array | None = None
    top_ids: mx.array | None = None
    top_values: mx.array | None = None

    def arrays(self) -> list[mx.array]:
        """The lazy arrays, to evaluate together."""
        lazy = (self.tokens, self.chosen, self.top_ids, self.top_values)
        return [a for a in lazy if a is not None]

    def read(self, reqs: list[Request], vocab: int) -> list[Sampled]:
        """Read the picks (one wait); a row whose sampler failed, or gave no token id in
        ``[0, vocab)``, gets an error."""
        mx.eval(self.arrays())
        out = [checked(t, vocab, self.errors.get(i)) for i, t in enumerate(self.tokens.tolist())]
        if self.rows:
            chosen = self.chosen.tolist()
            ids = self.top_ids.tolist() if self.top_ids is not None else None
            values = self.top_values.tolist() if self.top_values is not None else None
            for j, i in enumerate(self.rows):
                if out[i].error is None:
                    k = reqs[i].logprobs
                    top = tuple(zip(ids[j][:k], values[j][:k], strict=True)) if k else ()
                    out[i] = Sampled(out[i].token, chosen[j], top)
        return out


def pick(
    reqs: list[Request], logits: mx.array, histories: dict[int, mx.array] | None = None
) -> Picks:
    """Lazy picks from ``(B, V)`` logits: each row's logits processors first, then its
    sampler (or the argmax) and its log-probs.

    A processor sees the request's tokens, ``histories[i]`` for row ``i`` where given
    (an overlapped step's, whose last token is still on the device).
    """
    errors: dict[int, str] = {}
    processed = [i for i, r in enumerate(reqs) if r.logits_processors]
    if processed:
        logits = _processed(reqs, processed, logits, histories or {}, errors)
    tokens = mx.argmax(logits, axis=-1).astype(mx.int32)
    sampled = [i for i, r in enumerate(reqs) if r.sampler is not None and i not in errors]
    asked = tuple(i for i, r in enumerate(reqs) if r.logprobs is not None)
    if not sampled and not asked:
        return Picks(tokens, errors)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    if sampled:
        tokens = _sampled(reqs, sampled, logprobs, tokens, errors)
    if not asked:
        return Picks(tokens, errors)
    vocab = logits.shape[-1]
    rows = logprobs[mx.array(asked)].astype(mx.float32)
    picked = mx.clip(tokens[mx.array(asked)], 0, vocab - 1)  # a bad pick is refused at read
    chosen = mx.take_along_axis(rows, picked[:, None], axis=-1)[:, 0]
    k = min(max(reqs[i].logprobs for i in asked), vocab)
    if k == 0:
        return Picks(tokens, errors, asked, chosen)
    ids = mx.argpartition(-rows, k - 1, axis=-1)[:, :k]
    values = mx.take_along_axis(rows, ids, axis=-1)
    order = mx.argsort(-values, axis=-1)
    ids, values = mx.take_along_axis(ids, order, -1), mx.take_along_axis(values, order, -1)
    return Picks(tokens, errors, asked, chosen, ids, values)


def _processed(
    reqs: list[Request], rows: list[int], logits: mx.array, histories: dict, errors: dict
) -> mx.array:
    """``logits`` with ``rows`` passed through their requests' processors (a new array);
    a processor that raises or gives no ``(1, V)`` row puts an error in ``errors``."""
    done, at = [], []
    for i in rows:
        x = logits[i : i + 1]
        tokens = histories.get(i)
        tokens = mx.array(reqs[i].tokens) if tokens is None else tokens
        try:
            for proc in reqs[i].logits_processors:
                x = proc(tokens, x)
            if not isinstance(x, mx.array) or x.shape != (1, logits.shape[-1]):
                shape = getattr(x, "shape", type(x).__name__)
                raise ValueError(f"a logits processor gave {shape}, not (1, {logits.shape[-1]}).")
        except Exception as e:  # the request's own code: end it, not the batch
            errors[i] = f"{type(e).__name__}: {e}"
            continue
        done.append(x)
        at.append(i)
    if not done:
        return logits
    dtype = mx.result_type(logits, *done)
    out = logits.astype(dtype) if dtype != logits.dtype else mx.array(logits)  # not in place
    out[mx.array(at)] = mx.concatenate(done).astype(dtype)
    return out


def _sampled(
    reqs: list[Request], rows: list[int], logprobs: mx.array, tokens: mx.array, errors: dict
) -> mx.array:
    """``tokens`` with ``rows`` replaced by their samplers' picks; a sampler that raises
    or gives no token per row puts an error in ``errors`` (and 0 in its rows)."""
    groups: dict[object, list[int]] = {}  # samplers sharing a batch_key: one call
    for i in rows:
        key = getattr(reqs[i].sampler, "batch_key", None)
        groups.setdefault(("alone", i) if key is None else ("key", key), []).append(i)
    picked = []
    for group in groups.values():
        lp = logprobs[group[0] : group[0] + 1] if len(group) == 1 else logprobs[mx.array(group)]
        try:
            picked.append(_tokens(reqs[group[0]].sampler(lp), len(group)))
        except Exception as e:  # the requests' own code: end them, not the batch
            errors.update(dict.fromkeys(group, f"{type(e).__name__}: {e}"))
            picked.append(mx.zeros((len(group),), mx.int32))
    tokens[mx.array([i for group in groups.values() for i in group])] = mx.concatenate(picked)
    return tokens


def _tokens(picked: object, n: int) -> mx.array:
    """A sampler's picks for ``n`` rows as an ``(n,)`` int32 array; ValueError unless it
    gave one token per row."""
    if n == 1 and isinstance(picked, int) and not isinstance(picked, bool):
        if not -(2**31) <= picked < 2**31:
            raise ValueError(f"the sampler gave {picked!r}, not a token id.")
        return mx.array([picked], dtype=mx.int32)
    if not isinstance(picked, mx.array) or picked.size != n:
        raise ValueError(f"the sampler gave {picked!r}, not {n} token id(s).")
    return picked.reshape(n).astype(mx.int32)


def checked(token: int, vocab: int, error: str | None = None) -> Sampled:
    """``token`` as a ``Sampled``, or an error if ``error`` or it is not in ``[0, vocab)``."""
    if error is None and not 0 <= token < vocab:
        error = f"ValueError: the sampler gave {token!r}, not a token id in [0, {vocab})."
    return Sampled(error=error) if error is not None else Sampled(token)
