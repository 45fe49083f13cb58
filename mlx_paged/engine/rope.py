"""Decode steps whose attention kernel applies the layers' RoPE itself.

A llama layer rotates its queries and its new keys with two RoPE launches before its
attention: 32 of a llama-1B decode step's launches, 62-131 us of host dispatch on an
H200 (BENCHMARKS.md, run 598), where a step of few streams takes the host 1.8-3 ms.
``rope_in_kernel(model)`` gives each supported attention layer a ``KernelRoPE`` in place
of its RoPE: while the engine runs a decode step whose attention goes to the CUDA decode
kernel, it returns its input as it is, and the step's caches hand the kernel the layer's
angles (``PagedView.rope``); the kernel rotates the queries as it loads them and the new
keys as it stores them. Any other forward (prefills, other devices, mlx-lm's own caches)
rotates as before, and a decode call that no kernel takes rotates in the cache and the
attention fallback (``StepPagedKVCache``).

Supported: the attention layers of mlx-lm's llama, qwen2, qwen3, qwen3_moe and gemma3_text
modules, and of qwen3_next (the attention layers of the qwen3_next, qwen3_5 and qwen3_5_moe
hybrids), each of which rotates its queries, then its keys, then calls ``update_and_fetch``,
with ``nn.RoPE`` or mlx-lm's ``Llama3RoPE``. A rotation of the head's leading dimensions
only (qwen3_next's quarter of the head) turns those and leaves the rest.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import contextmanager

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..attention import Rope

#: Attention layer classes (by module) whose call order the deferral relies on.
MODULES = tuple(
    f"mlx_lm.models.{name}"
    for name in ("llama", "qwen2", "qwen3", "qwen3_moe", "gemma3_text", "qwen3_next")
)


class RopeSwitch:
    """Whether the layers' ``KernelRoPE`` leave their rotation to the kernel (one per model)."""

    def __init__(self) -> None:
        self.on = False

    @contextmanager
    def deferring(self, on: bool = True):
        """Within: the layers rotate nothing (with ``on``)."""
        before, self.on = self.on, on
        try:
            yield
        finally:
            self.on = before


class KernelRoPE(nn.Module):
    """A layer's RoPE that rotates nothing while its switch is on."""

    def __init__(self, rope: nn.Module, spec: Rope, switch: RopeSwitch):
        super().__init__()
        self.inner = rope
        self._spec, self._switch = spec, switch

    @property
    def spec(self) -> Rope:
        """The rotation, for the kernel (``PagedView.rope``)."""
        return self._spec

    @property
    def switch(self) -> RopeSwitch:
        return self._switch

    def __call__(self, x: mx.array, offset: int | mx.array = 0) -> mx.array:
        return x if self._switch.on else self.inner(x, offset=offset)


def rope_spec(rope: nn.Module) -> Rope | None:
    """The kernel's description of ``rope``, or ``None`` for a kind it does not rotate as."""
    kind = type(rope)
    if kind is nn.RoPE:
        half = np.arange(0, rope.dims, 2, dtype=np.float64) / rope.dims
        freqs = rope.scale * rope.base**-half
    elif kind.__name__ == "Llama3RoPE" and kind.__module__ == "mlx_lm.models.rope_utils":
        freqs = 1.0 / np.array(rope._freqs, dtype=np.float64)  # its scale is 1
    else:
        return None

    def apply(x: mx.array, offset: mx.array) -> mx.array:
        return rope(x, offset=offset)

    return Rope(mx.array(freqs.astype(np.float32)), bool(rope.traditional), apply)


def _attention(layer: nn.Module) -> nn.Module | None:
    attn = getattr(layer, "self_attn", None)
    if attn is None or type(attn).__module__ not in MODULES or not hasattr(attn, "rope"):
        return None
    return attn


def rope_in_kernel(model: nn.Module) -> int:
    """Give each supported attention layer of ``model`` a ``KernelRoPE``; return how many.

    Changes nothing a forward computes by itself: a ``PagedEngine`` on CUDA then leaves
    the rotation of its decode steps to the attention kernel. Calling it again adds none.
    """
    switch, count = None, 0
    for layer in getattr(model, "layers", []):
        attn = _attention(layer)
        if attn is None:
            continue
        if isinstance(attn.rope, KernelRoPE):
            switch = attn.rope.switch
            continue
        spec = rope_spec(attn.rope)
        if spec is None:
            continue
        switch = switch or RopeSwitch()
        attn.rope = KernelRoPE(attn.rope, spec, switch)
        count += 1
    return count


def kernel_ropes(model: nn.Module) -> tuple[RopeSwitch, Sequence[Rope | None]] | None:
    """The switch and each layer's rotation (``None`` where it rotates itself) of a model
    ``rope_in_kernel`` changed, or ``None``."""
    ropes = [
        attn.rope if (attn := _attention(layer)) is not None else None
        for layer in getattr(model, "layers", [])
    ]
    found = [r for r in ropes if isinstance(r, KernelRoPE)]
    if not found:
        return None
    return found[0].switch, [r.spec if isinstance(r, KernelRoPE) else None for r in ropes]
