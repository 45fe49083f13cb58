"""Pool blocks and recurrent states as the disk tier's entries, and back.

An entry holds one block of every layer of every group, as named host arrays
(``storage/disk.py`` writes them): ``"{group}.{layer}.{k|v}.{dtype}.{model dtype}"``
for a full-precision block, and ``"{group}.{layer}.{k|v}{q|s|b}.{dtype}.{model
dtype}"`` for the packed values, scales and biases of a quantized (cold) one. A
recurrent-state snapshot is its own entry, ``"s.{layer}.{entry}.{dtype}"``. The
host arrays hold bytes (their last axis counts bytes): numpy has no bfloat16.

A block's entry also holds its place in its prefix (``CHAIN``): its parent's key
(zeros for a prompt's first block) and its tokens, which its key hashes (``chain_keys``):
the prefixes a directory holds are rebuilt from its entries alone (``prefixes``).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from functools import lru_cache

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from ..blocks import COLD, BlockTable, is_cold
from .disk_format import ArraySpec, Run
from .kv_pool import KVPool
from .states import State

#: What a snapshot's key adds to the key of the block it ends.
STATE = "s"

#: The arrays of a block's entry that place it in its prefix (the rest are its layers').
CHAIN = ("parent", "tokens")
#: Bytes of a key's hash (``chain_keys``).
KEY_BYTES = 20

#: Per ``(group, layer, name)``: an ``(n, bs, H, ...)`` array and the model's dtype.
Entries = dict[tuple[int, int, str], tuple[mx.array, mx.Dtype]]


def block_parts(
    pools: list[KVPool], cold: tuple[bool | None, ...], rows: list[list[int | None]]
) -> tuple[list[str], list[mx.array]] | None:
    """Entry names and ``(n, bs, H, ...)`` arrays of blocks ``rows`` (a block per group,
    in the tiers ``cold`` says; a group of tier ``None`` has none); ``None`` if a layer
    was never written."""
    names, parts = [], []
    for g, pool in enumerate(pools):
        if cold[g] is None:
            continue
        at = mx.array([r[g] - COLD if cold[g] else r[g] for r in rows], dtype=mx.int32)
        for layer in range(pool.num_layers):
            if pool.keys[layer] is None:
                return None
            model = dtype_name(pool.input_dtypes[layer])
            for which in "kv":
                if cold[g]:  # quantized: packed values, scales, biases
                    held = pool.cold.parts(layer, at)[which == "v"]
                    for part, x in zip("qsb", held, strict=True):
                        names.append(f"{g}.{layer}.{which}{part}.{dtype_name(x.dtype)}.{model}")
                        parts.append(x)
                else:
                    x = (pool.keys if which == "k" else pool.values)[layer]
                    names.append(f"{g}.{layer}.{which}.{dtype_name(x.dtype)}.{model}")
                    parts.append(x[at])
    return names, parts


def chain_keys(tokens: Sequence[int], block_size: int, parent: str = "") -> list[str]:
    """The key of each full block of ``tokens``: a hash of its parent's key and its tokens
    (``parent``: the key of the block before ``tokens``, if they do not start a prompt)."""
    n = len(tokens) // block_size * block_size
    # Every block's bytes in one conversion: a conversion per block cost more than its hash.
    raw, step = np.asarray(tokens[:n], dtype=np.int64).tobytes(), block_size * 8
    keys, parent = [], bytes.fromhex(parent)
    for lo in range(0, len(raw), step):
        parent = hashlib.blake2b(parent + raw[lo : lo + step], digest_size=20).digest()
        keys.append(parent.hex())
    return keys


def chain_arrays(parent: str, tokens: Sequence[int]) -> dict[str, np.ndarray]:
    """A block entry's ``CHAIN`` arrays: its parent's key (``""`` for a prompt's first
    block) and its ``tokens``."""
    parent_bytes = bytes.fromhex(parent) if parent else bytes(KEY_BYTES)
    return {
        "parent": np.frombuffer(parent_bytes, dtype=np.uint8),
        "tokens": np.asarray(tokens, dtype=np.int64),
    }


def chain_specs(specs: Sequence[ArraySpec]) -> tuple[ArraySpec, ArraySpec] | None:
    """Where an entry of ``specs`` holds its ``CHAIN`` arrays (parent, tokens) in its
    payload; ``None`` for an entry without them."""
    named = {spec.name: spec for spec in specs}
    if any(name not in named for name in CHAIN):
        return None
    p, t = (named[name] for name in CHAIN)
    if p.shape != (KEY_BYTES,) or len(t.shape) != 1 or np.dtype(t.dtype) != np.int64:
        return None
    return p, t


def chain_link(key: str, parent: bytes, tokens: bytes) -> tuple[str, list[int]] | None:
    """An entry's ``(parent key, tokens)`` from its ``CHAIN`` arrays' bytes, if they hash
    to its ``key`` (``chain_keys``); else ``None``."""
    parent_key = parent.hex() if any(parent) else ""
    toks = np.frombuffer(tokens, dtype="<i8").tolist()
    return (parent_key, toks) if chain_keys(toks, len(toks), parent_key) == [key] else None


def run_links(keys: Sequence[str], run: Run) -> dict[str, tuple[str, list[int]]]:
    """``{key: (parent key, tokens)}`` of a run's block entries (under ``keys``) whose
    ``CHAIN`` arrays hash to their key; none for entries written without them."""
    found = chain_specs(run.specs)
    if found is None:
        return {}
    p, t = found
    rows = run.data[:, run.payload :]
    links = {}
    for key, row in zip(keys, rows, strict=True):
        got = chain_link(
            key,
            row[p.start : p.start + p.size].tobytes(),
            row[t.start : t.start + t.size].tobytes(),
        )
        if got is not None:
            links[key] = got
    return links


def prefixes(links: dict[str, tuple[str, list[int]]]) -> list[list[int]]:
    """The token prefixes that ``links`` (``run_links``, in the order of their use) hold
    whole, every block from a prompt's first: one per deepest block, oldest first."""
    whole: dict[str, bool] = {"": True}
    for key in links:
        path = []
        while key not in whole:  # up to a block known whole or not (or a missing one)
            path.append(key)
            key = links[key][0]
            if key and key not in links:
                whole[key] = False
        for k in path:
            whole[k] = whole[key]
    parents = {links[k][0] for k in links if whole[k]}
    out = []
    for key in links:
        if whole[key] and key not in parents:
            blocks = []
            while key:
                key, tokens = links[key]
                blocks.append(tokens)
            out.append([t for tokens in reversed(blocks) for t in tokens])
    return out


