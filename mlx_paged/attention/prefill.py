"""Prefill attention in plain MLX ops, for the shapes where CUDA's fused SDPA costs most.

On MLX's CUDA backend, ``mx.fast.scaled_dot_product_attention`` with more than
one query runs cuDNN's fused attention, which builds a graph for every new
``(B, heads, queries, keys)`` shape: about 45 ms on an H100, paid the first time
each shape comes (BENCHMARKS.md, run 142). A server's batched prefills rarely
repeat a shape, since suffix lengths, batch rows and table widths all vary, so
most of them pay it. For small score matrices the unfused computation (two
matmuls and a softmax, as MLX computes attention where it has no fused kernel)
costs a fraction of a millisecond per layer and builds nothing.

``use_ops`` says which calls take it: on the CUDA backend, more than one query,
no attention sinks, and at most ``MAX_SCORES`` score elements. Larger calls (a
long prompt's chunks against many keys) keep the fused kernel, whose memory
traffic does not grow with the score matrix. Metal and the CPU are unchanged:
neither builds per-shape graphs.
"""

from __future__ import annotations

import mlx.core as mx

#: Score elements (``B * heads * queries * keys``) up to which a CUDA prefill call uses
#: ``attention_by_ops``: 2**26 is 128 MB of float16 scores per layer, about 0.2 ms
#: of memory traffic on an H100, against a 45 ms graph build for a new shape.
MAX_SCORES = 1 << 26


def use_ops(queries: mx.array, keys: mx.array, sinks: mx.array | None) -> bool:
    """Whether this attention call should run ``attention_by_ops`` instead of MLX's SDPA."""
    b, h, n, _ = queries.shape
    if n == 1 or sinks is not None or b * h * n * keys.shape[2] > MAX_SCORES:
        return False
    return on_cuda()


def on_cuda() -> bool:
    """Whether the default device is a GPU of MLX's CUDA backend."""
    return mx.default_device() == mx.gpu and mx.cuda.is_available()


def attention_by_ops(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    scale: float,
    mask: mx.array | str | None,
) -> mx.array:
    """``mx.fast.scaled_dot_product_attention`` (no sinks) computed with matmuls and a softmax.

    Args:
        queries: ``(B, n_heads, L, D)``.
        keys, values: ``(B, n_kv_heads, T, D)``; ``n_heads`` a multiple of ``n_kv_heads``.
        scale: applied to the queries.
        mask: ``None``, ``"causal"`` (the last query sees every key), or an array that
            broadcasts to ``(B, n_heads, L, T)``: boolean (``True`` = may attend) or additive.
    """
    b, h, n, d = queries.shape
    kv_heads, t = keys.shape[1], keys.shape[2]
    rep = h // kv_heads
    q = queries * mx.array(scale, queries.dtype)
    if rep > 1:  # (B, kv_heads, rep, L, D) against (B, kv_heads, 1, T, D)
        q = q.reshape(b, kv_heads, rep, n, d)
        keys, values = keys[:, :, None], values[:, :, None]
    scores = q @ keys.swapaxes(-1, -2)
    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f"unknown attention mask {mask!r}.")
        mask = (mx.arange(t - n, t)[:, None] >= mx.arange(t)[None]) if n > 1 else None
    if mask is not None:
        if rep > 1 and mask.ndim == 4:  # heads axis: 1 or n_heads
            m = mask.shape[1]
            mask = mask[:, :, None] if m == 1 else mask.reshape(-1, kv_heads, rep, *mask.shape[2:])
        if mask.dtype == mx.bool_:
            scores = mx.where(mask, scores, mx.array(mx.finfo(scores.dtype).min, scores.dtype))
        else:
            scores = scores + mask.astype(scores.dtype)
    out = mx.softmax(scores, axis=-1, precise=True) @ values
    return out.reshape(b, h, n, -1) if rep > 1 else out
