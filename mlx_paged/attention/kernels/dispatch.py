"""Device kernels as ``KERNELS`` entries: used only where they run and were verified.

Each entry declines (returns ``None``) unless the default device is the GPU of
its backend and the call's shapes are supported. Before the first use of each
compiled variant (dtype, head dims, heads per block, block size, window, sinks),
it runs once on random inputs of the same shape class and is compared with the
reference; on a compile error or a mismatch it logs a warning and that variant
declines from then on, so the gather path serves those calls.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import mlx.core as mx
import numpy as np

from ...storage import ColdLayout, KVQuant, take_blocks
from . import cuda, metal
from .cold_store import cuda_store_cold, store_reason, store_self_check
from .cuda_prefill import paged_prefill_cuda, prefill_reason
from .plan import Launch, LaunchCache, call_key, plan_decode
from .read import read_blocks, read_reason
from .reference import reference_paged_decode, reference_paged_prefill, rotate

if TYPE_CHECKING:
    from ..records import PagedView, PrefillView, Rope

logger = logging.getLogger("mlx_paged.kernels")

TOLERANCE = {mx.float32: 1e-4, mx.float16: 4e-3, mx.bfloat16: 3e-2}

Runner = Callable[..., "mx.array | None"]
_verdicts: dict[tuple, bool] = {}  # (backend, variant) -> passed self-check
_backend_ok: dict[str, bool] = {}


def backend_available(backend: str) -> bool:
    """Whether the default device is a GPU of ``backend`` ("cuda" or "metal")."""
    if mx.default_device() != mx.gpu:
        return False
    if backend not in _backend_ok:
        module = getattr(mx, backend, None)
        _backend_ok[backend] = bool(module is not None and module.is_available())
    return _backend_ok[backend]


def self_check(
    run: Runner, queries: mx.array, view: PagedView, scale: float, sinks: mx.array | None
) -> float:
    """Max abs difference of ``run`` against the reference on random inputs shaped like the call.

    Uses the call's heads, head dims, dtypes, block size, window, scale and
    cold-tier format, so the variants compiled here are the ones the call will
    use; tries split-K off and on. Where the call hands the kernel its new K/V rows
    (``view.new_keys``), each sequence's last row starts out as garbage in the pool and
    goes to the kernel as the new rows, and the rows it stored count in the difference.
    Raises whatever compiling or running the kernel raises.
    """
    from .synthetic import random_paged_batch

    bs = view.block_size
    reach = (view.window or 4 * bs) + 3 * bs + 5  # crosses the window and ends mid-block
    batch = random_paged_batch(
        [reach, 1, 2 * bs],
        n_heads=queries.shape[1],
        n_kv_heads=view.keys.shape[2],
        dk=queries.shape[-1],
        dv=view.values.shape[-1],
        block_size=bs,
        dtype=view.keys.dtype,
        window=view.window,
        sinks=sinks is not None,
        first_blocks=[1, 0, 0],
        seed=7,
        kv_bits=None if view.cold is None else view.cold.bits,
        group_size=64 if view.cold is None else view.cold.group_size,
    )
    q = batch.queries.astype(queries.dtype)
    # The spec runs on the CPU: GPU float32 matmuls may round through TF32.
    with mx.stream(mx.cpu):
        want = reference_paged_decode(q, batch.view, scale, batch.sinks).astype(mx.float32)
        mx.eval(want)
    worst = 0.0
    rope = view.rope if view.new_keys is not None else None
    for splits in (1, 3):
        given, stored, q_given = batch.view, None, q
        if view.new_keys is not None:
            given, stored = _last_rows_given(batch.view, rope)
        if rope is not None:  # the kernel rotates them back
            q_given = rotate(q, given.lengths - 1, rope, inverse=True).astype(q.dtype)
        got = run(q_given, given, scale, batch.sinks, splits)
        if got is None:
            raise RuntimeError("the kernel declined its own self-check inputs")
        worst = max(worst, mx.abs(got.astype(mx.float32) - want).max().item())
        if stored is not None:
            worst = max(worst, stored())
    return worst


def _last_rows_given(
    view: PagedView, rope: Rope | None = None
) -> tuple[PagedView, Callable[[], float]]:
    """``view`` with each sequence's last row replaced by garbage in copies of the pools
    and handed over as the new rows instead (keys rotated back by ``rope``, which the view
    then carries), and a function that measures, once the call ran, how far the rows in
    those copies are from the original ones (relative to 1 + their size)."""
    tables, starts = np.array(view.block_tables), np.array(view.starts)
    at = np.array(view.lengths) - 1
    blocks = mx.array(tables[np.arange(len(at)), (at - starts) // view.block_size])
    slots = mx.array(at % view.block_size)
    pools, new = [], []
    for pool in (view.keys, view.values):
        new.append(pool[blocks, slots][:, :, None])  # (B, HKV, 1, D)
        pool = mx.array(pool)
        pool[blocks, slots] = mx.array(1e4, dtype=pool.dtype)
        pools.append(pool)
    mx.eval(pools, new)
    given_keys = new[0]
    if rope is not None:
        given_keys = rotate(new[0], mx.array(at), rope, inverse=True).astype(new[0].dtype)
    given = view._replace(
        keys=pools[0], values=pools[1], new_keys=given_keys, new_values=new[1], rope=rope
    )

    def stored() -> float:
        rows = [p[blocks, slots][:, :, None].astype(mx.float32) for p in pools]
        gaps = [mx.abs(r - n) / (1 + mx.abs(n)) for r, n in zip(rows, new, strict=True)]
        return max(g.max().item() for g in gaps)

    return given, stored


def _verified(backend: str, run: Runner, queries, view, scale, sinks) -> bool:
    plan = plan_decode(queries, view)
    variant = (
        backend,
        view.keys.dtype,
        queries.dtype,
        queries.shape[1],
        plan.n_kv_heads,
        plan.dk,
        plan.dv,
        view.block_size,
        view.window,
        sinks is not None,
        scale,
        None if view.cold is None else (view.cold.bits, view.cold.group_size),
        view.new_keys is not None,
        None if view.rope is None else view.rope.traditional,
    )
    if variant not in _verdicts:
        tol = max(TOLERANCE[view.keys.dtype], TOLERANCE[queries.dtype])

        def check() -> str | None:
            err = self_check(run, queries, view, scale, sinks)
            if err <= tol:  # a NaN fails
                return None
            return (
                f"differs from the reference by {err:.3g} (tolerance {tol:.3g}) for {variant[1:]}"
            )

        _verdicts[variant] = _passes(backend, "paged decode kernel", "gather path", check)
    return _verdicts[variant]


def _passes(backend: str, what: str, fallback: str, check: Callable[[], str | None]) -> bool:
    """Run a self-check that returns why it failed (or ``None``); warn and return False if it
    failed or raised (compile errors surface there, at the first eval)."""
    try:
        why = check()
    except Exception as e:
        first = str(e).splitlines()[0] if str(e) else ""
        why = f"failed its self-check ({type(e).__name__}: {first})"
    if why is not None:
        logger.warning("mlx_paged: %s %s %s; using the %s for it.", backend, what, why, fallback)
    return why is None


def _device_kernel(backend: str, run: Runner, launch_for: Callable[..., Launch | None], name: str):
    # The launch for each call shape, or None where the kernel declines: every layer of
    # every decode step asks again, so one key and one lookup answer both questions.
    launches = LaunchCache()

    def kernel(
        queries: mx.array, view: PagedView, scale: float, sinks: mx.array | None
    ) -> mx.array | None:
        if not backend_available(backend):
            return None

        def make() -> Launch | None:
            if plan_decode(queries, view).reason:
                return None
            if not _verified(backend, run, queries, view, scale, sinks):
                return None
            return launch_for(queries, view, scale, sinks)

        launch = launches.get(call_key(queries, view, scale, sinks), make)
        return None if launch is None else launch(queries, view, sinks)

    kernel.__name__ = kernel.__qualname__ = name
    kernel.__doc__ = f"``KERNELS`` entry for the {backend} paged decode kernel (self-checked)."
    kernel.available = lambda: backend_available(backend)  # type: ignore[attr-defined]
    kernel.writes = backend == "cuda"  # type: ignore[attr-defined]  # stores view.new_keys
    kernel.ropes = backend == "cuda"  # type: ignore[attr-defined]  # rotates with view.rope
    return kernel


#: The CUDA kernel as a ``KERNELS`` entry; its name is what ``path_counts`` shows.
cuda_paged_decode = _device_kernel(
    "cuda", cuda.paged_decode_cuda, cuda.decode_launch, "cuda_paged_decode"
)
#: The Metal kernel (never run here; see ``metal.py``) as a ``KERNELS`` entry.
metal_paged_decode = _device_kernel(
    "metal", metal.paged_decode_metal, metal.decode_launch, "metal_paged_decode"
)

DEVICE_KERNELS = [cuda_paged_decode, metal_paged_decode]


def prebuild_kernels() -> int:
    """Build ahead the binaries of every layout the decode variants launched so far may
    launch later (``cuda.prebuild``), where the CUDA kernels run; return how many."""
    return cuda.prebuild() if backend_available("cuda") else 0


def prefill_self_check(queries: mx.array, view: PrefillView, scale: float) -> float:
    """Max abs difference of the CUDA prefill kernel against the reference on random inputs
    shaped like the call (heads, head dim, dtype, block size, window, scale).

    Three sequences: one whose queries cross a 64-query tile and whose keys start a block
    in, one padded on the right, and one of a single query; run with the keys whole and in
    three splits. Raises whatever compiling or running the kernel raises.
    """
    from .synthetic import random_prefill_batch

    bs, n = view.block_size, 70
    q, batch = random_prefill_batch(
        offsets=[2 * bs + 3, 5 * bs + 1, 0],
        counts=[n, n - 9, 1],
        n_new=n,
        n_heads=queries.shape[1],
        n_kv_heads=view.keys.shape[2],
        head_dim=queries.shape[-1],
        block_size=bs,
        dtype=view.keys.dtype,
        window=view.window,
        first_blocks=[0, 1, 0],
        seed=5,
    )
    with mx.stream(mx.cpu):  # GPU float32 matmuls may round through TF32
        want = reference_paged_prefill(q, batch, scale).astype(mx.float32)
        mx.eval(want)
    errs = []
    for splits in (1, 3):
        got = paged_prefill_cuda(q, batch, scale, num_splits=splits)
        if got is None:
            raise RuntimeError("the kernel declined its own self-check inputs")
        errs.append(mx.abs(got.astype(mx.float32) - want).max().item())
    return float("nan") if any(math.isnan(e) for e in errs) else max(errs)


_prefill_verdicts: dict[tuple, bool] = {}


def cuda_paged_prefill(
    queries: mx.array, view: PrefillView, scale: float, sinks: mx.array | None
) -> mx.array | None:
    """``PREFILL_KERNELS`` entry for the CUDA paged prefill kernel (self-checked)."""
    if not backend_available("cuda"):
        return None
    d, n_kv = queries.shape[-1], view.keys.shape[2]
    variant = (view.keys.dtype, queries.shape[1], n_kv, d, view.block_size, view.window, scale)
    verdict = _prefill_verdicts.get(variant)
    if verdict is None:
        if prefill_reason(queries, view, sinks):
            return None
        tol = TOLERANCE[view.keys.dtype]

        def check() -> str | None:
            err = prefill_self_check(queries, view, scale)
            if err <= tol:  # a NaN fails
                return None
            return f"differs from the reference by {err:.3g} (tolerance {tol:.3g}) for {variant}"

        verdict = _prefill_verdicts[variant] = _passes(
            "cuda", "paged prefill kernel", "attention over gathered K/V", check
        )
    return paged_prefill_cuda(queries, view, scale, sinks) if verdict else None


cuda_paged_prefill.available = lambda: backend_available("cuda")  # type: ignore[attr-defined]

DEVICE_PREFILL_KERNELS = [cuda_paged_prefill]


def read_self_check(backend: str, keys: mx.array, values: mx.array) -> bool:
    """Whether the ``backend`` block read copies random pools shaped like these exactly.

    Two sequences whose slots cross blocks in shuffled order and end mid-block.
    Raises whatever compiling or running the kernel raises.
    """
    bs = keys.shape[1]
    key = mx.random.key(11)
    pools = [
        mx.random.normal((6, bs, *x.shape[2:]), key=mx.random.split(key)[i]).astype(x.dtype)
        for i, x in enumerate((keys, values))
    ]
    blocks = mx.array([[4, 1, 3], [2, 5, 0]], dtype=mx.int32)
    slots = (blocks[:, :, None] * bs + mx.arange(bs, dtype=mx.int32)).reshape(2, -1)
    slots = slots[:, : 2 * bs + 3]
    got = read_blocks(backend, *pools, slots)
    want = take_blocks(*pools, slots)
    return all(mx.array_equal(g, w).item() for g, w in zip(got, want, strict=True))


def _device_reader(backend: str, name: str):
    verdicts: dict[tuple, bool] = {}

    def reader(
        keys: mx.array, values: mx.array, slots: mx.array
    ) -> tuple[mx.array, mx.array] | None:
        if not backend_available(backend) or read_reason(keys, values, slots):
            return None
        variant = (keys.shape[1:], keys.dtype, values.shape[1:], values.dtype)
        if variant not in verdicts:

            def check() -> str | None:
                if read_self_check(backend, keys, values):
                    return None
                return f"differs from mx.take for {variant}"

            verdicts[variant] = _passes(backend, "block read", "portable read", check)
        return read_blocks(backend, keys, values, slots) if verdicts[variant] else None

    reader.__name__ = reader.__qualname__ = name
    reader.__doc__ = f"``READERS`` entry for the {backend} block read (self-checked)."
    return reader


#: The block reads as ``READERS`` entries (the Metal one never run here).
cuda_block_read = _device_reader("cuda", "cuda_block_read")
metal_block_read = _device_reader("metal", "metal_block_read")

DEVICE_READERS = [cuda_block_read, metal_block_read]


_store_verdicts: dict[tuple, bool] = {}


def cuda_cold_store(
    keys: list[mx.array],
    values: list[mx.array],
    at: mx.array,
    to: mx.array,
    records: mx.array,
    layout: ColdLayout,
    quant: KVQuant,
) -> mx.array | None:
    """``STORERS`` entry for the CUDA migration kernel (self-checked per variant)."""
    if not backend_available("cuda") or store_reason(keys, values, at, to, records, layout):
        return None
    variant = (len(keys), keys[0].shape[1:], values[0].shape[1:], keys[0].dtype, quant)
    if variant not in _store_verdicts:

        def check() -> str | None:
            if store_self_check(keys, values, quant):
                return None
            return f"differs from mx.quantize's records for {variant}"

        _store_verdicts[variant] = _passes("cuda", "cold-tier store", "MLX ops", check)
    if not _store_verdicts[variant]:
        return None
    return cuda_store_cold(keys, values, at, to, records, layout, quant)


DEVICE_STORERS = [cuda_cold_store]
