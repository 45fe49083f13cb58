"""The disk tier in the engine: evicted blocks come back from files, in this process or the next."""

from __future__ import annotations

import contextlib
import logging
import random
import time
from functools import cache

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_models import VOCAB, model_of, solo, tiny_model

from mlx_paged import PagedEngine
from mlx_paged.engine import disk_blocks, disk_tier
from mlx_paged.engine.disk_tier import chain_keys
from mlx_paged.storage.disk_entries import pool_arrays

BS = 8
MAX_TOKENS = 4


def prompts(seed: int, n: int, length: int = 41) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB) for _ in range(length)] for _ in range(n)]


def run(engine: PagedEngine, prompt: list[int]) -> tuple[list[int], list[float]]:
    """Greedy tokens and their log-probs for one request alone."""
    uid = engine.add_request(prompt, MAX_TOKENS, logprobs=0)
    tokens, logprobs = [], []
    for event in engine.stream():
        if event.uid == uid:
            tokens.append(event.token)
            logprobs.append(event.logprob)
    engine.check_invariants()
    return tokens, logprobs


def test_evicted_blocks_come_back_with_the_same_logprobs_as_never_evicting(tmp_path):
    model = model_of("llama")
    a, *others = prompts(0, 4)
    never = PagedEngine(model, block_size=BS)
    run(never, a)
    expected = run(never, a)  # served from memory: what an eviction must not change
    assert never.stats().prefix_hit_tokens == 2 * 40 - 40  # the second run hit 40 tokens

    engine = PagedEngine(model, block_size=BS, num_blocks=14, kv_disk_dir=tmp_path,
                         kv_disk_bytes=10**8)  # fmt: skip
    run(engine, a)
    for p in others:  # each takes 6 of the 14 blocks: a's parked blocks are evicted
        run(engine, p)
    assert engine.scheduler.index.full_blocks_matched(a) < 40  # memory lost some of a
    before = engine.stats()
    got = run(engine, a)
    after = engine.stats()
    assert got[0] == expected[0] == solo("llama", tuple(a), MAX_TOKENS)
    assert np.allclose(got[1], expected[1], atol=1e-6, rtol=0), (got[1], expected[1])
    loaded = after.disk_hit_tokens - before.disk_hit_tokens
    assert loaded > 0 and loaded % BS == 0
    assert after.prefix_hit_tokens - before.prefix_hit_tokens == 40  # 5 full blocks
    assert engine.disk.store.counts["hits"] == loaded // BS


@pytest.mark.parametrize("batch", [64, 2, 1])  # blocks per read: one run, three or five
def test_a_restart_answers_a_repeated_prompt_from_disk(tmp_path, monkeypatch, batch):
    monkeypatch.setattr(disk_tier, "LOAD_BATCH", batch)
    (a,) = prompts(1, 1)
    first = PagedEngine(model_of("llama"), block_size=BS, kv_disk_dir=tmp_path, kv_disk_bytes=10**8)
    expected = run(first, a)
    assert first.disk.spill_cached() == 5  # the 5 full blocks of a's 41 + 3 written tokens
    assert first.disk.spill_cached() == 0  # already there
    # A new engine, as after a restart: a fresh pool whose layers were never written.
    second = PagedEngine(tiny_model("llama"), block_size=BS, kv_disk_dir=tmp_path,
                         kv_disk_bytes=10**8)  # fmt: skip
    got = run(second, a)
    stats = second.stats()
    assert stats.disk_hit_tokens == 40 and stats.prefix_hit_tokens == 40
    assert got[0] == expected[0]
    assert np.allclose(got[1], expected[1], atol=1e-6, rtol=0)


