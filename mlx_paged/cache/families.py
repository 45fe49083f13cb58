"""How each family's cache layout maps onto paged layers.

mlx-lm models describe their caches through ``model.make_cache()``; the list is
not always one entry per ``model.layers`` item, so we classify cache objects,
not layers.
"""

from __future__ import annotations

import ast
import inspect
import sys
from functools import cache

import mlx.nn as nn
from mlx_lm.models.cache import (
    ArraysCache,
    CacheList,
    ChunkedKVCache,
    KVCache,
    RotatingKVCache,
)

from ..blocks import LayerKind

#: Leading tokens mlx-lm's ``make_prompt_cache`` keeps under ``max_kv_size``.
SINK_TOKENS = 4


def model_type(model: nn.Module) -> str:
    """The model's ``model_type`` for error messages, or its class path."""
    name = getattr(model, "model_type", None) or getattr(
        getattr(model, "args", None), "model_type", None
    )
    return name or f"{type(model).__module__}.{type(model).__name__}"


def default_caches(model: nn.Module, max_kv_size: int | None = None) -> list:
    """What mlx-lm's ``make_prompt_cache(model, max_kv_size)`` would build.

    ``model.make_cache()`` where the model has one (mlx-lm then ignores
    ``max_kv_size``); else one ``RotatingKVCache(max_kv_size, keep=4)`` per
    layer, or one ``KVCache`` per layer without ``max_kv_size``. A hook set by
    ``install_paged_cache`` is looked through to the model's own.
    """
    make = getattr(model, "make_cache", None)
    make = getattr(make, "paged_original", make)
    if make is not None:
        return make()
    if max_kv_size is not None:
        return [RotatingKVCache(max_size=max_kv_size, keep=SINK_TOKENS) for _ in model.layers]
    return [KVCache() for _ in model.layers]


def classify(cache: object, family: str) -> LayerKind | None:
    """The paged kind replacing ``cache``, or ``None`` to keep it native.

    Raises:
        ValueError: for layouts mlx_paged cannot page, naming the model type.
    """
    if type(cache) is KVCache:
        return LayerKind()
    if type(cache) is RotatingKVCache:
        if cache.keep and not 0 < cache.keep < cache.max_size:
            raise ValueError(
                f"{family}: RotatingKVCache(max_size={cache.max_size}, keep={cache.keep}) keeps "
                "no window; max_kv_size must be larger than the kept tokens."
            )
        return LayerKind(window=cache.max_size, keep=cache.keep)
    if isinstance(cache, ArraysCache):
        return None  # recurrent / SSM state: small, per sequence, stays native
    if isinstance(cache, ChunkedKVCache):
        raise ValueError(
            f"{family}: ChunkedKVCache (chunked local attention) is not supported by mlx_paged; "
            "use mlx-lm's own cache for this model."
        )
    if isinstance(cache, CacheList):
        raise AssertionError("CacheList is unpacked by the caller")
    raise ValueError(
        f"{family}: cache type {type(cache).__name__} is not supported by mlx_paged "
        "(supported: KVCache, RotatingKVCache, ArraysCache, CacheList of those); "
        "use mlx-lm's own cache for this model."
    )


def attention_reads_kv_directly(model: nn.Module) -> bool:
    """Whether every attention of ``model`` hands ``update_and_fetch``'s K/V straight to
    ``scaled_dot_product_attention``, reading at most their ``.shape`` on the way.

    Decided from the source of the modules that define ``model``'s layers (what
    the model does with the K/V is not visible at run time). Only then may a
    decode step return stand-ins for K/V a fused kernel will read from the
    blocks itself: a model that transforms them (MLA) or keeps them would see
    stand-ins.
    """
    layers = model.modules() if isinstance(model, nn.Module) else [model]
    modules = {type(m).__module__ for m in layers}
    verdicts = [_module_reads_kv_directly(name) for name in sorted(modules)]
    return any(v is True for v in verdicts) and not any(v is False for v in verdicts)


