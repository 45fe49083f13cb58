"""A model's sibling projections of one input as one matmul: q/k/v, and gate/up.

A host-bound decode step costs about the same per primitive it dispatches, and a
llama layer's seven projections are seven matmuls (each with its weight's
transpose and the reshapes around it). ``fuse_projections`` concatenates the
weights of each module's ``q_proj``/``k_proj``/``v_proj`` and ``gate_proj``/``up_proj``
into one layer (``fused_qkv``, ``fused_gate_up``) and puts in their place parts that
take their columns of its output. The first part called with an input runs the
fused layer; the others called with the same array take their columns of that
output. Any other input runs the fused layer again, so a model that feeds the parts
different inputs still gets the right values, only without the saving.

Plain ``nn.Linear`` and ``nn.QuantizedLinear`` layers of one kind, dtype and
quantization are fused; anything else (sharded layers, other classes) is left as
it is. A prototype for measuring the saving (``decode_step.py --fuse-projections``),
not part of the package.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
NAMES = {("q_proj", "k_proj", "v_proj"): "fused_qkv", ("gate_proj", "up_proj"): "fused_gate_up"}


class Shared:
    """The fused layer and the last input's output columns (not a module: its layer is
    registered once, on the parent)."""

    def __init__(self, layer: nn.Module, widths: list[int]):
        self.layer = layer
        self.bounds = [sum(widths[:i]) for i in range(1, len(widths))]
        self.input: mx.array | None = None
        self.outputs: list[mx.array] = []
        self.left: set[int] = set()

    def part(self, i: int, x: mx.array) -> mx.array:
        if x is not self.input or i not in self.left:
            self.input = x
            self.outputs = mx.split(self.layer(x), self.bounds, axis=-1)
            self.left = set(range(len(self.bounds) + 1))
        self.left.discard(i)
        out = self.outputs[i]
        if not self.left:  # every part taken: hold no arrays between calls
            self.input, self.outputs = None, []
        return out


class Part(nn.Module):
    """Columns ``i`` of a ``Shared`` layer's output."""

    def __init__(self, shared: Shared, i: int):
        super().__init__()
        object.__setattr__(self, "shared", shared)  # not a child: no second copy of its weights
        self.i = i

    def __call__(self, x: mx.array) -> mx.array:
        return self.shared.part(self.i, x)


def _fused_layer(layers: list[nn.Module]) -> nn.Module | None:
    """One layer with the rows of ``layers``' weights, or ``None`` if they differ in kind."""
    kind = type(layers[0])
    if kind not in (nn.Linear, nn.QuantizedLinear) or any(type(x) is not kind for x in layers):
        return None
    biased = ["bias" in x for x in layers]
    if any(biased) and not all(biased):
        return None
    first = layers[0]
    if kind is nn.QuantizedLinear:
        spec = (first.group_size, first.bits, first.mode)
        if any((x.group_size, x.bits, x.mode) != spec for x in layers):
            return None
        fused = nn.QuantizedLinear.__new__(nn.QuantizedLinear)
        nn.Module.__init__(fused)
        fused.group_size, fused.bits, fused.mode = spec
        names = ["weight", "scales"] + (["biases"] if first.get("biases") is not None else [])
    else:
        fused = nn.Linear.__new__(nn.Linear)
        nn.Module.__init__(fused)
        names = ["weight"]
    for name in names + (["bias"] if biased[0] else []):
        setattr(fused, name, mx.concatenate([x[name] for x in layers], axis=0))
    if kind is nn.QuantizedLinear:
        fused.freeze()
    return fused


def fuse_projections(model: nn.Module) -> int:
    """Fuse every module's q/k/v and gate/up projections in place; return the groups fused."""
    fused = 0
    for _, module in model.named_modules():
        for group in GROUPS:
            if not all(name in module and isinstance(module[name], nn.Module) for name in group):
                continue
            layers = [module[name] for name in group]
            layer = _fused_layer(layers)
            if layer is None:
                continue
            shared = Shared(layer, [x.weight.shape[0] for x in layers])
            setattr(module, NAMES[group], layer)
            for i, name in enumerate(group):
                setattr(module, name, Part(shared, i))
            fused += 1
    mx.eval(model.parameters())
    return fused