def tiers(blocks: Sequence[int | None]) -> tuple[bool | None, ...]:
    """Per group: whether the block is cold, or ``None`` for none."""
    return tuple(None if b is None else is_cold(b) for b in blocks)


def by_tier(items: Sequence[tuple]) -> dict[tuple, list[tuple]]:
    """``(key, block per group, ...)`` items grouped by their blocks' ``tiers``, in order."""
    groups: dict[tuple, list[tuple]] = {}
    for item in items:
        groups.setdefault(tiers(item[1]), []).append(item)
    return groups


def new_blocks(
    pool: KVPool, table: BlockTable, at: int, n: int, cold: bool | None
) -> list[int] | None:
    """``n`` new blocks (cold ones for quantized entries) at token ``at`` of ``table``, for
    a load to write; ``None`` when the pool cannot free them. Entries without this group's
    blocks (a sliding window's, given back before the spill) leave the table empty past
    them."""
    bs = pool.block_size
    if cold is None:
        pool.release(table)
        table.first = at // bs + n
        return []
    if cold:
        slots = pool.blocks.cold.allocate(n)
        if slots is None:
            return None
        table.blocks.extend(c + COLD for c in slots)
    else:
        if not pool.blocks.can_allocate(n):
            return None
        pool.reserve(table, at, at + n * bs)
    lo = at // bs - table.first
    return table.blocks[lo : lo + n]


def make_room(pool: KVPool, cold: bool | None, entries: int, blocks: int) -> None:
    """Grow a full-attention group's growable pool once for a load of ``entries`` that
    ``new_blocks`` takes run by run: its cold tier by ``entries`` for cold ones, else
    by the ``blocks`` the prompt still needs."""
    if cold is None:
        return
    if cold:
        pool.blocks.cold.make_room(entries)
    else:
        pool.make_room(blocks)


