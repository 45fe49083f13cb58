"""Paged attention in plain MLX ops: the spec every fused kernel is checked against.

``reference_paged_decode`` reads through a ``PagedView`` exactly as a decode
kernel would (block tables, per-sequence ``starts``/``lengths``, sliding
``window``, ``sinks``), and ``reference_paged_prefill`` through a
``PrefillView`` as a prefill kernel would; both materialise the gathered K/V,
so they are for tests and self-checks, not speed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import mlx.core as mx

from ...blocks import COLD

if TYPE_CHECKING:
    from ..records import PagedView, PrefillView, Rope


def rotate(x: mx.array, positions: mx.array, rope: Rope, inverse: bool = False) -> mx.array:
    """``(B, H, 1, D)`` ``x`` rotated as ``rope`` rotates position ``positions[b]`` (by the
    opposite angles with ``inverse``), computed in float32 from ``rope.freqs``: its first
    ``2 * len(freqs)`` dimensions turn, the rest pass as they are."""
    angles = positions.astype(mx.float32)[:, None, None, None] * rope.freqs
    cos, sin = mx.cos(angles), mx.sin(angles) * (-1 if inverse else 1)
    x = x.astype(mx.float32)
    turned, rest = x[..., : 2 * rope.freqs.shape[0]], x[..., 2 * rope.freqs.shape[0] :]
    if rope.traditional:
        a, b = turned[..., 0::2], turned[..., 1::2]
        out = mx.stack([a * cos - b * sin, b * cos + a * sin], axis=-1).reshape(turned.shape)
    else:
        a, b = mx.split(turned, 2, axis=-1)
        out = mx.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)
    return mx.concatenate([out, rest], axis=-1)


def visible_range(view: PagedView) -> tuple[mx.array, mx.array]:
    """First and one-past-last visible position of each sequence, ``(B,)`` int32 each."""
    lo = view.starts
    if view.window is not None:
        lo = mx.maximum(lo, view.lengths - view.window)
    return lo, view.lengths


def reference_paged_decode(
    queries: mx.array, view: PagedView, scale: float, sinks: mx.array | None
) -> mx.array:
    """Decode attention of one query per sequence over its blocks, computed in float32.

    Args:
        queries: ``(B, n_heads, 1, k_head_dim)``; ``n_heads`` a multiple of ``n_kv_heads``.
        view: where the K/V of each sequence lie in the pool.
        scale: multiplies ``q @ k``.
        sinks: ``(n_heads,)`` extra softmax logits, or ``None``.

    Returns:
        ``(B, n_heads, 1, v_head_dim)`` in ``queries.dtype``.
    """
    B, n_heads, _, dk = queries.shape
    num_hot, bs, n_kv, _ = view.keys.shape
    dv = view.values.shape[-1]
    group = n_heads // n_kv
    max_blocks = view.block_tables.shape[1]
    T = max_blocks * bs

    # Table entries past a sequence's last block may be anything: read block 0 instead.
    needed = (view.lengths - view.starts + bs - 1) // bs  # (B,)
    cols = mx.arange(max_blocks)[None]  # (1, max_blocks)
    tables = mx.where(cols < needed[:, None], view.block_tables, 0)  # (B, max_blocks)
    pools = (view.keys, view.values)
    if view.cold is not None:  # cold block i follows the hot ones, dequantized
        cold = view.cold.dequantized()
        pools = tuple(
            mx.concatenate([p, c.astype(p.dtype)]) for p, c in zip(pools, cold, strict=True)
        )
        tables = mx.where(tables >= COLD, tables - COLD + num_hot, tables)

    pos = view.starts[:, None] + mx.arange(T)[None]  # (B, T) token position of each slot
    lo, hi = visible_range(view)
    valid = (pos >= lo[:, None]) & (pos < hi[:, None])  # (B, T)

    def gather(pool: mx.array, d: int) -> mx.array:
        x = pool[tables].astype(mx.float32)  # (B, max_blocks, bs, n_kv, d)
        x = x.reshape(B, T, n_kv, d).transpose(0, 2, 1, 3)  # (B, n_kv, T, d)
        # Unwritten slots may hold NaN/inf; zero them so 0 * garbage stays 0.
        return mx.where(valid[:, None, :, None], x, 0.0)

    k = gather(pools[0], dk)  # (B, n_kv, T, dk)
    v = gather(pools[1], dv)  # (B, n_kv, T, dv)
    q = queries.astype(mx.float32).reshape(B, n_kv, group, dk)  # (B, n_kv, group, dk)
    scores = (q @ k.swapaxes(-1, -2)) * scale  # (B, n_kv, group, T)
    scores = mx.where(valid[:, None, None, :], scores, -mx.inf)
    if sinks is not None:
        sink = mx.broadcast_to(
            sinks.astype(mx.float32).reshape(1, n_kv, group, 1), (B, n_kv, group, 1)
        )
        scores = mx.concatenate([scores, sink], axis=-1)  # (B, n_kv, group, T + 1)
    probs = mx.softmax(scores, axis=-1)[..., :T]  # (B, n_kv, group, T)
    out = probs @ v  # (B, n_kv, group, dv)
    return out.reshape(B, n_heads, 1, dv).astype(queries.dtype)


def reference_paged_prefill(queries: mx.array, view: PrefillView, scale: float) -> mx.array:
    """Attention of ``L`` queries per sequence over its blocks, computed in float32.

    Args:
        queries: ``(B, n_heads, L, head_dim)``; ``n_heads`` a multiple of ``n_kv_heads``.
        view: where the K/V of each sequence lie, and where its queries sit.
        scale: multiplies ``q @ k``.

    Returns:
        ``(B, n_heads, L, head_dim)`` in ``queries.dtype``; zeros for a query that sees no
        key (right padding past a sliding window).
    """
    B, n_heads, n, d = queries.shape
    bs, n_kv = view.keys.shape[1], view.keys.shape[2]
    group = n_heads // n_kv
    max_blocks = view.block_tables.shape[1]
    T = max_blocks * bs
    real = mx.maximum(view.lengths, view.offsets + 1)
    # Table entries past a sequence's last block may be anything: read block 0 instead.
    needed = (real - view.starts + bs - 1) // bs
    tables = mx.where(mx.arange(max_blocks)[None] < needed[:, None], view.block_tables, 0)
    pos = view.starts[:, None, None] + mx.arange(T)[None, None]  # (B, 1, T)
    query = view.offsets[:, None, None] + mx.arange(n)[None, :, None]  # (B, L, 1)
    valid = (pos <= query) & (pos < real[:, None, None]) & (pos >= view.starts[:, None, None])
    if view.window is not None:
        valid = valid & (pos > query - view.window)  # (B, L, T)
    written = pos[:, 0] < real[:, None]  # (B, T)

    def gather(pool: mx.array) -> mx.array:
        x = pool[tables].astype(mx.float32).reshape(B, T, n_kv, d).transpose(0, 2, 1, 3)
        return mx.where(written[:, None, :, None], x, 0.0)  # (B, n_kv, T, d)

    k, v = gather(view.keys), gather(view.values)
    q = queries.astype(mx.float32).reshape(B, n_kv, group, n, d)
    scores = (q @ k[:, :, None].swapaxes(-1, -2)) * scale  # (B, n_kv, group, L, T)
    scores = mx.where(valid[:, None, None], scores, -mx.inf)
    out = mx.softmax(scores, axis=-1) @ v[:, :, None]  # (B, n_kv, group, L, d)
    # A padding query a window keeps from every real key sees nothing: zeros, not NaN.
    out = mx.where(valid.any(axis=-1)[:, None, None, :, None], out, 0.0)
    return out.reshape(B, n_heads, n, d).astype(queries.dtype)
