"""Per-request samplers: mlx-lm's filters, in its order, with a request's own seed."""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p, apply_xtc


def make_request_sampler(
    temperature: float,
    top_p: float,
    top_k: int,
    min_p: float,
    seed: int | None,
    xtc: tuple[float, float, list[int]] | None = None,
) -> Callable[[mx.array], mx.array] | None:
    """A sampler over log-probs ``(1, V)`` with its own random stream when ``seed`` is given
    (any int, taken modulo 2**64).

    ``None`` (greedy) at temperature 0. The filters apply in mlx-lm's
    ``make_sampler`` order: top-p, min-p, XTC (``xtc``: probability, threshold
    and the token ids it never removes), top-k. MLX work happens only when the
    engine thread calls it. Without a seed it has a ``batch_key``: the engine samples
    every request with equal settings in one call.
    """
    if temperature == 0:
        return None
    key: list[mx.array] = []

    def sample(logprobs: mx.array) -> mx.array:
        x = logprobs
        if top_p < 1.0:
            x = apply_top_p(x, top_p)
        if min_p > 0.0:
            x = apply_min_p(x, min_p)
        if xtc is not None and xtc[0] > 0.0:
            x = apply_xtc(x, *xtc)
        if top_k > 0:
            x = apply_top_k(x, top_k)
        if seed is None:
            return mx.random.categorical(x * (1.0 / temperature))
        if not key:
            key.append(mx.random.key(seed % 2**64))  # MLX's keys take uint64 seeds
        key[0], sub = mx.random.split(key[0])
        return mx.random.categorical(x * (1.0 / temperature), key=sub)

    if seed is None:  # rows sampled independently from the global stream: one call a step
        sample.batch_key = ("make_request_sampler", temperature, top_p, top_k, min_p, _xtc_key(xtc))
    return sample


def _xtc_key(xtc: tuple[float, float, list[int]] | None) -> tuple | None:
    return None if xtc is None else (xtc[0], xtc[1], tuple(xtc[2]))