def test_a_load_reads_two_runs_ahead_into_buffers_no_write_still_needs(tmp_path, monkeypatch):
    monkeypatch.setattr(disk_tier, "LOAD_BATCH", 1)  # five runs of one block
    (a,) = prompts(1, 1)
    first = PagedEngine(model_of("llama"), block_size=BS, kv_disk_dir=tmp_path, kv_disk_bytes=10**8)
    expected = run(first, a)
    first.disk.spill_cached()
    second = PagedEngine(model_of("llama"), block_size=BS, kv_disk_dir=tmp_path,
                         kv_disk_bytes=10**8)  # fmt: skip
    log = []
    read, copy, make = second.disk._read, disk_blocks.run_blocks, disk_tier.write_blocks
    wait = disk_blocks.Writes.wait

    def logged_read(keys, i):
        log.append(("read", len(keys), i))
        return read(keys, i)

    def logged(name, f):
        return lambda *args, **kwargs: (log.append(name), f(*args, **kwargs))[1]

    def logged_wait(writes):
        if writes._run is not None:  # writes in flight
            log.append("wait")
        return wait(writes)

    monkeypatch.setattr(second.disk, "_read", logged_read)
    monkeypatch.setattr(disk_blocks, "run_blocks", logged("copy", copy))
    monkeypatch.setattr(disk_tier, "write_blocks", logged("write", make))
    monkeypatch.setattr(disk_blocks.Writes, "wait", logged_wait)
    (pool,) = second.scheduler.groups.values()
    grown, grows = pool.grown, []
    monkeypatch.setattr(pool, "grown", lambda: (grows.append(pool.blocks.capacity), grown()))
    got = run(second, a)
    assert got[0] == expected[0] and np.allclose(got[1], expected[1], atol=1e-6, rtol=0)
    assert second.stats().disk_hit_tokens == 5 * BS
    # Reads i and i + 1 are in flight while run i - 1 is copied in; run i's copy starts
    # before run i - 1's pool writes are waited for, and its writes are made after that
    # wait. Read i (into buffer i % 3) is asked for only once run i - 3's writes, the
    # buffer's last, are done.
    assert log == [("read", 1, 0), ("read", 1, 1), "copy", "write",
                   ("read", 1, 2), "copy", "wait", "write",
                   ("read", 1, 3), "copy", "wait", "write",
                   ("read", 1, 4), "copy", "wait", "write",
                   "copy", "wait", "write", "wait"]  # fmt: skip
    assert disk_tier.READS_AHEAD == 2
    # The pool grew once, at the first run (each growth copies the pool's arrays): for the
    # 5 blocks loaded and one more, which the request's 45 tokens then took.
    assert grows == [6] and pool.blocks.capacity == 6


def test_another_model_or_block_size_never_hits(tmp_path):
    (a,) = prompts(2, 1)
    first = PagedEngine(model_of("llama"), block_size=BS, kv_disk_dir=tmp_path, kv_disk_bytes=10**8)
    run(first, a)
    first.disk.spill_cached()
    other = tiny_model("llama", seed=5)  # same shapes, other weights
    for engine in (
        PagedEngine(other, block_size=BS, kv_disk_dir=tmp_path, kv_disk_bytes=10**8),
        PagedEngine(model_of("llama"), block_size=16, kv_disk_dir=tmp_path, kv_disk_bytes=10**8),
    ):
        tokens, _ = run(engine, a)
        assert engine.stats().disk_hit_tokens == 0 and engine.stats().prefix_hit_tokens == 0


def damaged_third_entry(tmp_path):
    """A prompt's 5 full blocks on disk, the third entry's arrays then damaged: the prompt,
    its tokens and log-probs, the file holding that entry, and a new engine over the files."""
    (a,) = prompts(3, 1)
    first = PagedEngine(model_of("llama"), block_size=BS, kv_disk_dir=tmp_path, kv_disk_bytes=10**8)
    expected = run(first, a)
    first.disk.spill_cached()
    assert len(first.disk.store.keys) == 5
    path, offset, size = first.disk.store.location(chain_keys(a, BS)[2])
    data = bytearray(path.read_bytes())
    data[offset + size // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    second = PagedEngine(model_of("llama"), block_size=BS, kv_disk_dir=tmp_path,
                         kv_disk_bytes=10**8)  # fmt: skip
    return a, expected, path, second


def slow_reads(monkeypatch, engine: PagedEngine, key: str, seconds: float) -> None:
    """Make the engine's disk reads of runs that start at ``key`` take ``seconds`` longer."""
    read_run = engine.disk.store.read_run

    def slow(keys, *args, **kwargs):
        if keys[0] == key:
            time.sleep(seconds)
        return read_run(keys, *args, **kwargs)

    monkeypatch.setattr(engine.disk.store, "read_run", slow)


@pytest.mark.parametrize("in_mlx", [True, False])  # checked in MLX, or on the reader threads
# The third block: in the first run, the second, or the third (two more reads in flight).
@pytest.mark.parametrize("batch", [64, 2, 1])
def test_damaged_files_are_recomputed_and_deleted(tmp_path, monkeypatch, batch, in_mlx):
    monkeypatch.setattr(disk_tier, "LOAD_BATCH", batch)
    monkeypatch.setattr(disk_tier, "CHECK_IN_MLX", in_mlx)
    # The third block's entry: the two before it load, the rest is recomputed.
    a, expected, third, second = damaged_third_entry(tmp_path)
    # The damaged entry's read is slow, so the reads ahead of it end first: entries read
    # but never used are not hits.
    slow_reads(monkeypatch, second, chain_keys(a, BS)[2], 0.2)
    got = run(second, a)
    assert got[0] == expected[0]
    assert second.disk.store.counts["hits"] == 2 and second.stats().disk_hit_tokens == 2 * BS
    assert not third.exists()
    # The blocks reserved past the damaged file went back: only a's own are held.
    index = second.scheduler.index
    assert index.full_blocks_matched(a) == 5 * BS  # 2 loaded, 3 recomputed
    stats = second.stats()
    assert stats.live_blocks == 0 and stats.cached_blocks == 6, stats  # 5 full, 1 partial


