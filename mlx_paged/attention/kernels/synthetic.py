"""Random paged batches for self-checks, tests and benchmarks."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from ...blocks import COLD
from ...storage.cold import ColdLayout
from ..records import ColdView, PagedView, PrefillView


@dataclass
class PagedBatch:
    """A decode batch laid out in a pool, plus its K/V as dense arrays for comparison."""

    queries: mx.array  # (B, n_heads, 1, dk)
    view: PagedView
    sinks: mx.array | None  # (n_heads,)
    dense_keys: list[mx.array]  # per sequence (1, n_kv, T_b, dk): its retained tokens
    dense_values: list[mx.array]  # per sequence (1, n_kv, T_b, dv)


def random_paged_batch(
    lengths: list[int],
    n_heads: int = 4,
    n_kv_heads: int = 2,
    dk: int = 64,
    dv: int | None = None,
    block_size: int = 16,
    dtype: mx.Dtype = mx.float32,
    window: int | None = None,
    sinks: bool = False,
    first_blocks: list[int] | None = None,
    shuffle: bool = True,
    spare_blocks: int = 3,
    seed: int = 0,
    kv_bits: int | None = None,
    group_size: int = 64,
) -> PagedBatch:
    """Build a pool holding ``len(lengths)`` sequences in (optionally shuffled) blocks.

    Args:
        lengths: tokens written per sequence (the query sits at ``length - 1``).
        first_blocks: leading blocks each sequence already gave back (sliding
            layers); their tokens are not in the pool.
        shuffle: scatter blocks over the pool in random order (fragmentation).
        spare_blocks: unused blocks filled with huge values, so a kernel that
            reads outside the tables shows it.
        kv_bits, group_size: with ``kv_bits``, two of every three blocks of a
            sequence except its last move to a cold tier quantized this way; the
            dense K/V hold their dequantized values and their hot copies garbage.
    """
    dv = dk if dv is None else dv
    B = len(lengths)
    first_blocks = first_blocks or [0] * B
    key = mx.random.key(seed)
    kq, kk, kv, ks, kp = mx.random.split(key, 5)
    counts = [-(-n // block_size) - f for n, f in zip(lengths, first_blocks, strict=True)]
    total = sum(counts) + spare_blocks
    order = mx.random.permutation(total, key=kp).tolist() if shuffle else list(range(total))
    keys = mx.random.normal((total, block_size, n_kv_heads, dk), key=kk).astype(dtype)
    values = mx.random.normal((total, block_size, n_kv_heads, dv), key=kv).astype(dtype)
    # Slots past each sequence's length, and spare blocks, hold garbage.
    junk_ids = mx.array(order[sum(counts) :], dtype=mx.int32)
    if spare_blocks:
        keys[junk_ids] = mx.array(6e4, dtype=dtype)
        values[junk_ids] = mx.array(6e4, dtype=dtype)
    max_blocks = max(max(counts), 1)
    cold_k: list = []
    cold_v: list = []
    if kv_bits and max(counts) < 2:  # no block to move: give the tier one unused block
        for held, d in ((cold_k, dk), (cold_v, dv)):
            zero = mx.zeros((block_size, n_kv_heads, d), dtype=dtype)
            held.append(mx.quantize(zero, group_size=group_size, bits=kv_bits))
    tables, dense_k, dense_v, at = [], [], [], 0
    for n, f, c in zip(lengths, first_blocks, counts, strict=True):
        ids = order[at : at + c]
        at += c
        # Rows past the last block hold arbitrary ids (here: spare or other sequences' blocks).
        tables.append(ids + [order[(at + 7 * j) % total] for j in range(max_blocks - c)])
        idx = mx.array(ids, dtype=mx.int32)
        tail = n - (f + c - 1) * block_size  # tokens in the last block
        if tail < block_size:
            keys[idx[-1], tail:] = mx.array(6e4, dtype=dtype)
            values[idx[-1], tail:] = mx.array(6e4, dtype=dtype)
        t = n - f * block_size
        bk, bv = keys[idx], values[idx]
        picks = [j for j in range(c - 1) if j % 3 != 2] if kv_bits else []
        for j in picks:
            tables[-1][j] = COLD + len(cold_k)
            for x, held in ((bk, cold_k), (bv, cold_v)):
                parts = mx.quantize(x[j], group_size=group_size, bits=kv_bits)
                held.append(parts)
                x[j] = mx.dequantize(*parts, group_size=group_size, bits=kv_bits).astype(dtype)
        if picks:  # the hot copies of cold blocks are never to be read
            mx.eval(bk, bv)
            moved = idx[mx.array(picks)]
            keys[moved] = mx.array(6e4, dtype=dtype)
            values[moved] = mx.array(6e4, dtype=dtype)
        dense_k.append(bk.reshape(-1, n_kv_heads, dk)[:t].swapaxes(0, 1)[None])
        dense_v.append(bv.reshape(-1, n_kv_heads, dv)[:t].swapaxes(0, 1)[None])
    view = PagedView(
        keys=keys,
        values=values,
        block_tables=mx.array(tables, dtype=mx.int32),
        starts=mx.array([f * block_size for f in first_blocks], dtype=mx.int32),
        lengths=mx.array(lengths, dtype=mx.int32),
        window=window,
        cold=_cold_view(cold_k, cold_v, kv_bits, group_size) if kv_bits else None,
    )
    queries = mx.random.normal((B, n_heads, 1, dk), key=kq).astype(dtype)
    sink_arr = mx.random.normal((n_heads,), key=ks) if sinks else None
    mx.eval(view.keys, view.values, queries, *dense_k, *dense_v)
    return PagedBatch(queries, view, sink_arr, dense_k, dense_v)


def _cold_view(keys: list, values: list, bits: int, group_size: int) -> ColdView:
    """The cold blocks stacked into a ``ColdView`` of layer 1 of three: layers 0 and 2
    hold the same blocks with scales and biases far off, so a kernel that reads another
    layer's rows shows it."""
    k, v = ([mx.stack([p[i] for p in held]) for i in range(3)] for held in (keys, values))
    layout = ColdLayout.of(k, v)
    junk = [(w, s + 1000, b + 3e4) for w, s, b in (k, v)]
    layers = [layout.join(*junk), layout.join(k, v), layout.join(*junk)]
    return ColdView(mx.stack(layers), layout, bits, group_size, layer=1)