def state_parts(state: State) -> tuple[list[str], list[mx.array]]:
    """Entry names and ``(1, *entry_shape)`` arrays of a recurrent-state snapshot."""
    names, parts = [], []
    for layer, entries in enumerate(state):
        for e, a in enumerate(entries):
            if a is not None:
                names.append(f"s.{layer}.{e}.{dtype_name(a.dtype)}")
                parts.append(a)
    return names, parts


def to_host(names: list[str], parts: list[mx.array]) -> list[dict[str, np.ndarray]]:
    """Per row of the ``(n, ...)`` arrays ``parts``, its arrays as numpy bytes under
    ``names``, in one evaluation."""
    n = parts[0].shape[0]
    parts = [p.view(mx.uint8) for p in parts]
    rows = np.array(mx.concatenate([p.reshape(n, -1) for p in parts], axis=1))
    out = []
    for row in rows:
        arrays, lo = {}, 0
        for name, part in zip(names, parts, strict=True):
            hi = lo + part.size // n
            arrays[name] = row[lo:hi].reshape(part.shape[1:])
            lo = hi
        out.append(arrays)
    return out


def run_blocks(
    pools: list[KVPool],
    windows: list[int | None],
    run: Run,
    to_mlx: Callable[[np.ndarray], mx.array] = mx.array,
    stream: mx.Stream | None = None,
) -> tuple[Entries, list[bool | None], mx.array | None] | None:
    """A run of block entries in MLX, one copy (``to_mlx``); per group whether its
    blocks are cold (``None``: the entries hold none, as a sliding-window group may);
    and for a run whose payloads the host did not check, whether each entry's sum
    matches (``payload_ok``, lazy). ``None`` when the entries are not of these pools'
    layout. The copy and the sums go on ``stream`` (default: the default stream); the
    entries are views of the copy, on the default stream."""
    parsed = {}
    for spec in (spec for spec in run.specs if spec.name not in CHAIN):
        group, layer, which, dtype, model = spec.name.split(".")
        parsed[(int(group), int(layer), which)] = (spec, getattr(mx, dtype), getattr(mx, model))
    cold = [
        True if (g, 0, "kq") in parsed else False if (g, 0, "k") in parsed else None
        for g in range(len(pools))
    ]
    want = {
        (g, layer, w + part)
        for g, pool in enumerate(pools)
        if cold[g] is not None
        for layer in range(pool.num_layers)
        for w in "kv"
        for part in ("qsb" if cold[g] else [""])
    }
    if (
        parsed.keys() != want
        or any(c is None and w is None for c, w in zip(cold, windows, strict=True))
        or any(c and p.quant is None for c, p in zip(cold, pools, strict=True))
    ):
        return None
    with mx.stream(stream) if stream is not None else nullcontext():
        data = to_mlx(run.data)  # (n, file bytes) uint8: the one copy into MLX
        ok = None if run.checked else payload_ok(data, run)
    views: dict[mx.Dtype, mx.array] = {}  # the rows as each dtype (no copy)
    out = {}
    for name, (spec, dtype, model) in parsed.items():
        out[name] = (_entry_view(data, run.payload + spec.start, spec.shape, dtype, views), model)
    return out, cold, ok