#: mlx-lm modules whose recurrent layers keep a right-padded row's state (and convolution
#: window) at its last real token: they read ``ArraysCache.lengths`` throughout, and a
#: padded batch gives each request the tokens it gets alone, and each row the state it has
#: alone (``tests/test_hybrid.py``; qwen3_5_moe runs qwen3_5's layers).
#: nemotron_h reads ``lengths`` for its convolution only: its SSM state takes the padding.
PADDED_STATE_MODULES = frozenset(
    f"mlx_lm.models.{name}"
    for name in (
        *("bailing_hybrid", "bailing_moe_v3", "falcon_h1", "gear", "granitemoehybrid"),
        *("kimi_k3", "kimi_linear", "lfm2", "lfm2_moe", "mamba2", "plamo2", "qwen3_5"),
        "qwen3_next",
    )
)


def recurrent_state_takes_lengths(model: nn.Module) -> bool:
    """Whether ``model``'s recurrent layers come from ``PADDED_STATE_MODULES``, so that rows
    padded on the right past ``ArraysCache.lengths`` leave each row's state as its real
    tokens left it (otherwise only rows of equal lengths may share a forward)."""
    layers = model.modules() if isinstance(model, nn.Module) else [model]
    return any(type(m).__module__ in PADDED_STATE_MODULES for m in layers)


@cache
def _module_reads_kv_directly(name: str) -> bool | None:
    """``_reads_kv_directly`` of a module's source, and its ``scaled_dot_product_attention`` is
    mlx-lm's; ``None`` if it has no source to read."""
    module = sys.modules.get(name)
    try:
        source = inspect.getsource(module) if module is not None else None
    except (OSError, TypeError):
        source = None
    if source is None:
        return None
    verdict = _reads_kv_directly(source)
    if verdict:  # the name must be mlx-lm's function, which attention routing rebinds
        sdpa = getattr(module, "scaled_dot_product_attention", None)
        verdict = getattr(sdpa, "__module__", None) in _ROUTED
    return verdict


_ROUTED = ("mlx_lm.models.base", "mlx_paged.attention.routing")


def _reads_kv_directly(source: str) -> bool | None:
    """For ``x, y = <cache>.update_and_fetch(...)`` in ``source``: whether every later read of
    ``x``/``y`` is an argument of ``scaled_dot_product_attention`` or a ``.shape``;
    ``None`` where the source never calls ``update_and_fetch``."""
    tree = ast.parse(source)
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    found = False
    for node in ast.walk(tree):
        if not (
            isinstance(node, ast.Assign)
            and isinstance(node.value, ast.Call)
            and getattr(node.value.func, "attr", None) == "update_and_fetch"
        ):
            continue
        found = True
        names = {n.id for t in node.targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        for stmt in _statements_after(node, parents):
            for use in ast.walk(stmt):
                if isinstance(use, ast.Name) and use.id in names and isinstance(use.ctx, ast.Load):
                    if not _direct_use(use, parents[use]):
                        return False
            if isinstance(stmt, ast.Assign) and names & {
                n.id for t in stmt.targets for n in ast.walk(t) if isinstance(n, ast.Name)
            }:
                break  # rebound: later reads are of something else
    return True if found else None


def _statements_after(node: ast.AST, parents: dict) -> list[ast.stmt]:
    """Statements that may run after ``node`` in its function: later siblings at every level,
    and the whole body of each enclosing loop."""
    after: list[ast.stmt] = []
    while node in parents and not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        parent = parents[node]
        for field in ("body", "orelse", "finalbody"):
            block = getattr(parent, field, None)
            if isinstance(block, list) and node in block:
                after += block[block.index(node) + 1 :]
        if isinstance(parent, (ast.For, ast.While)):
            after += parent.body
        node = parent
    return after


def _direct_use(name: ast.Name, parent: ast.AST) -> bool:
    if isinstance(parent, ast.Attribute) and parent.attr == "shape":
        return True
    func = getattr(parent, "func", None)
    return (
        isinstance(parent, ast.Call)
        and name in parent.args
        and isinstance(func, ast.Name)
        and func.id == "scaled_dot_product_attention"
    )
