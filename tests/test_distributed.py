"""``PagedEngine`` over a model sharded across two processes (``mlx.launch``, ring, CPU).

``tests/distributed/engine_ranks.py`` runs on both ranks; each writes what it
saw, and the tests compare the ranks with each other and with one process.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parent / "distributed" / "engine_ranks.py"
FAMILIES = ["llama", "qwen3"]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    launch = shutil.which("mlx.launch") or str(Path(sys.executable).parent / "mlx.launch")
    if not Path(launch).exists():
        pytest.skip("mlx.launch is not installed")
    out = tmp_path_factory.mktemp("ranks")
    cmd = [launch, "-n", "2", "--backend", "ring", "--", sys.executable, str(SCRIPT), str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    files = [out / f"rank{r}.json" for r in range(2)]
    assert all(f.exists() for f in files), done.stdout[-3000:] + done.stderr[-3000:]
    return [json.loads(f.read_text()) for f in files]


@pytest.mark.parametrize("family", FAMILIES)
def test_sharded_engine_gives_one_process_tokens_on_every_rank(ranks, family):
    alone = ranks[0][family]["alone"]
    for rank in ranks:
        assert rank[family]["sharded"]["tokens"] == alone["tokens"]


@pytest.mark.parametrize("family", FAMILIES)
def test_ranks_make_the_same_plan(ranks, family):
    first, second = (r[family]["sharded"] for r in ranks)
    assert first["tables"] == second["tables"] and first["tables"]  # block ids, every step
    assert first["prefix_hit_tokens"] == second["prefix_hit_tokens"] == 40
    assert ranks[0][family]["alone"]["prefix_hit_tokens"] == 40  # 2 requests x 5 blocks of 4


@pytest.mark.parametrize("family", FAMILIES)
def test_each_rank_holds_half_the_kv(ranks, family):
    alone = ranks[0][family]["alone"]
    for rank in ranks:
        sharded = rank[family]["sharded"]
        assert sharded["total_blocks"] == alone["total_blocks"]
        assert sharded["bytes"] * 2 == alone["bytes"]


def test_unshardable_models_are_refused_with_the_reason(ranks):
    for rank in ranks:
        refused = "llama cannot be sharded over 2 ranks: num_attention_heads=3."
        assert rank["refused_heads"] == refused
        assert "gemma3_text cannot be sharded by tensor" in rank["refused_shard"]
        assert "no shard() method" in rank["refused_shard"]


def test_rank_zeros_inputs_reach_every_rank(ranks):
    assert ranks[0]["shared"] == ranks[1]["shared"]
    assert ranks[1]["shared"]["rank"] == 0


def test_ranks_given_different_requests_stop_before_the_forward(ranks):
    for rank in ranks:
        message = rank["disagreement"]
        assert message.startswith(f"rank {rank['rank']}: the ranks' plans differ at step 1")