def test_a_damaged_entry_read_ahead_waits_for_the_read_before_it(tmp_path, monkeypatch):
    """Runs of 2 entries: the first run's read is slow, so the run read ahead of it finds the
    damaged third entry first. It deletes the pack only once the first read is done, so the
    two entries before it still load (deleting it at once loaded none)."""
    monkeypatch.setattr(disk_tier, "LOAD_BATCH", 2)
    a, expected, pack, second = damaged_third_entry(tmp_path)
    slow_reads(monkeypatch, second, chain_keys(a, BS)[0], 0.3)
    assert run(second, a)[0] == expected[0]
    assert second.stats().disk_hit_tokens == 2 * BS and not pack.exists()


def test_the_directory_stays_under_its_cap(tmp_path):
    engine = PagedEngine(model_of("llama"), block_size=BS, num_blocks=14, kv_disk_dir=tmp_path,
                         kv_disk_bytes=30_000)  # fmt: skip
    for p in prompts(4, 6):
        run(engine, p)
    engine.disk.spill_cached()
    on_disk = sum(f.stat().st_size for f in tmp_path.glob("*.kv*"))  # files and packs
    assert 0 < on_disk <= 30_000 and on_disk == engine.disk.store.bytes


@pytest.mark.parametrize(
    "family, kwargs, match",
    [
        ("llama", {"kv_disk_bytes": 0}, "max_bytes"),
        ("llama", {"kv_disk_bytes": None}, "max_bytes"),
    ],
)
def test_caches_the_disk_tier_does_not_serve_are_refused(tmp_path, family, kwargs, match):
    settings = {"kv_disk_bytes": 10**8, **kwargs}
    with pytest.raises(ValueError, match=match):
        PagedEngine(model_of(family), block_size=BS, kv_disk_dir=tmp_path, **settings)


