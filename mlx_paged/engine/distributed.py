"""One engine over several processes: sharding checks, shared inputs, agreement checks.

Under ``mlx.launch`` every rank runs the same ``PagedEngine`` over its shard of
the model: by tensor (``model.shard(group)``: each rank holds its share of the
attention heads, so its pools hold only those heads' K/V), or by pipeline stage
(``model.model.pipeline(group)``: each rank holds a run of layers and their
K/V). The pure-Python scheduler is replicated: fed the same requests and aborts
in the same order, every rank makes the same admissions, block ids, prefix
adoptions and preemptions. ``share`` sends rank 0's inputs to the others;
``Agreement`` checks before each step that the ranks' states match and stops
the job, naming the step, when they do not. Where a rank's own data decides a
step (the disk tier's files, each rank's shard of them), ``Ranks`` makes the
ranks settle on one answer first.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from .scheduler import Scheduler

# Heads a model's config names, by the names mlx-lm's ModelArgs use.
_HEAD_FIELDS = ("num_attention_heads", "num_key_value_heads", "n_heads", "n_kv_heads")


def shard_model(model: nn.Module, group: mx.distributed.Group, pipeline: bool = False) -> nn.Module:
    """Shard ``model`` across ``group`` in place: by tensor (mlx-lm's ``model.shard``), or
    with ``pipeline`` by layers (``model.model.pipeline``: each rank keeps a run of
    layers, and its pools hold only theirs).

    Raises:
        ValueError: the model has no ``shard``/``pipeline`` (its mlx-lm file cannot
            split it that way), its heads or layers do not divide among the ranks, or
            (``pipeline``) the ranks cannot send each other arrays (``check_links``);
            the message names the reason.
    """
    n = group.size()
    kind = getattr(getattr(model, "args", None), "model_type", type(model).__name__)
    if pipeline:
        inner = getattr(model, "model", None)
        if not hasattr(inner, "pipeline"):
            raise ValueError(
                f"{kind} cannot be split by pipeline stage: its mlx-lm model has no pipeline()."
            )
        if len(inner.layers) < n:
            raise ValueError(f"{kind} has {len(inner.layers)} layers, fewer than {n} ranks.")
        check_links(group)
        inner.pipeline(group)
        return model
    if not hasattr(model, "shard"):
        raise ValueError(
            f"{kind} cannot be sharded by tensor: its mlx-lm model has no shard() method."
        )
    args = getattr(model, "args", None)
    for name in _HEAD_FIELDS:
        heads = getattr(args, name, None)
        if isinstance(heads, int) and heads % n:
            raise ValueError(f"{kind} cannot be sharded over {n} ranks: {name}={heads}.")
    try:
        model.shard(group)
    except ValueError as e:  # a weight that does not divide
        raise ValueError(f"{kind} cannot be sharded over {n} ranks: {e}") from e
    return model


def check_links(group: mx.distributed.Group) -> None:
    """Raise ValueError unless each rank of ``group`` can ``send`` to the next and ``recv``
    from the one before, as pipeline stages do: MLX 0.32's CUDA backend has neither
    ("Send has no CUDA implementation", BENCHMARKS.md run 225). The ranks trade their
    rank numbers, even ranks sending first, so that none waits on another's send."""
    r, n = group.rank(), group.size()
    mine = mx.array([r], mx.int32)
    try:
        if r % 2 == 0:
            mx.eval(mx.distributed.send(mine, (r + 1) % n, group=group))
        got = mx.distributed.recv_like(mine, (r - 1) % n, group=group)
        mx.eval(got)
        if r % 2:
            mx.eval(mx.distributed.send(mine, (r + 1) % n, group=group))
    except RuntimeError as e:
        raise ValueError(
            f"pipeline stages cannot run on {mx.default_device()}: ranks cannot send each "
            f"other arrays here ({e}); shard by tensor instead (no --pipeline)."
        ) from e
    if got.item() != (r - 1) % n:
        raise ValueError(f"rank {r} received {got.item()} from rank {(r - 1) % n}.")


def join_ranks(
    model: nn.Module, seed: int | None = None, pipeline: bool = False
) -> mx.distributed.Group | None:
    """Under ``mlx.launch`` (several ranks): shard ``model`` across them (by tensor, or by
    layers with ``pipeline``) and seed every rank's random stream alike (``seed``, or rank
    0's pick). ``None`` when alone.

    Raises:
        ValueError: from ``shard_model``.
    """
    group = mx.distributed.init()
    if group.size() == 1:
        return None
    shard_model(model, group, pipeline)
    mx.random.seed(share(random.getrandbits(31) if seed is None else seed, group))
    return group


def share(obj: Any, group: mx.distributed.Group) -> Any:
    """Rank 0's ``obj``, on every rank (pickled, summed with zeros from the others)."""
    if group.size() == 1:
        return obj
    data = mx.array(list(pickle.dumps(obj)), mx.uint8) if group.rank() == 0 else None
    size = mx.array(data.size if data is not None else 0)
    size = mx.distributed.all_sum(size, group=group).item()
    if data is None:
        data = mx.zeros(size, mx.uint8)
    data = mx.distributed.all_sum(data, group=group)
    # Evaluated by mx.eval, which lets go of the GIL while it waits; ``bytes`` of an
    # unevaluated array would wait holding it, and a rank that hangs there would stop
    # every other thread of this process too (the server's timeout watchdog among them).
    mx.eval(data)
    return pickle.loads(bytes(data))


class Agreement:
    """Before each step: a digest of every rank's state, compared across the ranks.

    The digest covers the waiting requests (ids, prompts, limits), the running
    ones in batch order with their tokens, block ids per layer group and state
    slots, and the scheduler's counters: everything the step's plan follows
    from. It is checked before any forward, because ranks that disagree would
    run collectives of different shapes, which hang or compute garbage;
    ``check`` raises instead.
    """

    def __init__(self, group: mx.distributed.Group):
        self.group = group
        self.steps = 0

    def check(self, scheduler: Scheduler) -> None:
        """Raise RuntimeError unless every rank is about to plan this step from the same
        state."""
        self.steps += 1
        plan: list = [(r.uid, r.prompt, r.max_tokens, r.generated) for r in scheduler.waiting]
        plan += [
            (r.uid, r.generated, r.slot, [(str(k), t.blocks) for k, t in r.tables.items()])
            for r in scheduler.running
        ]
        plan.append(sorted(scheduler.counters.items()))
        digest = hashlib.blake2b(repr(plan).encode(), digest_size=8).digest()
        # Four 16-bit lanes: their sums over the ranks cannot overflow an int32.
        lanes = mx.array([int.from_bytes(digest[i : i + 2], "little") for i in range(0, 8, 2)])
        total = mx.distributed.all_sum(lanes, group=self.group)
        if not mx.array_equal(total, lanes * self.group.size()).item():
            raise RuntimeError(
                f"rank {self.group.rank()}: the ranks' plans differ at step {self.steps}: "
                "they were not given the same requests and aborts in the same order, or "
                "sampled different tokens."
            )


class Ranks:
    """What the ranks of ``group`` agree on where each one's own data differs (its files).

    ``gather`` is an all-gather made of one ``all_sum`` (each rank fills its own row),
    the collective every backend has. Without a group (or alone) each value is its own.
    """

    def __init__(self, group: mx.distributed.Group | None = None):
        self.group = group if group is not None and group.size() > 1 else None

    def gather(self, values: Sequence[int]) -> list[list[int]]:
        """Every rank's ``values`` (as many on each, each within int32), rank by rank."""
        if self.group is None:
            return [list(values)]
        rows = mx.zeros((self.group.size(), len(values)), mx.int32)
        rows[self.group.rank()] = mx.array(list(values), mx.int32)
        rows = mx.distributed.all_sum(rows, group=self.group)
        mx.eval(rows)  # lets go of the GIL while it waits (``share``)
        return rows.tolist()

    def own(self, path: str | os.PathLike, nbytes: Any) -> tuple[Path, Any]:
        """This rank's part of a directory ``path`` shared by ``n`` ranks and of its
        ``nbytes`` cap: ``path/rank-<r>-of-<n>`` and ``nbytes / n`` (a bad ``nbytes``
        stays as given, for its owner to refuse); alone, both as given."""
        if self.group is None:
            return Path(path), nbytes
        r, n = self.group.rank(), self.group.size()
        if isinstance(nbytes, int) and not isinstance(nbytes, bool) and nbytes > 0:
            nbytes = -(-nbytes // n)
        return Path(path) / f"rank-{r}-of-{n}", nbytes

    def least(self, *values: int) -> list[int]:
        """Each value's least over the ranks."""
        return [min(column) for column in zip(*self.gather(values), strict=True)]
