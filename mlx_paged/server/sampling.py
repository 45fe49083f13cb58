"""Per-request samplers: mlx-lm's filters, in its order, with a request's own seed."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

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


def warm_up_sampler(args: argparse.Namespace, model_path: str | Path):
    """The sampler of a request with the server's defaults (temperature 1 if greedy), for
    the warm-up to build the sampling kernels with."""
    d = sampling_defaults(args, model_path)
    temperature = d.get("temperature") or 1.0
    return make_request_sampler(
        temperature, d.get("top_p", 1.0), int(d.get("top_k", 0)), d.get("min_p", 0.0), None
    )


def sampling_defaults(args: argparse.Namespace, model_path: str | Path) -> dict[str, float]:
    """Request defaults for temperature, top_p, top_k and min_p: the flags, else the
    model's ``generation_config.json`` (sampled models only), else nothing (the API's)."""
    found: dict[str, float] = {}
    try:
        path = Path(model_path)
        if not path.is_dir():
            from mlx_lm.utils import hf_repo_to_path

            path = hf_repo_to_path(str(model_path))
        config = json.loads((path / "generation_config.json").read_text())
    except Exception:  # no such file, or not a local model: the API's defaults
        config = {}
    if config.get("do_sample", True):
        for name in ("temperature", "top_p", "top_k", "min_p"):
            if isinstance(config.get(name), (int, float)) and not isinstance(config[name], bool):
                found[name] = config[name]
    flags = {"temperature": args.temp, "top_p": args.top_p, "top_k": args.top_k}
    found.update({k: v for k, v in {**flags, "min_p": args.min_p}.items() if v is not None})
    return found


# mlx_lm.server's request defaults: flag, type, what it sets, the values it takes.
FLAGS = (
    ("--temp", float, "Sampling temperature", "in [0, 2]", lambda v: 0 <= v <= 2),
    ("--top-p", float, "Nucleus sampling top_p", "in (0, 1]", lambda v: 0 < v <= 1),
    ("--top-k", int, "top_k", ">= 0", lambda v: v >= 0),
    ("--min-p", float, "min_p", "in [0, 1]", lambda v: 0 <= v <= 1),
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The server's sampling defaults for requests that give none (``FLAGS``)."""
    for flag, kind, what, _, _ in FLAGS:
        p.add_argument(
            flag,
            type=kind,
            default=None,
            help=f"{what} for requests that give none; default: the model's "
            "generation_config.json, else the API's default.",
        )


def check_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Exit with a usage error for a sampling default out of its range."""
    for flag, _, _, span, ok in FLAGS:
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is not None and not ok(value):
            parser.error(f"{flag} must be {span}, got {value}.")