def test_a_directory_that_cannot_be_used_leaves_the_engine_serving(tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    (a,) = prompts(5, 1)
    with caplog.at_level(logging.WARNING, logger="mlx_paged.disk"):
        engine = PagedEngine(model_of("llama"), block_size=BS, kv_disk_dir=blocker / "kv",
                             kv_disk_bytes=10**8)  # fmt: skip
        got = run(engine, a)
        assert engine.disk.spill_cached() == 0
    assert got[0] == solo("llama", tuple(a), MAX_TOKENS)
    assert not engine.disk.store.enabled
    assert [r.getMessage() for r in caplog.records if "the disk tier is off" in r.getMessage()]


# ---- hybrid models: recurrent-state snapshots go to disk with their blocks ----

HYBRID = ["qwen3_5", "lfm2"]  # gated delta-net and short-conv recurrent layers


def hybrid_engine(family: str, path, model=None, **kw) -> PagedEngine:
    kw = {"block_size": BS, "state_snapshot_interval": 16, "kv_disk_dir": path,
          "kv_disk_bytes": 10**8, **kw}  # fmt: skip
    return PagedEngine(model if model is not None else model_of(family), **kw)


@pytest.mark.parametrize("family", HYBRID)
def test_a_restarted_hybrid_engine_adopts_blocks_and_a_snapshot_from_disk(tmp_path, family):
    (a,) = prompts(6, 1)
    first = hybrid_engine(family, tmp_path)
    expected = run(first, a)
    assert expected[0] == solo(family, tuple(a), MAX_TOKENS)
    # 5 full blocks, and the snapshots at 16, 32 and 40 (the last full block before decoding).
    assert first.disk.spill_cached() == 5 + 3
    keys = chain_keys(a, BS)
    for j in (2, 4, 5):
        assert (tmp_path / f"{first.disk.store.fingerprint}-{keys[j - 1]}s.kv").exists()
    second = hybrid_engine(family, tmp_path, model=tiny_model(family))
    got = run(second, a)
    stats = second.stats()
    assert stats.disk_hit_tokens == 40 and stats.prefix_hit_tokens == 40
    assert got[0] == expected[0]
    assert np.allclose(got[1], expected[1], atol=1e-5, rtol=0), (got[1], expected[1])


@pytest.mark.parametrize("family", HYBRID)
def test_hybrid_blocks_and_snapshots_evicted_come_back(tmp_path, family):
    a, *others = prompts(7, 4)
    engine = hybrid_engine(family, tmp_path, num_blocks=14)
    expected = run(engine, a)
    for p in others:  # a's blocks, and the snapshots on them, are evicted
        run(engine, p)
    assert engine.scheduler.index.full_blocks_matched(a) < 40
    before = engine.stats()
    got = run(engine, a)
    after = engine.stats()
    assert got[0] == expected[0]
    assert np.allclose(got[1], expected[1], atol=1e-5, rtol=0)
    assert after.prefix_hit_tokens - before.prefix_hit_tokens == 40


@pytest.mark.parametrize("family", HYBRID)
def test_a_snapshot_the_state_pool_evicts_comes_back_from_disk(tmp_path, family):
    """Blocks stay in memory; only the snapshots go (two held at most) and come back."""
    a, b = prompts(8, 2)
    kw = {"num_state_snapshots": 2, "max_batch_size": 2, "num_blocks": 64}
    without = hybrid_engine(family, tmp_path / "none", **kw)
    without.disk = without.scheduler.disk = None  # the same engine, no tier
    with_disk = hybrid_engine(family, tmp_path / "disk", **kw)
    for engine in (without, with_disk):
        expected = run(engine, a)
        run(engine, b)  # its snapshots push out a's
        assert engine.scheduler.index.full_blocks_matched(a) == 40  # a's blocks stay
        before = engine.stats().prefix_hit_tokens
        got = run(engine, a)
        assert got[0] == expected[0]
        hit = engine.stats().prefix_hit_tokens - before
        if engine is without:
            assert hit < 40  # a snapshot deep enough was lost
        else:
            assert hit == 40 and engine.disk.store.counts["hits"] >= 1
            assert np.allclose(got[1], expected[1], atol=1e-5, rtol=0)


# ---- the quantized cold tier: cold blocks go to disk quantized, and come back cold ----

COLD_KW = {"kv_bits": 8, "kv_group_size": 32, "hot_tokens": 16}


@cache
def cold_model():
    """A llama whose head dim (32) a quantization group fits."""
    return tiny_model("llama", head_dim=32)


def test_cold_blocks_come_back_quantized_with_the_same_logprobs(tmp_path):
    a, *others = prompts(9, 4, length=97)  # 12 full blocks: 8 go cold behind the hot tail
    pools = {"num_blocks": 20, "cold_blocks": 8, **COLD_KW}
    never = PagedEngine(cold_model(), block_size=BS, **pools)
    run(never, a)
    expected = run(never, a)  # 8 blocks cold, 4 hot: what the round trip must give again
    engine = PagedEngine(cold_model(), block_size=BS, kv_disk_dir=tmp_path, kv_disk_bytes=10**8,
                         **pools)  # fmt: skip
    assert run(engine, a)[0] == expected[0]
    assert engine.stats().cold_blocks == 8
    for p in others:  # a's hot and cold blocks are evicted
        run(engine, p)
    assert engine.scheduler.index.full_blocks_matched(a) == 0
    sizes = {f.stat().st_size for f in tmp_path.glob("*.kv")}
    assert len(sizes) == 2  # a hot block's file, and a smaller quantized one
    before = engine.stats()
    got = run(engine, a)
    after = engine.stats()
    assert after.disk_hit_tokens - before.disk_hit_tokens == 96
    assert after.prefix_hit_tokens - before.prefix_hit_tokens == 96
    assert got[0] == expected[0]
    assert np.allclose(got[1], expected[1], atol=1e-6, rtol=0), (got[1], expected[1])
    assert after.cold_blocks >= 8  # the quantized blocks came back into the cold tier


def test_a_restart_serves_cold_blocks_from_disk_and_other_bits_never_hit(tmp_path):
    (a,) = prompts(10, 1, length=97)
    first = PagedEngine(cold_model(), block_size=BS, kv_disk_dir=tmp_path,
                        kv_disk_bytes=10**8, **COLD_KW)  # fmt: skip
    run(first, a)
    expected = run(first, a)
    assert first.disk.spill_cached() == 12
    second = PagedEngine(tiny_model("llama", head_dim=32), block_size=BS, kv_disk_dir=tmp_path,
                         kv_disk_bytes=10**8, **COLD_KW)  # fmt: skip
    got = run(second, a)
    assert second.stats().disk_hit_tokens == 96 and second.stats().cold_blocks >= 8
    assert got[0] == expected[0]
    assert np.allclose(got[1], expected[1], atol=1e-6, rtol=0)
    for other in ({**COLD_KW, "kv_bits": 4}, {}):  # other bits, or no cold tier
        engine = PagedEngine(cold_model(), block_size=BS, kv_disk_dir=tmp_path,
                             kv_disk_bytes=10**8, **other)  # fmt: skip
        run(engine, a)
        assert engine.stats().disk_hit_tokens == 0


@pytest.mark.parametrize("kw", [{}, {"kv_bits": 8, "kv_group_size": 32, "hot_tokens": 16}])
def test_a_rehearsal_changes_no_byte_and_writes_no_file(tmp_path, kw):
    model = cold_model()
    engine = PagedEngine(model, block_size=BS, kv_disk_dir=tmp_path, kv_disk_bytes=10**8, **kw)
    assert not engine.disk.rehearse()  # nothing cached yet
    (a,) = prompts(11, 1, length=97)
    run(engine, a)
    pool = engine.disk.pools[0]
    before = [np.array(x) for x in pool_arrays(pool)]
    assert engine.disk.rehearse()
    after = [np.array(x) for x in pool_arrays(pool)]
    assert len(before) == len(after)
    assert all(np.array_equal(x, y) for x, y in zip(before, after, strict=True))
    assert not list(tmp_path.glob("*.kv")) and engine.disk.store.counts["writes"] == 0
    engine.check_invariants()
    assert run(engine, a)[0] == run(PagedEngine(model, block_size=BS, **kw), a)[0]


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_a_warm_up_neither_spills_to_nor_loads_from_the_disk_tier(tmp_path, monkeypatch, family):
    from mlx_paged.blocks.prefix_index import PrefixIndex
    from mlx_paged.engine import warmup

    # A pool the warm-up's own prompts overflow: it evicts made-up blocks as it goes.
    kw = {"num_blocks": 12, "max_batch_size": 3, "prefill_step_size": 64}
    model = model_of(family)
    engine = hybrid_engine(family, tmp_path, model, **kw)
    assert warmup.warm_up(engine) > 0
    assert engine.stats().cached_blocks == 0 and engine.scheduler.index.num_blocks == 0
    assert engine.disk.spill_cached() == 0
    assert engine.disk.store.counts["writes"] == 0 and not list(tmp_path.glob("*.kv*"))
    engine.check_invariants()

    # A directory that holds the made-up prompts' blocks (a warm-up left them to the index,
    # and a shutdown wrote them): the next warm-up still runs its prefills.
    monkeypatch.setattr(warmup, "_without_disk", lambda engine: contextlib.nullcontext())
    monkeypatch.setattr(PrefixIndex, "clear", lambda self: None)
    old = hybrid_engine(family, tmp_path, model, num_blocks=64, max_batch_size=3,
                        prefill_step_size=64)  # fmt: skip
    warmup.warm_up(old)
    assert old.disk.spill_cached() > 0
    monkeypatch.undo()
    again = hybrid_engine(family, tmp_path, model, num_blocks=64, max_batch_size=3,
                          prefill_step_size=64)  # fmt: skip
    warmup.warm_up(again)
    assert again.disk.store.counts["hits"] == 0 and again.stats().cached_blocks == 0
    (a,) = prompts(12, 1)
    assert run(again, a) == run(PagedEngine(model, block_size=BS), a)


def test_block_keys_reused_along_a_walk_equal_the_chain_of_each_prefix(tmp_path):
    engine = PagedEngine(model_of("llama"), block_size=BS, kv_disk_dir=tmp_path,
                         kv_disk_bytes=10**8)  # fmt: skip
    rng = random.Random(12)
    trunk = [rng.randrange(VOCAB) for _ in range(6 * BS)]
    branch = trunk[: 3 * BS] + [rng.randrange(VOCAB) for _ in range(3 * BS)]
    # Parents first down one branch, then another, then back: as an eviction walks.
    walk = [trunk[: i * BS] for i in range(1, 7)] + [branch[: i * BS] for i in range(4, 7)]
    walk += [trunk[:BS], branch + [1] * (BS - 1), trunk[: 2 * BS + 3]]
    for tokens in walk:
        keys = chain_keys(tokens, BS)
        key, chain = engine.disk._spills.link(tokens)
        n = len(tokens) // BS
        assert key == keys[-1] and chain["tokens"].tolist() == tokens[(n - 1) * BS : n * BS]
        parent = chain["parent"].tobytes().hex()
        assert parent == (keys[-2] if n > 1 else "0" * 40)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 3), st.integers(0, 5 * BS), st.integers(0, 2)),
        min_size=1,
        max_size=12,
    )
)
def test_a_key_chain_gives_each_prompts_keys_whatever_it_was_asked_before(asks):
    """Prompts that share prefixes of any length with the last one asked about, longer,
    shorter or parting mid-block: the chain's keys are always ``chain_keys`` of the prompt."""
    chain, rng = disk_blocks.KeyChain(BS), random.Random(0)
    bases = [[rng.randrange(VOCAB) for _ in range(6 * BS)] for _ in range(4)]
    for base, n, tail in asks:
        tokens = bases[base][:n] + [(base + t) % VOCAB for t in range(tail)]
        assert chain.keys(tokens) == chain_keys(tokens, BS)


