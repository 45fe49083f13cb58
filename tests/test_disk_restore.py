"""A restart's preloaded prefixes loaded into the pool before the first request (``restore``)."""

from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_disk_preload import counted_reads, engine, entry_bytes, hybrid_spilled, spilled
from test_disk_tier import (
    BS,
    COLD_KW,
    MAX_TOKENS,
    SLIDING,
    cold_model,
    hybrid_engine,
    prompts,
    run,
)
from tiny_models import VOCAB, model_of, solo

from mlx_paged import PagedEngine
from mlx_paged.engine import disk_blocks
from mlx_paged.engine.disk_tier import chain_keys
from mlx_paged.storage.disk_entries import chain_arrays, prefixes, run_links
from mlx_paged.storage.disk_format import Run, parse_head
from mlx_paged.storage.preload import file_link

FINGERPRINT = "restore-test"


def links_of(blocks: list[list[int]]) -> dict[str, tuple[str, list[int]]]:
    """``run_links`` of one entry per prefix of ``blocks`` (token lists of whole blocks)."""
    out = {}
    for tokens in blocks:
        keys = chain_keys(tokens, BS)
        chain = chain_arrays(keys[-2] if len(keys) > 1 else "", tokens[-BS:])
        run = Run.of(FINGERPRINT, keys[-1], {"x.y": np.zeros(4, np.uint8), **chain})
        out |= run_links([keys[-1]], run)
    return out