def dense_decode(batch: PagedBatch, scale: float) -> mx.array:
    """The batch's attention computed per sequence with MLX's SDPA on contiguous K/V."""
    outs = []
    sinks = None if batch.sinks is None else batch.sinks.astype(batch.queries.dtype)
    window = batch.view.window
    for b, (k, v) in enumerate(zip(batch.dense_keys, batch.dense_values, strict=True)):
        if window is not None and k.shape[2] > window:
            k, v = k[:, :, -window:], v[:, :, -window:]
        outs.append(
            mx.fast.scaled_dot_product_attention(
                batch.queries[b : b + 1], k, v, scale=scale, sinks=sinks
            )
        )
    return mx.concatenate(outs)


def random_prefill_batch(
    offsets: list[int],
    counts: list[int],
    n_new: int,
    n_heads: int = 4,
    n_kv_heads: int = 2,
    head_dim: int = 64,
    block_size: int = 16,
    dtype: mx.Dtype = mx.float32,
    window: int | None = None,
    first_blocks: list[int] | None = None,
    seed: int = 0,
) -> tuple[mx.array, PrefillView]:
    """Queries and a pool for a batched prefill forward of ``n_new`` queries per sequence.

    Sequence ``b`` holds ``offsets[b] + counts[b]`` tokens (at least ``offsets[b] + 1``)
    in shuffled blocks, less its ``first_blocks[b]`` given-back ones; its queries sit at
    ``offsets[b]``, ``offsets[b] + 1``, .., of which ``counts[b]`` are real (the rest
    right padding). Unwritten slots and spare blocks hold huge values.
    """
    lengths = [o + max(c, 1) for o, c in zip(offsets, counts, strict=True)]
    batch = random_paged_batch(
        lengths,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        dk=head_dim,
        block_size=block_size,
        dtype=dtype,
        window=window,
        first_blocks=first_blocks,
        seed=seed,
    )
    v = batch.view
    queries = mx.random.normal((len(offsets), n_heads, n_new, head_dim), key=mx.random.key(seed))
    view = PrefillView(
        keys=v.keys,
        values=v.values,
        block_tables=v.block_tables,
        starts=v.starts,
        offsets=mx.array(offsets, dtype=mx.int32),
        lengths=mx.array([o + c for o, c in zip(offsets, counts, strict=True)], dtype=mx.int32),
        window=window,
    )
    queries = queries.astype(dtype)
    mx.eval(queries)
    return queries, view
