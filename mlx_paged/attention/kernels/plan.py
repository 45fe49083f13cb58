"""Shape checks and work split shared by the CUDA and Metal kernels."""

from __future__ import annotations

import struct
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import mlx.core as mx

if TYPE_CHECKING:
    from ..records import PagedView, Rope

FLOAT_TYPES = (mx.float16, mx.bfloat16, mx.float32)
COLD_BITS = (4, 8)


@dataclass
class DecodePlan:
    """What a fused decode kernel needs to know about one call.

    ``reason`` is set (and the rest meaningless) when the kernels cannot run it.
    """

    batch: int = 0
    n_heads: int = 0
    n_kv_heads: int = 0
    group: int = 0  # query heads per KV head
    heads_per_block: int = 0  # query heads one thread block handles (divides group)
    dk: int = 0
    dv: int = 0
    num_splits: int = 1
    cold_elems: int = 0  # elements of a cold row one lane takes (0 without a cold tier)
    reason: str | None = None


def rows_per_step(dk: int, dv: int, itemsize: int, base: int, cold_elems: int = 0) -> int:
    """Rows a warp loads per step: ``base`` for 256-byte rows, fewer for wider rows.

    A power of two, and at least the rows one warp load covers for K and for V. With
    a cold tier whose lanes take ``cold_elems`` elements of a row (the kernel's cold
    layout) ``base`` counts loads per lane instead (``cuda.COLD_SLOTS``), and a step holds
    at least one full-precision row.
    """
    vec = 16 // itemsize
    if cold_elems:
        per = cold_elems
        per_load = max(32 // (d // per) for d in (dk, dv))  # rows one warp load covers
        return per_load * max(base, per // vec)
    per_load = max(32 // min(d // vec, 32) for d in (dk, dv))
    rows = max(1, base * 256 // (max(dk, dv) * itemsize))
    return max(per_load, 1 << (rows.bit_length() - 1))


def cold_lane_elems(bits: int, lane_bytes: int = 16) -> int:
    """Elements of a cold row one lane takes: those of ``lane_bytes`` (8 or 16) bytes of
    packed words."""
    if lane_bytes not in (8, 16):
        raise ValueError(f"a lane loads 8 or 16 bytes of a cold row, not {lane_bytes}")
    return lane_bytes * 8 // bits


def _lanes_ok(dim: int, vec: int) -> bool:
    """A row of ``dim`` elements splits evenly into 16-byte loads over 1..32 lanes, or k*32."""
    if dim % vec:
        return False
    n = dim // vec
    return (n <= 32 and n & (n - 1) == 0) or n % 32 == 0


def plan_decode(
    queries: mx.array, view: PagedView, max_lanes_elems: int = 32, cold_lane_bytes: int = 16
) -> DecodePlan:
    """Check a decode call against what the kernels support and size the thread blocks.

    Args:
        max_lanes_elems: register budget: query-head slices times elements per
            lane that one thread may hold.
        cold_lane_bytes: with a cold tier, bytes of a cold row's packed words one
            lane loads (8 or 16).
    """
    if queries.ndim != 4 or queries.shape[2] != 1:
        return DecodePlan(reason=f"not a decode call: queries {queries.shape}")
    B, n_heads, _, dk = queries.shape
    nb, bs, n_kv, kdim = view.keys.shape
    dv = view.values.shape[-1]
    if kdim != dk or view.values.shape[:3] != view.keys.shape[:3]:
        return DecodePlan(reason="pool shapes do not match the queries")
    if n_heads % n_kv:
        return DecodePlan(reason=f"{n_heads} query heads over {n_kv} KV heads")
    dtype = view.keys.dtype
    if dtype not in FLOAT_TYPES or view.values.dtype != dtype or queries.dtype not in FLOAT_TYPES:
        return DecodePlan(reason=f"dtypes {queries.dtype}/{dtype}/{view.values.dtype}")
    vec = 16 // dtype.size
    if not (_lanes_ok(dk, vec) and _lanes_ok(dv, vec)) or max(dk, dv) > 512:
        return DecodePlan(reason=f"head dims {dk}/{dv} do not split into 16-byte lanes")
    if view.block_tables.ndim != 2 or view.block_tables.shape[0] != B:
        return DecodePlan(reason=f"block_tables {view.block_tables.shape} for batch {B}")
    if view.new_keys is not None and (why := _new_rows_reason(view, B, n_kv, dk, dv)):
        return DecodePlan(reason=why)
    if view.rope is not None and (why := _rope_reason(view.rope, dk)):
        return DecodePlan(reason=why)
    cold_elems = 0 if view.cold is None else cold_lane_elems(view.cold.bits, cold_lane_bytes)
    if view.cold is not None and (why := _cold_reason(view, dk, dv, cold_elems)):
        return DecodePlan(reason=why)
    # Elements one lane holds per head: a 16-byte vector of T, or a cold row's slice;
    # more when a row exceeds 32 lanes.
    per_lane = max(vec, dk // 32, dv // 32, cold_elems)
    group = n_heads // n_kv
    hg = max(h for h in range(1, group + 1) if group % h == 0 and h * per_lane <= max_lanes_elems)
    return DecodePlan(B, n_heads, n_kv, group, hg, dk, dv, cold_elems=cold_elems)


def _rope_reason(rope: Rope, dk: int) -> str | None:
    """Why a launch cannot rotate by ``rope``: its angles must be one float32 per pair of the
    head's leading dimensions, at most half the head (MLX does not bounds-check the
    kernel's reads of them)."""
    freqs = rope.freqs
    if freqs.ndim != 1 or not 0 < freqs.shape[0] <= dk // 2 or freqs.dtype != mx.float32:
        return f"RoPE angles {freqs.shape} {freqs.dtype} for head dim {dk}"
    return None


def _new_rows_reason(view: PagedView, batch: int, n_kv: int, dk: int, dv: int) -> str | None:
    """Why a kernel cannot store the view's new K/V rows, or ``None``."""
    for x, d in ((view.new_keys, dk), (view.new_values, dv)):
        if x is None or x.shape != (batch, n_kv, 1, d) or x.dtype != view.keys.dtype:
            got = None if x is None else (x.shape, x.dtype)
            return f"new K/V rows {got} for {batch} sequences of a {view.keys.dtype} pool"
    return None


def _cold_reason(view: PagedView, dk: int, dv: int, per: int) -> str | None:
    """Why the kernels cannot read this cold tier in lanes of ``per`` elements, or ``None``."""
    cold = view.cold
    if cold.bits not in COLD_BITS or cold.group_size % 32 or dk % cold.group_size:
        return f"cold tier of {cold.bits} bits in groups of {cold.group_size}"
    if dv % cold.group_size:
        return f"cold tier groups of {cold.group_size} for v_head_dim {dv}"
    # A lane takes per elements of a cold row, within one group; a row takes 1-32 lanes.
    if not all(_lanes_ok(d, per) and d <= 32 * per for d in (dk, dv)):
        return f"head dims {dk}/{dv} do not split into lanes of {per} {cold.bits}-bit elements"
    blob, layout = cold.blob, cold.layout
    bs, n_kv = view.keys.shape[1:3]
    want = (bs, n_kv, dk * cold.bits // 32, dk // cold.group_size)
    want += (n_kv, dv * cold.bits // 32, dv // cold.group_size, view.keys.dtype)
    if layout != want:
        return f"cold blocks {layout} for a pool of {view.keys.shape} {view.keys.dtype}"
    if blob.dtype != mx.uint32 or blob.ndim != 3 or blob.shape[2] != layout.words:
        return f"cold records {blob.shape} {blob.dtype} for {layout.words}-word blocks"
    if not 0 <= cold.layer < blob.shape[0]:
        return f"cold layer {cold.layer} of a stack of {blob.shape[0]}"
    return None


def cold_inputs(view: PagedView) -> list[mx.array]:
    """The Metal kernel's two cold-tier inputs: the stack's records (``ColdView.blob``)
    and the first record of the view's layer in them (``cold_base``); placeholders when
    the batch has no cold block."""
    if view.cold is None:
        return [placeholder(mx.uint32), placeholder(mx.int32)]
    base = view.cold.layer * view.cold.blob.shape[1]
    if base not in _bases:
        _bases[base] = mx.array([base], dtype=mx.int32)
        mx.eval(_bases[base])
    return [view.cold.blob, _bases[base]]


#: Per first row, an evaluated one-element array holding it (a launch adds no op).
_bases: dict[int, mx.array] = {}


_placeholders: dict[mx.Dtype, mx.array] = {}


def placeholder(dtype: mx.Dtype) -> mx.array:
    """An evaluated one-element array for a kernel input the call does not use."""
    if dtype not in _placeholders:
        _placeholders[dtype] = mx.zeros((1,), dtype=dtype)
        mx.eval(_placeholders[dtype])
    return _placeholders[dtype]


def float_bits(x: float) -> int:
    """The float32 bits of ``x`` as an int: a float constant passed as a template argument."""
    return struct.unpack("<i", struct.pack("<f", x))[0]


def base_template(
    plan: DecodePlan, queries: mx.array, view: PagedView, has_sinks: bool, scale: float
) -> list[tuple[str, object]]:
    """The template arguments both kernels take; ``scale`` is baked in as ``SCALE_BITS``."""
    cold = view.cold
    return [
        ("T", view.keys.dtype),
        ("OT", queries.dtype),
        ("DK", plan.dk),
        ("DV", plan.dv),
        ("HQ", plan.n_heads),
        ("HKV", plan.n_kv_heads),
        ("G", plan.group),
        ("HG", plan.heads_per_block),
        ("BS", view.block_size),
        ("WINDOW", view.window or 0),
        ("SINKS", has_sinks),
        ("SCALE_BITS", float_bits(scale)),
        ("QBITS", 0 if cold is None else cold.bits),
        ("QGS", 32 if cold is None else cold.group_size),
        ("CE", plan.cold_elems or 16),
    ]


def call_key(
    queries: mx.array, view: PagedView, scale: float, sinks: mx.array | None, *tuning: object
) -> tuple:
    """What a launch depends on: shapes, dtypes, window, sinks, scale, the cold tier's
    format and size, whether it stores (and rotates) the step's K/V, and tuning overrides."""
    keys, values = view.keys, view.values
    cold = (
        None
        if view.cold is None
        else (view.cold.blob.shape, view.cold.layout, view.cold.bits, view.cold.group_size)
    )
    return (
        queries.shape,
        queries.dtype,
        keys.shape,
        keys.dtype,
        values.shape,
        values.dtype,
        view.block_tables.shape,
        view.window,
        sinks is None,
        scale,
        cold,
        None if view.new_keys is None else (view.new_keys.shape, view.new_keys.dtype),
        None if view.new_values is None else (view.new_values.shape, view.new_values.dtype),
        None if view.rope is None else (view.rope.freqs.shape, view.rope.traditional),
        *tuning,
    )


#: A decode launch for one call shape: ``launch(queries, view, sinks)`` returns the output.
Launch = Callable[[mx.array, "PagedView", "mx.array | None"], mx.array]
_MISSING = object()


def compiled_launch(launch: Callable[..., mx.array]) -> Callable[..., mx.array]:
    """``launch`` (a function of arrays that calls ``mx.fast`` kernels) wrapped in ``mx.compile``.

    Calling an ``mx.fast`` custom kernel costs about 10 us of host time (MLX
    writes out the kernel's whole source and argument list on every call); a
    compiled function replays the kernel it recorded instead. All layers of a
    decode step share a shape, so a new shape costs one trace per step.
    """
    return mx.compile(launch)


class LaunchCache:
    """Launches keyed by call shape, made once each; at most ``limit``, least recently used
    dropped first."""

    def __init__(self, limit: int = 256):
        self.limit = limit
        self.fns: dict[tuple, Launch | None] = {}
        _launch_caches.add(self)

    def get(self, key: tuple, make: Callable[[], Launch | None]) -> Launch | None:
        """The launch for ``key``, made by ``make`` on first use; ``None`` if ``make`` declines."""
        fns = self.fns
        fn = fns.pop(key, _MISSING)
        if fn is _MISSING:
            if len(fns) >= self.limit:
                del fns[next(iter(fns))]
            fn = make()
        fns[key] = fn  # last: the most recently used
        return fn  # type: ignore[return-value]


_launch_caches: weakref.WeakSet[LaunchCache] = weakref.WeakSet()
#: ``(kernel name, template arguments)`` of every launch made: each is one compiled binary.
kernel_templates: set[tuple] = set()


def compiled_variants() -> dict[str, int]:
    """How many kernel variants this process has made: ``binaries`` (template sets, one
    device compile each) and ``launches`` (call shapes held, one traced graph each)."""
    launches = {id(fn) for c in _launch_caches for fn in c.fns.values() if fn is not None}
    return {"binaries": len(kernel_templates), "launches": len(launches)}