def restarted_while_one_decodes(tmp_path) -> tuple[PagedEngine, int, list[int], tuple]:
    """A 12-block prompt spilled to disk, a restarted engine that loads 4 blocks a step
    while others run, and another request running in it: the engine, that request's id,
    the prompt and the first engine's tokens and logprobs for it."""
    a, b = prompts(13, 2, length=97)
    first = PagedEngine(model_of("llama"), block_size=BS, kv_disk_dir=tmp_path, kv_disk_bytes=10**8)
    expected = run(first, a)
    first.disk.spill_cached()
    engine = PagedEngine(tiny_model("llama"), block_size=BS, kv_disk_dir=tmp_path,
                         kv_disk_bytes=10**8)  # fmt: skip
    engine.disk.step_blocks = 4
    other = engine.add_request(b, 12)
    engine.step()  # b is running
    return engine, other, a, expected


def load_step_by_step(engine: PagedEngine, prompt: list[int]) -> tuple[list[int], list[int]]:
    """Run ``prompt`` to its end beside the engine's other request: the disk hit tokens after
    each step (invariants checked at each), and the prompt's tokens."""
    uid = engine.add_request(prompt, MAX_TOKENS)
    loaded, got = [], []
    while engine.waiting or engine.running:
        events = engine.step()
        engine.check_invariants()
        loaded.append(engine.stats().disk_hit_tokens)
        got += [e.token for e in events if e.uid == uid]
    return loaded, got


