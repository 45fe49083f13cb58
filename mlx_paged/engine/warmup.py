"""A throwaway burst through a new engine, so real requests find its first-use work done.

A fresh process pays, on its first requests, for work that later requests
skip: MLX's kernels and graphs for each new batch size, the fused attention
kernels' builds and self-checks, and the traces of their launch shapes.
``warm_up`` runs made-up requests shaped like a burst that shares a system
prompt (one prefills the prefix alone, the rest adopt it and prefill their
suffixes of a few lengths in padded batches, as a real burst's are, then all
decode). By default one burst of ``max_batch_size`` requests asks for
staggered numbers of tokens, so its decode batch shrinks through every size
from ``max_batch_size`` to 1: a server's traffic meets every one of them. Its
first requests stop first, so a hybrid model's compiled steps gather their state
slots; a hybrid's second burst stops its last requests first, so that they meet
the steps over slots ``0 .. B-1`` too (``engine/compiled.py``). Then one prompt a token
longer than a prefill chunk (prefilled alone, its first chunk ``prefill_step_size``
wide) and one burst whose suffixes fill a batched forward of about
``prefill_batch_tokens``: the shapes of a long prompt's and a large burst's matmuls
and attention, whose first use a real burst paid otherwise (2.6 s in a just-started
machine's first server process, BENCHMARKS.md runs 331 and 334). On CUDA it then builds
the decode kernel's binaries
for the layouts longer contexts launch (``kernels.prebuild_kernels``: the burst's
contexts are short). Then it
rehearses the disk tier's spill and load on one of their blocks (no file is
written), drops the made-up blocks from the prefix index and zeroes the counters,
the step clock and the compiled step count (not its traces). The disk tier stays
out of the made-up requests: they load nothing from it, and their blocks never
go to it (its files would otherwise fill with them at each shutdown, and the
next process's warm-up would load them instead of running its prefills).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from ..attention.kernels import prebuild_kernels
from .engine import PagedEngine
from .request import Sampler
from .scheduler import COUNTERS


def warm_up(
    engine: PagedEngine, batch_sizes: Sequence[int] | None = None, sampler: Sampler | None = None
) -> float:
    """Decode at every batch size from the engine's ``max_batch_size`` down to 1 (or, with
    ``batch_sizes``, run a burst at each of them with a few decode steps); return the
    seconds it took. With a ``sampler``, every other request samples with it, so that the
    first sampled request builds no sampling kernels.

    Raises:
        ValueError: for a batch size that is not a positive int up to ``max_batch_size``.
    """
    most = engine.scheduler.max_batch_size
    hybrid = engine.runner.states is not None
    sizes = [most] * (1 + hybrid) if batch_sizes is None else list(batch_sizes)
    for b in sizes:
        if isinstance(b, bool) or not isinstance(b, int) or not 0 < b <= most:
            raise ValueError(f"warm-up batch sizes must be ints in 1..{most}, got {b!r}.")
    start = time.perf_counter()
    with _without_disk(engine):
        _bursts(engine, sizes, hybrid, batch_sizes is None, sampler)
        _wide_forwards(engine, engine.vocab_size or 256)
    prebuild_kernels()
    if engine.disk is not None:
        engine.disk.rehearse()
    engine.scheduler.index.clear()
    engine.scheduler.counters = dict.fromkeys(COUNTERS, 0)
    engine.clock.reset()
    if engine.runner.compiled is not None:  # its traces stay counted: they were made
        engine.runner.compiled.steps = 0
    return time.perf_counter() - start


@contextmanager
def _without_disk(engine: PagedEngine) -> Iterator[None]:
    """The engine's disk tier neither loads nor spills meanwhile."""
    s = engine.scheduler
    hooks = s.disk, s.index.on_spill
    s.disk = s.index.on_spill = None
    try:
        yield
    finally:
        s.disk, s.index.on_spill = hooks


def _bursts(
    engine: PagedEngine, sizes: list[int], hybrid: bool, staggered: bool, sampler: Sampler | None
) -> None:
    """A burst of made-up requests sharing a prefix at each batch size of ``sizes``."""
    bs, vocab = engine.scheduler.block_size, engine.vocab_size or 256
    for round_, b in enumerate(sizes):
        # Token ids unlikely to begin a real prompt; one prefix per round.
        prefix = [(vocab - 1 - 3 * (j + round_)) % vocab for j in range(2 * bs)]
        for i in range(b):
            # Suffixes of four lengths: the batched prefill pads rows, as a real burst's does.
            suffix = [(7 * i + 11 * j + round_) % vocab for j in range(bs // 2 + 1 + i % 4)]
            # Request i decodes i + 1 steps (its first token comes from its prefill), or
            # b - i in a hybrid's second round, so decode step k runs the b - k + 1
            # requests still going: every size once.
            steps = b - i - 1 if hybrid and round_ else i
            picks = sampler if i % 2 else None
            engine.add_request(prefix + suffix, steps + 2 if staggered else 3, picks)
        for _ in engine.stream():
            pass


def _wide_forwards(engine: PagedEngine, vocab: int) -> None:
    """A made-up prompt of ``prefill_step_size + 1`` tokens, then ``max_batch_size``
    made-up requests sharing a prefix, the first's prefill alone and the rest's suffixes
    filling one batched forward; each asks for its first token only."""
    s = engine.scheduler
    most, bs = s.max_batch_size, s.block_size
    _run(engine, [[(vocab - 2 - 5 * j) % vocab for j in range(s.prefill_step_size + 1)]])
    width = max(1, s.prefill_batch_tokens // max(1, most - 1))
    prefix = [(vocab - 3 - 7 * j) % vocab for j in range(2 * bs)]
    _run(
        engine, [prefix + [(13 * i + 5 * j + 1) % vocab for j in range(width)] for i in range(most)]
    )


def _run(engine: PagedEngine, prompts: list[list[int]]) -> None:
    """Run ``prompts`` together to their first tokens, less those from the first the pool
    could never hold."""
    for prompt in prompts:
        try:
            engine.add_request(prompt, 1)
        except ValueError:
            break
    for _ in engine.stream():
        pass
