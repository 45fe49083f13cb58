"""A throwaway burst through a new engine, so real requests find its first-use work done.

A fresh process pays, on its first requests, for work that later requests
skip: MLX's kernels and graphs for each new batch size, the fused attention
kernels' builds and self-checks, and the traces of their launch shapes.
``warm_up`` runs made-up requests shaped like a burst that shares a system
prompt (one prefills the prefix alone, the rest adopt it and prefill their
suffixes of a few lengths in padded batches, as a real burst's are, then all
decode; a hybrid model's prefix is long enough for a recurrent-state snapshot
at its end, which the rest adopt). By default one burst of ``max_batch_size`` requests asks for
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
the decode kernel's binaries for the layouts longer contexts launch
(``kernels.prebuild_kernels``: the burst's contexts are short) and the few-row matmul's
for every row count (``prebuild_few_rows``: the bursts meet only some). Then it
rehearses the disk tier's spill and load on one of their blocks (no file is
written), drops the made-up blocks from the prefix index, zeroes the counters,
the step clock and the compiled step count (not its traces), and hands the
buffers MLX cached for reuse back to the device. The disk tier stays
out of the made-up requests: they load nothing from it, and their blocks never
go to it (its files would otherwise fill with them at each shutdown, and the
next process's warm-up would load them instead of running its prefills).
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import mlx.core as mx
import mlx.nn as nn

from ..attention.kernels import prebuild_kernels, rows
from ..attention.prefill import on_cuda
from .engine import PagedEngine
from .linears import FewRowsEmbedding, FewRowsLinear
from .request import Sampler
from .scheduler import COUNTERS, Scheduler

#: Full-precision linear layers, as loaded or routed through the few-row kernel (whose rows
#: past ``MAX_ROWS`` still go to cuBLAS).
PLAIN = (nn.Linear, FewRowsLinear)

#: cuBLASLt cache entries kept beyond the warmed matmuls: the decode's, the head's and others.
HEURISTICS_SPARE = 8192
#: MLX's buffer cache while the matmuls are warmed (its limit is restored after).
WARM_CACHE_BYTES = 1 << 30
#: Most rows warmed: a wider forward takes tens of ms, beside which a search is small.
WARM_ROWS = 4096


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
    prebuild_few_rows(engine.runner.model)
    warm_matmuls(engine.runner.model, engine.scheduler, engine.vocab_size)
    if engine.disk is not None:
        engine.disk.rehearse()
    engine.scheduler.index.clear()
    engine.scheduler.counters = dict.fromkeys(COUNTERS, 0)
    engine.clock.reset()
    if engine.runner.compiled is not None:  # its traces stay counted: they were made
        engine.runner.compiled.steps = 0
    # The made-up requests' buffers, kept by MLX for reuse, would stay held by a server
    # at rest: about 2.2 GiB of a llama-1B's (BENCHMARKS.md, runs 450-451).
    mx.clear_cache()
    return time.perf_counter() - start


def warm_matmuls(model: nn.Module, scheduler: Scheduler, vocab: int | None) -> int:
    """On CUDA, run each distinct linear layer of ``model`` (its head left out) once at
    every row count a forward can give it, 1 to the scheduler's widest forward (at most
    ``WARM_ROWS``); return the matmuls run (0 on other devices).

    MLX's CUDA matmul asks cuBLASLt for an algorithm at every call. cuBLASLt answers a shape
    it has met from its cache, and a new one in 1–2 ms (BENCHMARKS.md, runs 415–417). A forward's
    matmuls have as many rows as its tokens, so each new prompt remainder or burst shape
    paid that on the request path, about 10 ms a forward; this takes about 3 s once. The
    cache holds 8,192 shapes by default, which this raises to hold them all (where the
    library that MLX loaded can be found). Sharded layers are left out: their calls talk to
    the other ranks.
    """
    if not on_cuda():
        return 0
    layers: dict[tuple, nn.Module] = {}
    for _, module in model.named_modules():
        if type(module) not in (*PLAIN, nn.QuantizedLinear):  # sharded ones talk to peers
            continue
        dims, weight = _input_dims(module), module.weight
        if vocab is not None and weight.shape[0] == vocab:
            continue  # the head runs over one position a row: a decode's shapes
        dtype = weight.dtype if type(module) in PLAIN else module.scales.dtype
        bias = "bias" in module
        layers.setdefault((type(module), dims, tuple(weight.shape), dtype, bias), module)
    most = min(WARM_ROWS, max(scheduler.prefill_step_size, scheduler.prefill_batch_tokens))
    _hold_heuristics(most * len(layers) + HEURISTICS_SPARE)
    # Each row count's buffers have sizes of their own, which MLX's cache would keep: 76 GB
    # of a llama-1B's, where the process held 6 GB without them (run 419).
    limit = mx.set_cache_limit(WARM_CACHE_BYTES)
    try:
        for rows in range(1, most + 1):
            mx.eval([m(mx.zeros((rows, key[1]), key[3])) for key, m in layers.items()])
    finally:
        mx.set_cache_limit(limit)
    return most * len(layers)


def prebuild_few_rows(model: nn.Module) -> int:
    """Build the few-row kernel's binaries for every launch ``model``'s routed layers can
    make (``rows.prebuild``, for 2- and 3-dimensional inputs); return how many.

    The bursts above launch only the row counts they meet: a server at batch 32 never
    ran 33-48 rows through a model's ``(B, L, K)`` layers, and its first request whose
    forward did built two binaries on its path (0.3-0.6 s, BENCHMARKS.md runs 657-658).
    """
    routed = (FewRowsLinear, FewRowsEmbedding)
    dtypes = {m.weight.dtype for _, m in model.named_modules() if type(m) in routed}
    return rows.prebuild(sorted(dtypes, key=str))


def _hold_heuristics(shapes: int) -> bool:
    """Let cuBLASLt's cache of chosen algorithms hold at least ``shapes`` entries; False if
    the library MLX loaded is not found."""
    try:
        with open("/proc/self/maps") as f:
            path = next(line.split()[-1] for line in f if "libcublasLt.so" in line)
        lib = ctypes.CDLL(path)  # the library already loaded: the same handle
    except (OSError, StopIteration):
        return False
    held = ctypes.c_size_t()
    if lib.cublasLtHeuristicsCacheGetCapacity(ctypes.byref(held)) != 0:
        return False
    if held.value < shapes:
        return lib.cublasLtHeuristicsCacheSetCapacity(ctypes.c_size_t(shapes)) == 0
    return True


def _input_dims(module: nn.Module) -> int:
    """The features a linear layer takes (its packed words hold ``32 / bits`` each when
    quantized)."""
    if type(module) is nn.QuantizedLinear:
        return module.weight.shape[1] * 32 // module.bits
    return module.weight.shape[1]


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
        prefix = [(vocab - 1 - 3 * (j + round_)) % vocab for j in range(_prefix_length(engine))]
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
    most = s.max_batch_size
    _run(engine, [[(vocab - 2 - 5 * j) % vocab for j in range(s.prefill_step_size + 1)]])
    width = max(1, s.prefill_batch_tokens // max(1, most - 1))
    prefix = [(vocab - 3 - 7 * j) % vocab for j in range(_prefix_length(engine))]
    _run(
        engine, [prefix + [(13 * i + 5 * j + 1) % vocab for j in range(width)] for i in range(most)]
    )


def _prefix_length(engine: PagedEngine) -> int:
    """Tokens of the made-up prefix a burst shares: two blocks, or for a hybrid model at
    least ``RecurrentStates.min_span`` in whole blocks (128 tokens on CUDA by default), so
    that a snapshot is kept at its end and the burst's other requests adopt it, as a real
    burst adopts its cached system prompt's. Without one, each of them would prefill its
    prompt alone from the start, and the first real burst would build the kernels of
    batched forwards from adopted states: 17 s on a fresh H200 (BENCHMARKS.md, runs 651-652)."""
    s = engine.scheduler
    span = s.recurrent.min_span if s.recurrent is not None else 1
    return max(2 * s.block_size, -(-span // s.block_size) * s.block_size)


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