def test_while_others_decode_a_load_spreads_over_steps_and_stalls_none(tmp_path, monkeypatch):
    monkeypatch.setattr(disk_tier, "LOAD_BATCH", 2)  # two runs of two blocks a step
    engine, other, a, expected = restarted_while_one_decodes(tmp_path)
    uid = engine.add_request(a, MAX_TOKENS, logprobs=0)
    loaded, got = [], ([], [])
    while engine.waiting or engine.running:
        events = engine.step()
        engine.check_invariants()
        loaded.append(engine.stats().disk_hit_tokens)
        if loaded[-1] < 12 * BS:  # b decoded in every step of the load
            assert any(e.uid == other for e in events)
        for e in events:
            if e.uid == uid:
                got[0].append(e.token)
                got[1].append(e.logprob)
    assert loaded[:3] == [4 * BS, 8 * BS, 12 * BS]  # 12 blocks, 4 a step
    assert engine.stats().prefix_hit_tokens == 96
    assert engine.disk.store.counts["hits"] == 12  # each file read once: the read-ahead was used
    assert got[0] == expected[0]
    assert np.allclose(got[1], expected[1], atol=1e-6, rtol=0)


def test_a_read_ahead_larger_than_a_step_takes_no_more_than_the_step(tmp_path, monkeypatch):
    """Runs of more files than a step loads (128 MB runs of 16-token blocks hold 256, a step
    128): the read ahead takes only the next step's blocks, so every step loads its share
    and the whole prompt comes from disk, none of it recomputed."""
    monkeypatch.setattr(disk_tier, "LOAD_BATCH", 8)
    engine, _, a, expected = restarted_while_one_decodes(tmp_path)
    loaded, got = load_step_by_step(engine, a)
    assert loaded[:3] == [4 * BS, 8 * BS, 12 * BS]  # 12 blocks, 4 a step
    assert engine.stats().prefix_hit_tokens == 96  # all 12 from disk
    assert engine.disk.store.counts["hits"] == 12  # each file read once
    assert got == expected[0]


