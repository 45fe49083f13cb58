"""The engine's cold-tier check before decode steps (``engine/migrations.py``): skipping
it while no table can have a batch due moves the same blocks at the same steps as
checking every step, and does skip; each change that ends a skip ends it."""

from __future__ import annotations

import mlx.core as mx
import pytest
from tiny_models import VOCAB, tiny_model

from mlx_paged import PagedEngine
from mlx_paged.blocks import COLD
from mlx_paged.engine.migrations import MigrationCheck
from mlx_paged.storage import KVPool

BLOCK = 8
HOT = 16


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", head_dim=64)  # mx.quantize needs groups of 32 or more


def tokens(n: int, seed: int) -> list[int]:
    mx.random.seed(seed)
    return mx.random.randint(0, VOCAB, (n,)).tolist()


def run(model, every_step: bool, monkeypatch) -> tuple[list, list, int, int]:
    """Each step's migrations so far and the running tables' tiers, and every request's
    tokens; with the check made before every decode step, or as the engine makes it."""
    engine = PagedEngine(model, block_size=BLOCK, kv_bits=8, hot_tokens=HOT, max_batch_size=8)
    check = engine.runner.migrations
    if every_step:
        monkeypatch.setattr(check, "decoded", lambda: setattr(check, "steps", 0))
    calls = []
    pool = next(iter(engine.runner.pools.values()))
    counted = lambda t: calls.append(1) or KVPool.migrate_due(pool, t)  # noqa: E731
    monkeypatch.setattr(pool, "migrate_due", counted)
    shared = tokens(21, seed=0)  # ends inside a block: each adopter copies it on write
    uids = [
        engine.add_request(shared + tokens(4 + 7 * i, seed=1 + i), max_tokens=60 + 9 * i)
        for i in range(4)
    ]
    steps, seen, decodes = 0, [], 0
    out: dict[int, list[int]] = {}
    while engine.waiting or engine.running:
        if steps == 45:  # a late arrival with a batch due at once, long before the others
            uids.append(engine.add_request(tokens(121, seed=9), max_tokens=40))
        decodes += engine.clock.decode_steps
        engine.clock.decode_steps = 0
        for event in engine.step():
            out.setdefault(event.uid, []).append(event.token)
        kind = next(iter(engine.runner.pools))
        tiers = [[b >= COLD for b in r.tables[kind].blocks] for r in engine.running]
        seen.append((engine.stats().migrations, tiers))
        steps += 1
    engine.check_invariants()
    return seen, [out[u] for u in uids], len(calls), decodes + engine.clock.decode_steps


def test_skipping_the_check_moves_the_same_blocks_at_the_same_steps(model, monkeypatch):
    every, every_out, every_calls, decodes = run(model, True, monkeypatch)
    skipping, skipping_out, calls, _ = run(model, False, monkeypatch)
    assert every[-1][0] > 0  # the load migrates
    assert skipping == every
    assert skipping_out == every_out
    assert every_calls >= decodes - 1
    assert calls < decodes // 3  # most steps skip the pass over the tables


class CountingPool:
    """What ``MigrationCheck`` reads of a ``KVPool``: its answers scripted, its calls counted."""

    quant = object()

    def __init__(self, steps: float):
        self.steps, self.copied, self.calls = steps, 0, 0

    def migrate_due(self, tables):
        self.calls += 1
        return 0, self.steps


class Req:
    def __init__(self):
        self.tables = {"group": object()}


def test_a_check_is_skipped_for_the_steps_it_promised_and_no_longer():
    pool = CountingPool(steps=3)
    check = MigrationCheck({"group": pool})
    reqs = [Req(), Req()]
    calls = []
    for _ in range(7):
        check.migrate(reqs)
        calls.append(pool.calls)
        check.decoded()
    assert calls == [1, 1, 1, 2, 2, 2, 3]


@pytest.mark.parametrize("change", ["forward", "joined", "left", "reordered", "copied"])
def test_each_change_that_may_bring_a_batch_nearer_ends_a_skip(change):
    pool = CountingPool(steps=100)
    check = MigrationCheck({"group": pool})
    reqs = [Req(), Req()]
    check.migrate(reqs)
    check.decoded()
    check.migrate(list(reqs))  # the same requests in a new list: skipped
    assert pool.calls == 1
    if change == "forward":
        check.forwarded()
    elif change == "joined":
        reqs = reqs + [Req()]
    elif change == "left":
        reqs = reqs[:1]
    elif change == "reordered":
        reqs = reqs[::-1]
    else:
        pool.copied += 1
    check.migrate(reqs)
    assert pool.calls == 2


def test_without_a_cold_tier_nothing_is_asked():
    pool = CountingPool(steps=0)
    pool.quant = None
    assert MigrationCheck({"group": pool}).migrate([Req()]) == 0
    assert pool.calls == 0
