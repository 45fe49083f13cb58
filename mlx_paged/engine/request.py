"""The engine's records: a request, the event each generated token makes, and the stats.

Pure Python: the scheduler reads and updates these without MLX.
"""

from __future__ import annotations

import numbers
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from ..blocks import BlockTable, Cursor, LayerKind, PagedCacheStats

#: Maps log-probs ``(1, vocab)`` to a token ``(1,)``, as mlx-lm's samplers do.
Sampler = Callable[[Any], Any]
#: Maps ``(tokens, logits)`` to logits, as mlx-lm's logits processors do.
LogitsProcessor = Callable[[Any, Any], Any]


class TokenConstraint(Protocol):
    """Which tokens a request may sample next (a grammar's state), as a bitmask.

    The runner masks a batch's logits in one operation. After each step, a
    background thread has every constrained request accept the token it sampled
    and fill its next mask, so both methods must be safe to call off the
    engine's thread (they never touch MLX). A token the constraint refuses ends
    the request at its next step. A class may add a static ``fill_many(constraints,
    rows)`` that fills the rows of a 2-D array for several of its instances at once
    (a grammar engine's parallel mask computation).
    """

    def fill(self, row: Any) -> None:
        """Write the allowed next tokens into ``row``: a 1-D int32 numpy array of
        ``ceil(vocab / 32)`` words, bit ``t % 32`` of word ``t // 32`` set for token ``t``."""

    def accept(self, token: int) -> bool:
        """Advance past ``token``; ``False`` if the constraint does not allow it."""


@dataclass(frozen=True)
class Event:
    """One generated token, or the end of a request that failed.

    ``finish_reason`` is ``"stop"``, ``"length"``, ``"error"`` (``token`` is -1
    and ``error`` says why) or ``None``. ``logprob`` and ``top_logprobs`` (token,
    log-prob pairs, best first) are set for requests that asked for them.
    """

    uid: int
    token: int
    finish_reason: str | None
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] | None = None
    error: str | None = None


@dataclass(frozen=True)
class EngineStats(PagedCacheStats):
    """Pool counts (summed over layer groups) plus the engine's counters."""

    prefix_hit_tokens: int = 0
    prompt_tokens: int = 0
    prefilled_tokens: int = 0
    generated_tokens: int = 0
    preemptions: int = 0
    aborted: int = 0
    failed: int = 0
    peak_live_blocks: int = 0
    running: int = 0
    waiting: int = 0
    cold_blocks: int = 0  # quantized blocks held, of the full-attention group
    cold_bytes: int = 0
    cold_capacity: int = 0  # cold-tier block slots: ``cold_blocks``, or grown so far
    migrations: int = 0  # blocks moved to the cold tier so far
    disk_hit_tokens: int = 0  # prompt tokens whose blocks came back from the disk tier
    # Recurrent state (hybrid models): slots held by running requests, all slots' bytes,
    # and the snapshots the prefix index holds.
    state_slots_used: int = 0
    state_bytes: int = 0
    state_snapshots: int = 0
    state_snapshot_bytes: int = 0


@dataclass(eq=False)
class Request:
    """One request's data; only the scheduler moves it between queues.

    ``tables`` holds the request's block table per layer group while it is
    running, and ``None`` while it waits; so does ``slot``, its recurrent-state
    slot (hybrid models).
    """

    uid: int
    prompt: list[int]
    max_tokens: int
    sampler: Sampler | None
    logits_processors: list[LogitsProcessor]
    stop_tokens: frozenset[int]
    logprobs: int | None = None  # top log-probs per token to report; None: none
    constraint: TokenConstraint | None = None  # a grammar that masks every sampled token
    # The constraint's next mask (a numpy row, filled a step ahead), or why it failed.
    mask: Any = None
    mask_error: str | None = None
    generated: list[int] = field(default_factory=list)
    tables: dict[LayerKind, BlockTable] | None = None
    cursor: Cursor = field(default_factory=Cursor)  # where its blocks stand in the prefix index
    slot: int | None = None
    # Recurrent state: where its prefill stops for snapshots, and how many tokens of cached
    # blocks it shares past the snapshot it adopted (it snapshots their end for requests
    # behind it).
    cuts: frozenset[int] = frozenset()
    shared_past_snapshot: int = 0
    prefix_hit: int = 0  # prompt tokens served from the prefix index at first admission
    # ``time.perf_counter()`` when it was added, first admitted, and sampled its first token.
    arrived: float = field(default_factory=time.perf_counter)
    admitted: float | None = None
    first_token: float | None = None

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.generated

    def tokens_between(self, lo: int, hi: int) -> list[int]:
        """``tokens[lo:hi]`` (``0 <= lo``), without building the whole list first."""
        p = len(self.prompt)
        if hi <= p:
            return self.prompt[lo:hi]
        if lo >= p:
            return self.generated[lo - p : hi - p]
        return self.prompt[lo:] + self.generated[: hi - p]

    @property
    def last_token(self) -> int:
        return self.generated[-1] if self.generated else self.prompt[-1]

    @property
    def kv_target(self) -> int:
        """Tokens that need K/V before decoding: all of a new prompt, all but the last
        token of a resumed request (the decode step feeds that one)."""
        n = len(self.prompt) + len(self.generated)
        return n - 1 if self.generated else n

    @property
    def written(self) -> int:
        """Tokens whose K/V is written (all groups and layers agree between forwards)."""
        return next(iter(self.tables.values())).lengths[0]