@pytest.mark.parametrize("blocks", [3, 1])
def test_a_step_loads_no_more_bytes_than_step_bytes(tmp_path, blocks):
    engine, _, a, expected = restarted_while_one_decodes(tmp_path)
    size = engine.disk.store.size(chain_keys(a, BS)[0])
    # 3 blocks a step, under step_blocks' 4; or less than a block's bytes: one a step.
    engine.disk.step_bytes = 3 * size + size // 2 if blocks == 3 else size // 2
    loaded, got = load_step_by_step(engine, a)
    assert loaded[: 12 // blocks] == [i * blocks * BS for i in range(1, 12 // blocks + 1)]
    assert engine.stats().prefix_hit_tokens == 96 and got == expected[0]


def test_a_stale_read_ahead_finishes_before_a_new_load_reads_into_its_buffer(tmp_path, monkeypatch):
    monkeypatch.setattr(disk_tier, "LOAD_BATCH", 2)
    a, b, c = prompts(15, 3, length=97)
    first = PagedEngine(model_of("llama"), block_size=BS, kv_disk_dir=tmp_path, kv_disk_bytes=10**8)
    run(first, a)
    expected = run(first, c)
    first.disk.spill_cached()
    engine = PagedEngine(tiny_model("llama"), block_size=BS, kv_disk_dir=tmp_path,
                         kv_disk_bytes=10**8)  # fmt: skip
    engine.disk.step_blocks = 4
    read_run, slow = engine.disk.store.read_run, chain_keys(a, BS)[4]

    def slow_read_run(keys, *args, **kwargs):  # the read ahead past a's first step: slow
        if keys[0] == slow:
            time.sleep(0.3)
        return read_run(keys, *args, **kwargs)

    monkeypatch.setattr(engine.disk.store, "read_run", slow_read_run)
    engine.add_request(b, 12)
    engine.step()  # b is running: loads take 4 blocks a step
    uid = engine.add_request(a, MAX_TOKENS)
    engine.step()  # a's first 4 blocks; the run after them is being read ahead
    stale = engine.disk._ahead
    assert stale is not None and engine.stats().disk_hit_tokens == 4 * BS
    engine.abort(uid)  # a never asks for that run
    reads, read = [], engine.disk._read

    def logged_read(*args):
        reads.append(stale[-1].done())
        return read(*args)

    monkeypatch.setattr(engine.disk, "_read", logged_read)
    got = run(engine, c)
    assert reads and all(reads)  # c's reads came after the stale one was done with buffer 0
    assert engine.disk._ahead is None or engine.disk._ahead is not stale
    assert got[0] == expected[0] and np.allclose(got[1], expected[1], atol=1e-6, rtol=0)


def test_an_idle_engine_loads_a_whole_prompt_at_once(tmp_path):
    (a,) = prompts(14, 1, length=97)
    first = PagedEngine(model_of("llama"), block_size=BS, kv_disk_dir=tmp_path, kv_disk_bytes=10**8)
    run(first, a)
    first.disk.spill_cached()
    engine = PagedEngine(tiny_model("llama"), block_size=BS, kv_disk_dir=tmp_path,
                         kv_disk_bytes=10**8)  # fmt: skip
    engine.disk.step_blocks = 4
    uid = engine.add_request(a, MAX_TOKENS)
    events = engine.step()
    assert engine.stats().disk_hit_tokens == 96 and any(e.uid == uid for e in events)


def test_a_loads_upkeep_waits_until_the_steps_first_tokens_are_out(tmp_path, monkeypatch):
    """Marking the loaded files used, closing them and giving the preload's memory back run
    at the end of the step, after the first token the load was for: on their threads they
    would otherwise contend with the prefill it serves."""
    (a,) = prompts(15, 1)
    first = PagedEngine(model_of("llama"), block_size=BS, kv_disk_dir=tmp_path, kv_disk_bytes=10**8)
    run(first, a)
    assert first.disk.spill_cached() == 5
    engine = PagedEngine(tiny_model("llama"), block_size=BS, kv_disk_dir=tmp_path,
                         kv_disk_bytes=10**8, kv_disk_preload_bytes=10**8)  # fmt: skip
    tier = engine.disk
    assert tier.preloaded.wait(30) and tier.preloaded.held_bytes > 0
    seen: list[str] = []
    for owner, name in ((tier.store, "used"), (tier.store, "close_files"),
                        (tier.preloaded, "release")):  # fmt: skip
        real = getattr(owner, name)

        def spy(*args, _real=real, _name=name, **kwargs):
            seen.append(_name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(owner, name, spy)
    uid = engine.add_request(a, MAX_TOKENS)
    engine.step(on_event=lambda e: seen.append("token") if e.uid == uid else None)
    assert engine.stats().disk_hit_tokens == 40
    assert seen == ["token", "used", "close_files", "release"]
    assert tier._after == [] and tier.preloaded.held_bytes == 0
    tier.store.flush()  # the marks are made on the store's thread
    assert list(tier.store._index.files)[-1] == tier.store._index.locate(chain_keys(a, BS)[4])[0]


# ---- sliding-window layers: a block's window K/V go with it while the group holds it ----

SLIDING = ["gemma3_text", "gpt_oss"]


@pytest.mark.parametrize("family", SLIDING)
def test_a_restart_serves_a_sliding_window_model_from_disk(tmp_path, family):
    (a,) = prompts(15, 1, length=97)  # 12 full blocks; windows of 24 and 20 tokens
    first = PagedEngine(model_of(family), block_size=BS, kv_disk_dir=tmp_path,
                        kv_disk_bytes=10**8)  # fmt: skip
    expected = run(first, a)
    assert expected[0] == solo(family, tuple(a), MAX_TOKENS)
    assert first.disk.spill_cached() == 12
    second = PagedEngine(tiny_model(family), block_size=BS, kv_disk_dir=tmp_path,
                         kv_disk_bytes=10**8)  # fmt: skip
    got = run(second, a)
    assert second.stats().disk_hit_tokens == 96 and second.stats().prefix_hit_tokens == 96
    assert got[0] == expected[0]
    assert np.allclose(got[1], expected[1], atol=1e-5, rtol=0), (got[1], expected[1])


@pytest.mark.parametrize("family", SLIDING)
def test_sliding_window_blocks_evicted_come_back(tmp_path, family):
    a, *others = prompts(16, 4, length=97)
    engine = PagedEngine(model_of(family), block_size=BS, num_blocks=40, kv_disk_dir=tmp_path,
                         kv_disk_bytes=10**8)  # fmt: skip
    expected = run(engine, a)
    for p in others:
        run(engine, p)
    assert engine.scheduler.index.full_blocks_matched(a) < 96
    sizes = sorted({f.stat().st_size for f in tmp_path.glob("*.kv")})
    before = engine.stats()
    got = run(engine, a)
    after = engine.stats()
    assert got[0] == expected[0] == solo(family, tuple(a), MAX_TOKENS)
    assert np.allclose(got[1], expected[1], atol=1e-5, rtol=0)
    assert after.prefix_hit_tokens - before.prefix_hit_tokens == 96, sizes


def test_entries_without_their_window_blocks_load_and_the_window_comes_from_later_ones(tmp_path):
    """Files of the first blocks hold no sliding-window K/V (the group had given them
    back); the match needs only the last window's, which later files hold."""
    (a,) = prompts(17, 1, length=97)
    first = PagedEngine(model_of("gemma3_text"), block_size=BS, kv_disk_dir=tmp_path,
                        kv_disk_bytes=10**8)  # fmt: skip
    expected = run(first, a)
    first.disk.spill_cached()
    store, sliding = first.disk.store, first.disk.windows.index(24)
    for key in chain_keys(a, BS)[:6]:  # rewritten without the window's arrays
        kept = {n: x for n, x in store.get(key).items() if not n.startswith(f"{sliding}.")}
        assert store.put(key, kept)
    sizes = sorted({store.size(key) for key in chain_keys(a, BS)})
    assert len(sizes) == 2
    second = PagedEngine(tiny_model("gemma3_text"), block_size=BS, kv_disk_dir=tmp_path,
                         kv_disk_bytes=10**8)  # fmt: skip
    got = run(second, a)
    assert second.stats().disk_hit_tokens == 96 and second.stats().prefix_hit_tokens == 96
    assert got[0] == expected[0]
    assert np.allclose(got[1], expected[1], atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", HYBRID)
def test_a_hybrid_restart_past_its_deepest_snapshot_evicts_nothing(tmp_path, family):
    """Blocks loaded past the deepest snapshot on disk stay parked while the request
    recomputes them: the load's pool growth leaves room for both, so admission evicts (and
    spills) nothing."""
    (a,) = prompts(6, 1)
    first = hybrid_engine(family, tmp_path)
    expected = run(first, a)
    first.disk.spill_cached()
    store = first.disk.store
    (tmp_path / f"{store.fingerprint}-{chain_keys(a, BS)[4]}s.kv").unlink()  # the one at 40
    second = hybrid_engine(family, tmp_path, model=tiny_model(family))
    index, spilled = second.scheduler.index, []
    spill = index.on_spill
    index.on_spill = lambda *args: (spilled.append(args[0]), spill(*args))
    got = run(second, a)
    assert second.stats().disk_hit_tokens == 40 and second.stats().prefix_hit_tokens == 32
    assert got[0] == expected[0] and spilled == []
