"""A model's sibling projections of one input as one matmul: q/k/v, and gate/up.

A decode step at small and middle batch sizes is host-bound, and its host time grows
with the primitives it dispatches: a llama layer's seven projections are seven matmuls,
each with its weight's transpose and the reshapes around it. ``fuse_projections``
concatenates the weights of each module's ``q_proj``/``k_proj``/``v_proj`` and
``gate_proj``/``up_proj`` into one layer (``fused_qkv``, ``fused_gate_up``) and puts in
their place parts that take their columns of its output: the first part called with an
input runs the fused layer, its siblings called with the same array take their columns.
On an H200 the engine's decode step ran 1.05x-1.11x as fast (BENCHMARKS.md, run 456).

Only groups whose members all take the same input are fused, as seen in one forward of
one token before anything changes; a model whose forward cannot run without a cache,
or any other group, is left as it is. Plain ``nn.Linear`` and ``nn.QuantizedLinear``
layers of one kind, dtype and quantization are fused; sharded layers (which talk to
their peers) and other classes are not. The fused model computes the same values, but
its modules change: load adapters and shard before fusing, not after.

Fuse a model loaded lazily (``mlx_lm.load(..., lazy=True)``), then evaluate its
parameters: each fused layer is then read from the weights into its own arrays, one group
at a time. Fusing an evaluated model holds both copies at once; on CUDA the process kept
that peak (1.2 GB more for a llama-1B, BENCHMARKS.md run 461) after MLX freed the old ones.
"""

from __future__ import annotations

import logging

import mlx.core as mx
import mlx.nn as nn

logger = logging.getLogger("mlx_paged.engine")

#: Sibling projections of one input, and the fused layer's name.
GROUPS = {("q_proj", "k_proj", "v_proj"): "fused_qkv", ("gate_proj", "up_proj"): "fused_gate_up"}


class Shared:
    """The fused layer and its output columns for the last input (not a module: the layer
    is registered once, on the parent)."""

    def __init__(self, layer: nn.Module, widths: list[int]):
        self.layer = layer
        self.bounds = [sum(widths[:i]) for i in range(1, len(widths))]
        self.input: mx.array | None = None
        self.outputs: list[mx.array] = []
        self.left: set[int] = set()

    def part(self, i: int, x: mx.array) -> mx.array:
        """Columns ``i`` of the fused layer's output for ``x``."""
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
    """Columns ``i`` of a ``Shared`` layer's output, where a projection was."""

    def __init__(self, shared: Shared, i: int):
        super().__init__()
        object.__setattr__(self, "shared", shared)  # not a child: no second copy of its weights
        self.i = i

    def __call__(self, x: mx.array) -> mx.array:
        return self.shared.part(self.i, x)


class _Recorder(nn.Module):
    """A projection that notes the inputs it is called with (for the probe)."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        object.__setattr__(self, "inner", inner)
        object.__setattr__(self, "inputs", [])

    def __call__(self, x: mx.array) -> mx.array:
        self.inputs.append(x)
        return self.inner(x)


def fuse_projections(model: nn.Module) -> int:
    """Fuse every module's q/k/v and gate/up projections in place; return the groups fused.

    Each group's members must take the same input in a forward of one token (checked
    first); a model whose forward fails without a cache is left as it is (0).

    Raises:
        ValueError: for a ``model`` that is not an ``mlx.nn.Module``.
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"fuse_projections takes an mlx.nn.Module, got {type(model).__name__}.")
    candidates = [
        (module, group)
        for _, module in model.named_modules()
        for group in GROUPS
        if _fusable([module.get(name) for name in group])
    ]
    if not candidates:
        return 0
    fused = 0
    for module, group in _same_input(model, candidates):
        layers = [module[name] for name in group]
        layer = _fused_layer(layers)
        mx.eval(layer.parameters())  # made now: the parts' own weights go as each group is done
        shared = Shared(layer, [x.weight.shape[0] for x in layers])
        setattr(module, GROUPS[group], layer)
        for i, name in enumerate(group):
            setattr(module, name, Part(shared, i))
        fused += 1
    return fused


def _fusable(layers: list[object]) -> bool:
    """Whether ``layers`` are plain linear layers of one kind, dtype, bias and quantization."""
    kind = type(layers[0])
    if kind not in (nn.Linear, nn.QuantizedLinear) or any(type(x) is not kind for x in layers):
        return False
    first = layers[0]
    kept = ("bias" in first, first.weight.dtype)
    if any(("bias" in x, x.weight.dtype) != kept for x in layers):
        return False
    if kind is nn.QuantizedLinear:
        spec = (first.group_size, first.bits, first.mode, "biases" in first)
        return all((x.group_size, x.bits, x.mode, "biases" in x) == spec for x in layers)
    return True


def _same_input(model: nn.Module, candidates: list[tuple[nn.Module, tuple[str, ...]]]) -> list:
    """The candidates whose members were each called with the same inputs, in the same
    order, in one forward of one token (none if that forward fails)."""
    recorders = {}
    for module, group in candidates:
        for name in group:
            recorders[id(module), name] = _Recorder(module[name])
            setattr(module, name, recorders[id(module), name])
    try:
        model(mx.array([[0]]))
    except Exception as e:  # a model that needs its cache, or its own inputs: left as it is
        logger.info("mlx_paged: projections not fused (a probe forward failed: %s)", e)
        return []
    finally:
        for module, group in candidates:
            for name in group:
                setattr(module, name, recorders[id(module), name].inner)
    same = []
    for module, group in candidates:
        calls = [recorders[id(module), name].inputs for name in group]
        if calls[0] and all(
            len(c) == len(calls[0]) and all(a is b for a, b in zip(c, calls[0], strict=True))
            for c in calls
        ):
            same.append((module, group))
    return same


def _fused_layer(layers: list[nn.Module]) -> nn.Module:
    """One layer with the rows of ``layers``' weights (``_fusable`` ones)."""
    first = layers[0]
    if type(first) is nn.QuantizedLinear:
        fused = nn.QuantizedLinear.__new__(nn.QuantizedLinear)
        nn.Module.__init__(fused)
        fused.group_size, fused.bits, fused.mode = first.group_size, first.bits, first.mode
        names = ["weight", "scales"] + (["biases"] if "biases" in first else [])
    else:
        fused = nn.Linear.__new__(nn.Linear)
        nn.Module.__init__(fused)
        names = ["weight"]
    for name in names + (["bias"] if "bias" in first else []):
        setattr(fused, name, mx.concatenate([x[name] for x in layers], axis=0))
    if type(first) is nn.QuantizedLinear:
        fused.freeze()
    return fused