@settings(max_examples=80, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 3), st.integers(1, 6)), min_size=1, max_size=8),
    st.sets(st.integers(0, 40), max_size=6),
)
def test_prefixes_are_the_deepest_prefixes_held_whole_oldest_first(asked, dropped):
    """Prompts that share a trunk or not, some of their blocks missing: the prefixes are
    the longest ones whose every block is there, no one inside another, in the order
    their deepest blocks came."""
    rng = random.Random(1)
    trunk = [rng.randrange(VOCAB) for _ in range(6 * BS)]
    bases = [trunk, trunk[: 2 * BS], trunk[:BS], []]
    bases = [b + [rng.randrange(VOCAB) for _ in range(6 * BS - len(b))] for b in bases]
    seqs = {}  # key -> its whole prefix, in the order blocks came
    for base, n in asked:
        for i in range(1, n + 1):
            tokens = bases[base][: i * BS]
            seqs.setdefault(chain_keys(tokens, BS)[-1], tokens)
    kept = [k for i, k in enumerate(seqs) if i not in dropped]
    links = links_of([seqs[k] for k in kept])
    assert list(links) == kept  # every entry's chain hashes to its key
    whole = [k for k in kept if set(chain_keys(seqs[k], BS)) <= set(kept)]
    inside = {tuple(seqs[k][: i * BS]) for k in whole for i in range(1, len(seqs[k]) // BS)}
    expected = [seqs[k] for k in whole if tuple(seqs[k]) not in inside]
    assert prefixes(links) == expected


def test_entries_whose_chain_does_not_hash_to_their_key_or_without_one_are_not_linked():
    tokens = list(range(3 * BS))
    keys = chain_keys(tokens, BS)
    good = chain_arrays(keys[1], tokens[2 * BS :])
    wrong = chain_arrays(keys[0], tokens[2 * BS :])  # another parent
    layer = {"0.0.k.float32.float32": np.zeros(4, np.uint8)}
    assert run_links([keys[2]], Run.of(FINGERPRINT, keys[2], layer | good)) == {
        keys[2]: (keys[1], tokens[2 * BS :])
    }
    assert run_links([keys[2]], Run.of(FINGERPRINT, keys[2], layer | wrong)) == {}
    assert run_links([keys[2]], Run.of(FINGERPRINT, keys[2], layer)) == {}


def served(path, prompt: list[int]) -> tuple[list[int], list[float]]:
    """``prompt`` served by an engine over ``path``, whose cached blocks are then written."""
    first = engine(path)
    out = run(first, prompt)
    first.disk.spill_cached()
    return out


def restored_with(path, preload: int) -> PagedEngine:
    e = engine(path, preload=preload)
    assert e.disk.preloaded.wait(30)
    return e


def restored(path, **kw) -> PagedEngine:
    e = engine(path, preload=10**7) if not kw else PagedEngine(
        model_of("llama"), block_size=BS, kv_disk_dir=path, kv_disk_bytes=10**8,
        kv_disk_preload_bytes=10**7, **kw,
    )  # fmt: skip
    return e


def test_a_restored_prefix_is_answered_from_memory_as_recomputed(tmp_path, monkeypatch):
    a, b = prompts(21, 2)
    b = a[: 2 * BS] + b[2 * BS :]  # shares a's first two blocks
    expected = served(tmp_path, a), served(tmp_path, b)
    second = restored(tmp_path)
    assert second.disk.restore() == 40 + 24  # a's five blocks, then b's last three
    assert second.stats().total_blocks >= 8  # the pool grew to hold both
    pre, store = second.disk.preloaded, second.disk.store
    assert store.counts["hits"] == 8 and pre.taken == 8 and second.disk.restored_tokens == 64
    assert pre._runs == []  # every entry was asked for: the host memory is given back
    second.check_invariants()
    reads = counted_reads(monkeypatch, second)
    for prompt, (tokens, logprobs) in zip((a, b), expected, strict=True):
        got = run(second, prompt)
        assert got[0] == tokens and np.allclose(got[1], logprobs, atol=1e-6, rtol=0)
        assert got[0] == solo("llama", tuple(prompt), MAX_TOKENS)  # mlx-lm's own cache
    assert reads == [] and store.counts["hits"] == 8  # no load at request time
    stats = second.stats()
    assert stats.disk_hit_tokens == 0 and stats.prefix_hit_tokens == 80


def test_entries_written_without_their_chains_are_not_restored_and_still_load(
    tmp_path, monkeypatch
):
    (a,) = prompts(22, 1)
    with monkeypatch.context() as m:  # files as an older version wrote them
        m.setattr(disk_blocks, "chain_arrays", lambda parent, tokens: {})
        expected = spilled(tmp_path, a)
    second = restored(tmp_path)
    assert second.disk.restore() == 0 and second.disk.preloaded.entries == 5
    got = run(second, a)
    assert got[0] == expected[0] and second.stats().disk_hit_tokens == 40


def test_a_restore_takes_no_more_than_the_pool_holds(tmp_path):
    a, b = prompts(23, 2)
    spilled(tmp_path, a)
    expected = spilled(tmp_path, b)
    second = restored(tmp_path, num_blocks=7)  # room for one prompt's five blocks
    assert second.disk.restore() == 40  # b's, the newest: a's would not fit beside them
    second.check_invariants()
    index, store = second.scheduler.index, second.disk.store
    assert index.full_blocks_matched(a) == 0 and index.full_blocks_matched(b) == 5 * BS
    assert store.counts["hits"] == 5 and second.stats().free_blocks == 2
    got = run(second, b)  # the newest: its blocks were restored last
    assert got[0] == expected[0] and np.allclose(got[1], expected[1], atol=1e-6, rtol=0)
    assert second.stats().prefix_hit_tokens == 40


@pytest.mark.parametrize("length", [41, 40])  # past the last full block, or ending on it
def test_a_hybrid_restore_loads_the_blocks_and_the_snapshots_a_resend_adopts(
    tmp_path, monkeypatch, length
):
    a, expected = hybrid_spilled(tmp_path, 24, length)
    second = hybrid_engine("qwen3_5", tmp_path, kv_disk_preload_bytes=10**7)
    assert second.disk.restore() == 40
    reads = counted_reads(monkeypatch, second)
    got = run(second, a)
    # 40 tokens ending in a snapshot; a 40-token prompt adopts the one at 32 (its last
    # token computed), which came back too.
    assert reads == [] and second.stats().prefix_hit_tokens == (40 if length == 41 else 32)
    assert got[0] == expected[0] and np.allclose(got[1], expected[1], atol=1e-5, rtol=0)


def test_without_a_preload_there_is_nothing_to_restore(tmp_path):
    (a,) = prompts(25, 1)
    spilled(tmp_path, a)
    assert engine(tmp_path).disk.restore() == 0


@pytest.mark.parametrize("cold", [False, True])
def test_spilled_entries_carry_their_chain(tmp_path, cold):
    (a,) = prompts(26, 1, length=97)  # 12 full blocks; with a cold tier, 8 go cold
    kw = COLD_KW if cold else {}
    first = PagedEngine(cold_model(), block_size=BS, kv_disk_dir=tmp_path, kv_disk_bytes=10**8,
                        **kw)  # fmt: skip
    run(first, a)
    assert first.disk.spill_cached() == 12 and (first.stats().cold_blocks > 0) == cold
    store, keys = first.disk.store, chain_keys(a, BS)[:12]
    assert len({store.size(k) for k in keys}) == 1 + cold  # quantized entries are smaller
    for i, key in enumerate(keys):
        out = np.zeros((1, store.size(key)), np.uint8)
        got = store.read_run([key], lambda n, size, out=out: out[:n], True)
        parent = keys[i - 1] if i else ""
        assert run_links([key], got) == {key: (parent, a[i * BS : (i + 1) * BS])}


def test_a_restart_restores_cold_blocks_into_the_cold_tier(tmp_path, monkeypatch):
    (a,) = prompts(27, 1, length=97)
    first = PagedEngine(cold_model(), block_size=BS, kv_disk_dir=tmp_path, kv_disk_bytes=10**8,
                        **COLD_KW)  # fmt: skip
    run(first, a)
    expected = run(first, a)
    assert first.disk.spill_cached() == 12 and first.stats().cold_blocks > 0
    second = PagedEngine(cold_model(), block_size=BS, kv_disk_dir=tmp_path, kv_disk_bytes=10**8,
                         kv_disk_preload_bytes=10**8, **COLD_KW)  # fmt: skip
    assert second.disk.restore() == 96
    assert second.stats().cold_blocks == first.stats().cold_blocks  # back as they were
    reads = counted_reads(monkeypatch, second)
    got = run(second, a)
    assert reads == [] and second.stats().disk_hit_tokens == 0
    assert got[0] == expected[0] and np.allclose(got[1], expected[1], atol=1e-6, rtol=0)


@pytest.mark.parametrize("family", SLIDING)
def test_a_sliding_window_model_restores_its_windows_too(tmp_path, monkeypatch, family):
    (a,) = prompts(28, 1, length=97)  # 12 full blocks; windows of 24 and 20 tokens
    first = PagedEngine(model_of(family), block_size=BS, kv_disk_dir=tmp_path,
                        kv_disk_bytes=10**8)  # fmt: skip
    expected = run(first, a)
    assert first.disk.spill_cached() == 12
    second = PagedEngine(model_of(family), block_size=BS, kv_disk_dir=tmp_path,
                         kv_disk_bytes=10**8, kv_disk_preload_bytes=10**8)  # fmt: skip
    assert second.disk.restore() == 96
    reads = counted_reads(monkeypatch, second)
    got = run(second, a)
    assert reads == [] and second.stats().disk_hit_tokens == 0
    assert second.stats().prefix_hit_tokens == 96
    assert got[0] == expected[0] and np.allclose(got[1], expected[1], atol=1e-5, rtol=0)
    assert got[0] == solo(family, tuple(a), MAX_TOKENS)


def test_a_prompt_larger_than_the_preload_is_restored_with_its_first_blocks_read(
    tmp_path, monkeypatch
):
    """The preload takes a prompt's last blocks (the most recently used); the places of its
    first ones are read from their files, and the load reads their arrays."""
    (a,) = prompts(29, 1)
    expected = spilled(tmp_path, a)
    second = restored_with(tmp_path, 3 * entry_bytes(tmp_path))
    keys = chain_keys(a, BS)[:5]
    assert set(second.disk.preloaded._where) == set(keys[2:])
    reads = counted_reads(monkeypatch, second)
    assert second.disk.restore() == 40
    assert [k for run in reads for k in run] == keys[:2]  # the first two, then no more
    got = run(second, a)
    assert len(reads) == 1 and second.stats().disk_hit_tokens == 0
    assert got[0] == expected[0] and np.allclose(got[1], expected[1], atol=1e-6, rtol=0)


def test_first_blocks_past_the_preloads_bytes_again_or_damaged_leave_the_prompt_unrestored(
    tmp_path,
):
    (a,) = prompts(30, 1)
    expected = spilled(tmp_path, a)
    one = restored_with(tmp_path, entry_bytes(tmp_path))  # the last block; 4 more to read
    assert one.disk.restore() == 0
    keys = chain_keys(a, BS)[:5]
    path, offset, size = one.disk.store.location(keys[0])
    data = bytearray(path.read_bytes())
    specs, payload, _ = parse_head(
        np.frombuffer(bytes(data[offset:]), np.uint8), one.disk.store.fingerprint
    )
    tokens = next(s for s in specs if s.name == "tokens")
    data[offset + payload + tokens.start] ^= 0x01  # the first block's first token
    path.write_bytes(bytes(data))
    assert file_link(one.disk.store, keys[0]) is None and file_link(one.disk.store, keys[1])
    damaged = restored_with(tmp_path, 3 * entry_bytes(tmp_path))
    assert damaged.disk.restore() == 0  # the chain ends at the damaged block
    got = run(damaged, a)  # the load finds the damaged pack and recomputes
    assert got[0] == expected[0] and damaged.stats().disk_hit_tokens == 0