@dataclass(frozen=True)
class Prefill:
    """Prefill work the scheduler hands the engine.

    Each request runs ``steps[0]``, then ``steps[1]``, ... more tokens from what
    it has written, one forward per step; new requests want logits after the
    last step (their first token). ``alone``: one request, prefilled through its
    own cache before the next admission, so that later requests can adopt its
    blocks. Otherwise the requests (all new, or all resumed) run batched; with
    ``counts``, forward ``k`` runs ``steps[k]`` tokens of each request, of which the
    first ``counts[k][i]`` are request ``i``'s and the rest padding.
    """

    requests: list[Request]
    steps: list[int]
    alone: bool
    counts: tuple[tuple[int, ...], ...] | None = None  # per forward, real tokens per request

    def step_counts(self, i: int) -> tuple[int, ...] | None:
        """Real tokens per request of forward ``i``, or ``None`` where nothing is padded."""
        return self.counts[i] if self.counts else None

    @property
    def fresh(self) -> bool:
        """Whether the requests are new (they sample their first token after the last step)."""
        return not self.requests[0].generated


@dataclass(frozen=True)
class Sampled:
    """What sampling gave one request: a token (with log-probs if asked), or an error."""

    token: int = -1
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] | None = None
    error: str | None = None


def make_request(
    uid: int, tokens: list, max_tokens: object, vocab: int | None, **settings: Any
) -> Request:
    """A ``Request`` for ``tokens`` after checking its arguments (``settings``: the
    ``Request`` fields from ``sampler`` on).

    Raises:
        ValueError: for an empty prompt, a token id outside ``[0, vocab)``, or a bad
            ``max_tokens`` or ``logprobs``.
    """
    if not tokens:
        raise ValueError("the prompt is empty; give at least one token.")
    plain = check_tokens(tokens, vocab)
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens <= 0:
        raise ValueError(f"max_tokens must be a positive int, got {max_tokens!r}.")
    logprobs = settings.get("logprobs")
    if logprobs is not None and (
        isinstance(logprobs, bool) or not isinstance(logprobs, int) or logprobs < 0
    ):
        raise ValueError(f"logprobs must be None or an int >= 0, got {logprobs!r}.")
    return Request(uid, list(tokens) if plain else [int(t) for t in tokens], max_tokens, **settings)


def check_tokens(tokens: Sequence[object], vocab: int | None) -> bool:
    """Raise ValueError unless every token is an int id in ``[0, vocab)``; return whether
    they are all plain ``int``s.

    MLX does not bounds-check the embedding's gather: an id outside the table
    reads stray memory or crashes the process, so ids are checked here. Plain
    ``int`` sequences (the usual case) are checked in C, their types as a set and
    their range in numpy: a long prompt's checks count in its time to first token
    (0.7 ms at 32k tokens on a CPU, against 1.0 ms with ``min`` and ``max``);
    anything else token by token.
    """
    if tokens and set(map(type, tokens)) == {int}:
        try:
            ids = np.fromiter(tokens, np.int64, len(tokens))
        except OverflowError:  # past int64: out of range, reported below
            ids = None
        if ids is not None and ids.min() >= 0 and (vocab is None or ids.max() < vocab):
            return True
    for i, t in enumerate(tokens):
        if isinstance(t, bool) or not isinstance(t, numbers.Integral):
            raise ValueError(f"token {i} is {t!r}; token ids must be ints.")
        if t < 0 or (vocab is not None and t >= vocab):
            bound = f"[0, {vocab})" if vocab is not None else ">= 0"
            raise ValueError(f"token {i} is {t}, outside the vocabulary {bound}.")
    return False
