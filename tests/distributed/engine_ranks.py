"""One rank of the sharded-engine test (run by ``mlx.launch -n 2 --backend ring``).

For each family: the unsharded model's greedy tokens in one process, then the
same model sharded across the ranks (``shard_model``) in a ``PagedEngine`` with
the group. Each rank writes what it saw to ``OUT/rank<r>.json`` for the test to
compare.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).parent.parent))
mx.set_default_device(mx.cpu)

from tiny_models import tiny_model  # noqa: E402

from mlx_paged import PagedEngine  # noqa: E402
from mlx_paged.engine import disk_tier  # noqa: E402
from mlx_paged.engine.disk_tier import chain_keys  # noqa: E402
from mlx_paged.engine.distributed import shard_model, share  # noqa: E402

SYSTEM = list(range(1, 21))  # 20 shared tokens: 5 blocks of 4
PROMPTS = [SYSTEM + [30, 31, 32], SYSTEM + [40, 41], SYSTEM + [50, 51, 52, 53], [60, 61, 62]]


def run(engine: PagedEngine) -> dict:
    """Greedy tokens (one request first, so the rest adopt its prefix) and what the
    scheduler did, step by step."""
    first = engine.generate(PROMPTS[:1], 6)
    uids = [engine.add_request(p, 6) for p in PROMPTS[1:]]
    out = {uid: [] for uid in uids}
    tables = []
    while engine.running or engine.waiting:
        for event in engine.step():
            out[event.uid].append(event.token)
        tables.append([[t.blocks for t in r.tables.values()] for r in engine.running])
    engine.check_invariants()
    stats = engine.stats()
    return {
        "tokens": first + [out[u] for u in uids],
        "tables": tables,
        "prefix_hit_tokens": stats.prefix_hit_tokens,
        "bytes": stats.bytes,
        "total_blocks": stats.total_blocks,
        "decode_steps": engine.clock.decode_steps,
        "compiled_steps": engine.runner.compiled.steps if engine.runner.compiled else 0,
    }


def restarts(family: str, group, root: Path, pipeline: bool = False, **tier) -> dict:
    """The disk tier under ``group``, in four engines over one directory (``tier`` sets
    ``disk_tier``'s ``CHECK_IN_MLX`` and ``LOAD_BATCH``): the first writes every cached
    block; the second loads them; then rank 1's third entry is damaged, so the third
    loads only what precedes it on every rank (rank 1 deletes its damaged file) and
    the fourth nothing. Each engine's tokens and disk-hit tokens."""
    saved = {name: getattr(disk_tier, name) for name in tier}
    for name, value in tier.items():
        setattr(disk_tier, name, value)
    prompt, out = PROMPTS[0], {"tokens": [], "disk_hit_tokens": []}
    for i in range(4):
        model = shard_model(tiny_model(family), group, pipeline=pipeline)
        engine = PagedEngine(
            model, block_size=4, max_batch_size=4, group=group, kv_disk_dir=root,
            kv_disk_bytes=10**8, state_snapshot_interval=4 if pipeline else None,
        )  # fmt: skip
        out["tokens"].append(engine.generate([prompt], 6)[0])
        out["disk_hit_tokens"].append(engine.stats().disk_hit_tokens)
        engine.check_invariants()
        if i == 0:
            engine.disk.spill_cached()
        if i == 1 and group.rank() == 1:
            path, offset, size = engine.disk.store.location(chain_keys(prompt, 4)[2])
            data = bytearray(path.read_bytes())
            data[offset + size // 2] ^= 0xFF
            path.write_bytes(bytes(data))
    out["dirs"] = sorted(p.name for p in root.iterdir())
    for name, value in saved.items():
        setattr(disk_tier, name, value)
    return out


def restores(group, root: Path) -> dict:
    """Restores under ``group``, in three engines over one directory: the first writes every
    cached block; the second, preloading, restores them on every rank; then rank 1's files
    are deleted, so the ranks find different prefixes and the third restores none. Each
    engine's tokens restored, greedy tokens, and disk and prefix hit tokens."""
    prompt = PROMPTS[0]
    out: dict = {"restored": [], "tokens": [], "disk_hit_tokens": [], "prefix_hit_tokens": []}
    for i in range(3):
        engine = PagedEngine(
            shard_model(tiny_model("llama"), group), block_size=4, max_batch_size=4, group=group,
            kv_disk_dir=root, kv_disk_bytes=10**8, kv_disk_preload_bytes=10**7 if i else 0,
        )  # fmt: skip
        out["restored"].append(engine.disk.restore())
        out["tokens"].append(engine.generate([prompt], 6)[0])
        stats = engine.stats()
        out["disk_hit_tokens"].append(stats.disk_hit_tokens)
        out["prefix_hit_tokens"].append(stats.prefix_hit_tokens)
        engine.check_invariants()
        if i == 0:
            engine.disk.spill_cached()
        if i == 1 and group.rank() == 1:
            engine.disk.store.flush()
            for path in engine.disk.store.path.iterdir():
                path.unlink()
    return out


def main() -> None:
    out_dir = Path(sys.argv[1])
    group = mx.distributed.init()
    result: dict = {"rank": group.rank(), "size": group.size()}
    for family in ("llama", "qwen3"):
        alone = run(PagedEngine(tiny_model(family), block_size=4, max_batch_size=4))
        model = shard_model(tiny_model(family), group)
        sharded = run(PagedEngine(model, block_size=4, max_batch_size=4, group=group))
        result[family] = {"alone": alone, "sharded": sharded}
    # By pipeline stage: the families whose mlx-lm model has pipeline() (qwen3_5 is hybrid).
    for family in ("ministral3", "qwen3_5"):
        alone = run(PagedEngine(tiny_model(family), block_size=4, max_batch_size=4))
        model = shard_model(tiny_model(family), group, pipeline=True)
        staged = run(PagedEngine(model, block_size=4, max_batch_size=4, group=group))
        result[f"{family}-pipeline"] = {"alone": alone, "sharded": staged}
    try:
        shard_model(tiny_model("llama"), group, pipeline=True)
    except ValueError as e:
        result["refused_pipeline"] = str(e)
    # A model whose heads do not divide is refused, naming why.
    try:
        shard_model(tiny_model("llama", num_key_value_heads=1, num_attention_heads=3), group)
    except ValueError as e:
        result["refused_heads"] = str(e)
    try:
        shard_model(tiny_model("gemma3_text"), group)
    except ValueError as e:
        result["refused_shard"] = str(e)
    # The disk tier: each rank's shard in its own directory; loads agree.
    disk_root = out_dir / "disk"  # one directory for both ranks, as on one machine
    result["disk"] = {
        "threads": restarts("llama", group, disk_root / "a", CHECK_IN_MLX=False),
        "mlx": restarts("llama", group, disk_root / "b", CHECK_IN_MLX=True),
        "runs of 2": restarts("llama", group, disk_root / "c", LOAD_BATCH=2),
        "qwen3_5-pipeline": restarts("qwen3_5", group, disk_root / "d", pipeline=True),
        "restore": restores(group, disk_root / "e"),
    }
    # Rank 0's requests reach every rank.
    result["shared"] = share({"prompt": PROMPTS[0], "rank": group.rank()}, group)
    # Ranks fed different requests stop at the first step, naming it.
    engine = PagedEngine(shard_model(tiny_model("llama"), group), block_size=4, group=group)
    engine.add_request(PROMPTS[group.rank()], 4)
    try:
        engine.step()
    except RuntimeError as e:
        result["disagreement"] = str(e)
    (out_dir / f"rank{group.rank()}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