def _entry_view(
    data: mx.array,
    start: int,
    shape: tuple[int, ...],
    dtype: mx.Dtype,
    views: dict[mx.Dtype, mx.array],
) -> mx.array:
    """The ``(n, *shape)`` array of each row's bytes from ``start`` (``shape``'s last axis in
    bytes), as ``dtype``: a strided view of the rows viewed as ``dtype``, which a pool write
    reads in place (a byte slice viewed as a wider type would be copied first)."""
    n, row = data.shape
    size = dtype.size
    *outer, last = shape
    if row % size or start % size or last % size:  # not aligned: slice and copy
        raw = data[:, start : start + math.prod(shape)].reshape(n, *shape)
        return raw.view(dtype)
    if dtype not in views:
        views[dtype] = data.view(dtype)
    dims = (*outer, last // size)
    strides = [1]
    for d in reversed(dims[1:]):
        strides.insert(0, strides[0] * d)
    return mx.as_strided(views[dtype], (n, *dims), (row // size, *strides), start // size)


def payload_ok(data: mx.array, run: Run) -> mx.array:
    """Whether each entry's payload word sum (``storage/disk_format.py``), computed where
    ``data`` (``run.data`` in MLX) lies, is the one written: a lazy ``(entries,)`` bool."""
    lo, hi = run.payload_words
    words = data.view(mx.uint32)[:, lo:hi]
    return mx.sum(words * _weights(hi - lo), axis=1) == mx.array(run.sums)


@lru_cache(maxsize=4)
def _weights(n: int) -> mx.array:
    """The sum's multipliers ``2i + 1`` for ``n`` words."""
    return mx.arange(1, 2 * n, 2, dtype=mx.uint32)


def write_blocks(pool: KVPool, g: int, ids: list[int], entries: Entries, cold: bool) -> None:
    """Write group ``g``'s K/V of ``entries`` into blocks ``ids`` of ``pool``, one write
    per layer and array, making the layers a fresh pool lacks."""
    at = mx.array([b - COLD if cold else b for b in ids], dtype=mx.int32)
    colds = []  # each layer's quantized (K, V)
    for layer in range(pool.num_layers):
        if cold:
            k = tuple(entries[(g, layer, "k" + p)][0] for p in "qsb")
            v = tuple(entries[(g, layer, "v" + p)][0] for p in "qsb")
            model = entries[(g, layer, "kq")][1]
            # Heads and head dim from the scales: (n, bs, H, D / group_size).
            (hk, dk), (hv, dv) = (x[1].shape[2:] for x in (k, v))
            dk, dv = dk * pool.quant.group_size, dv * pool.quant.group_size
        else:
            (k, model), (v, _) = entries[(g, layer, "k")], entries[(g, layer, "v")]
            (hk, dk), (hv, dv) = k.shape[2:], v.shape[2:]
        if pool.keys[layer] is None:  # a fresh pool: the layer's arrays come first
            pool._create_layer(
                layer, mx.zeros((1, hk, 1, dk), model), mx.zeros((1, hv, 1, dv), model)
            )
            pool.input_dtypes[layer] = model
        if cold:
            colds.append((k, v))
        else:
            pool.keys[layer][at] = k.astype(pool.keys[layer].dtype)
            pool.values[layer][at] = v.astype(pool.values[layer].dtype)
    if cold:
        pool.cold.write_layers(colds, at, pool.blocks.cold.capacity)
        pool._update_bytes_per_block()


def host_state(entries: list[int], arrays: dict[str, np.ndarray]) -> State | None:
    """A snapshot entry's state, per layer and entry; ``None`` if it is not of a model
    whose recurrent layers have ``entries`` state entries each."""
    state: State = [[None] * n for n in entries]
    for name, raw in arrays.items():
        kind, layer, e, dtype = name.split(".")
        layer, e = int(layer), int(e)
        if kind != "s" or layer >= len(state) or e >= len(state[layer]):
            return None
        state[layer][e] = mx.array(raw).view(getattr(mx, dtype))[None]
    return state


def pool_arrays(pool: KVPool) -> list[mx.array]:
    """Every array a pool holds, both tiers."""
    cold = [] if pool.cold is None else pool.cold.blobs
    return [a for a in (*pool.keys, *pool.values) if a is not None] + cold


def cache_layout(pools: dict) -> list[tuple]:
    """What a fingerprint names of the pools (per ``LayerKind``): each group's window,
    layers, storage dtype and quantization."""
    return [
        (k.window, p.num_layers, str(p.kv_dtype), p.quant and (p.quant.bits, p.quant.group_size))
        for k, p in pools.items()
    ]


def fingerprint(model: nn.Module, layout: object) -> str:
    """A hex digest naming the model (type, arguments, parameter shapes, dtypes and
    samples of their values) and ``layout`` (how the cache stores it)."""
    h = hashlib.blake2b(digest_size=16)
    args = getattr(model, "args", None)
    h.update(repr((type(model).__module__, sorted(vars(args).items()) if args else None)).encode())
    h.update(repr(layout).encode())
    for name, p in tree_flatten(model.parameters()):
        h.update(f"{name}:{p.shape}:{p.dtype}".encode())
        flat = p.reshape(-1)
        n = flat.size
        sample = flat[:: max(1, n // 64)][:64]  # 64 values spread over the array
        h.update(np.array(sample.view(mx.uint8)).tobytes())
    return h.hexdigest()


def dtype_name(dtype: mx.Dtype) -> str:
    """``mx.float16`` -> ``"float16"``."""
    return str(dtype).rsplit(".", 1)[-1]
