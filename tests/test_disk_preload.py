"""A disk tier's newest entries read into host memory at start (``kv_disk_preload_bytes``)."""

from __future__ import annotations

import os
import threading
import time
from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest
from test_disk_tier import BS, hybrid_engine, prompts, run
from tiny_models import model_of

from mlx_paged import PagedEngine
from mlx_paged.engine import disk_tier
from mlx_paged.engine.disk_tier import chain_keys
from mlx_paged.storage import disk, disk_entries, preload
from mlx_paged.storage.preload import Preload


def engine(path, preload: int = 0) -> PagedEngine:
    return PagedEngine(model_of("llama"), block_size=BS, kv_disk_dir=path, kv_disk_bytes=10**8,
                       kv_disk_preload_bytes=preload)  # fmt: skip


def spilled(path, prompt: list[int]) -> tuple[list[int], list[float]]:
    """Serve ``prompt`` in an engine over ``path``, write its blocks, and return its output."""
    first = engine(path)
    out = run(first, prompt)
    assert first.disk.spill_cached() == 5  # 41 + 3 written tokens: 5 full blocks
    return out


def counted_reads(monkeypatch, e: PagedEngine) -> list[list[str]]:
    """The keys of each ``read_run`` of ``e``'s store from now on."""
    calls, read_run = [], e.disk.store.read_run

    def counted(keys, *args):
        calls.append(keys)
        return read_run(keys, *args)

    monkeypatch.setattr(e.disk.store, "read_run", counted)
    return calls


def entry_bytes(path) -> int:
    return os.path.getsize(next(p for p in path.iterdir() if p.suffix == ".kvp")) // 5


# Runs of the whole prompt, of one entry (each a view inside a chunk), and chunks of two.
@pytest.mark.parametrize("batch, chunk", [(64, None), (1, None), (64, 2)])
def test_a_preloaded_restart_reads_no_file_and_answers_as_recomputed(
    tmp_path, monkeypatch, batch, chunk
):
    preloaded_restart(tmp_path, monkeypatch, batch, chunk)


@pytest.mark.gpu
@pytest.mark.skipif(not mx.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_a_preloaded_restart_copies_its_pinned_rows(tmp_path, monkeypatch):
    pre = preloaded_restart(tmp_path, monkeypatch, 1, None, 1e-4)  # rows inside the chunk
    assert pre.staging.pinned, "the pinned copy failed its check on this GPU"


def preloaded_restart(
    tmp_path, monkeypatch, batch: int, chunk: int | None, atol: float = 1e-6
) -> Preload:
    (a,) = prompts(1, 1)
    expected = spilled(tmp_path, a)
    monkeypatch.setattr(disk_tier, "LOAD_BATCH", batch)
    if chunk is not None:
        monkeypatch.setattr(disk_tier, "LOAD_BYTES", chunk * entry_bytes(tmp_path))
    second = engine(tmp_path, preload=10**7)
    pre = second.disk.preloaded
    assert pre.wait(30) and pre.entries == 5 and pre.bytes == 5 * entry_bytes(tmp_path)
    assert [len(keys) for keys, _ in pre._runs] == ([5] if chunk is None else [2, 2, 1])
    assert set(pre._where) == set(chain_keys(a, BS))
    reads = counted_reads(monkeypatch, second)
    got = run(second, a)
    assert reads == []  # every run came from the preload
    assert got[0] == expected[0] and np.allclose(got[1], expected[1], atol=atol, rtol=0)
    assert second.stats().disk_hit_tokens == 40 and second.disk.store.counts["hits"] == 5
    assert pre._runs == []  # released (a pinned staging unpins on a thread of its own)
    if not pre.staging.pinned:
        assert pre.staging._buffers == [None] * len(pre.staging)
    return pre


def test_a_preload_takes_the_newest_entries_that_fit_and_holds_them_until_asked(
    tmp_path, monkeypatch
):
    a, b = prompts(2, 2)
    expected_a, expected_b = spilled(tmp_path, a), spilled(tmp_path, b)
    old = os.path.getmtime(next(tmp_path.iterdir())) - 100
    for p in tmp_path.iterdir():  # a's pack older than b's
        if p.name.split("-")[1] == chain_keys(a, BS)[0]:
            os.utime(p, (old, old))
    second = engine(tmp_path, preload=5 * entry_bytes(tmp_path))  # b's five entries only
    pre = second.disk.preloaded
    assert pre.wait(30) and set(pre._where) == set(chain_keys(b, BS))
    reads = counted_reads(monkeypatch, second)
    got = run(second, a)  # read from disk; b's entries stay
    assert [len(keys) for keys in reads] == [5] and reads[0][0] == chain_keys(a, BS)[0]
    assert got[0] == expected_a[0] and len(pre._runs) == 1
    got = run(second, b)  # from the preload, which then goes
    assert len(reads) == 1 and got[0] == expected_b[0]
    assert np.allclose(got[1], expected_b[1], atol=1e-6, rtol=0)
    assert pre._runs == [] and pre.staging._buffers == [None]


def test_files_preloaded_in_another_order_than_the_prompts_still_serve_every_run(
    tmp_path, monkeypatch
):
    """Files used (read) in another order than the prompt's blocks are preloaded in that
    order; the load's runs part where the preload's order does."""
    monkeypatch.setattr(disk, "PACK_ENTRIES", 1)  # a file per entry
    (a,) = prompts(6, 1)
    expected = spilled(tmp_path, a)
    keys = chain_keys(a, BS)[:5]
    for age, i in enumerate([2, 3, 0, 1, 4]):  # oldest first
        path = engine(tmp_path).disk.store.location(keys[i])[0]
        os.utime(path, (1e9 + age, 1e9 + age))
    second = engine(tmp_path, preload=10**7)
    pre = second.disk.preloaded
    assert pre.wait(30) and pre._runs[0][0] == [keys[i] for i in [2, 3, 0, 1, 4]]
    reads, took = counted_reads(monkeypatch, second), []
    take = pre.take
    monkeypatch.setattr(pre, "take", lambda ks: (took.append(ks), take(ks))[1])
    got = run(second, a)
    assert reads == [] and took == [keys[0:2], keys[2:4], keys[4:5]]
    assert got[0] == expected[0] and np.allclose(got[1], expected[1], atol=1e-6, rtol=0)


def test_a_load_that_begins_inside_a_chunk_takes_the_rows_from_there(tmp_path, monkeypatch):
    (a,) = prompts(3, 1)
    expected = spilled(tmp_path, a)
    second = engine(tmp_path, preload=10**7)
    assert second.disk.preloaded.wait(30)
    reads = counted_reads(monkeypatch, second)
    head = run(second, a[: 3 * BS] + [1])  # loads a's first three blocks
    assert second.stats().disk_hit_tokens == 3 * BS
    assert second.disk.preloaded._runs != []  # two entries not asked for yet
    got = run(second, a)  # the last two: rows 3 and 4 of the chunk
    assert reads == [] and second.stats().disk_hit_tokens == 5 * BS
    assert got[0] == expected[0] and np.allclose(got[1], expected[1], atol=1e-6, rtol=0)
    assert head[0] == run(engine(tmp_path / "other"), a[: 3 * BS] + [1])[0]
    assert second.disk.preloaded._runs == []


@pytest.mark.parametrize("in_mlx", [True, False])  # loads check payloads in MLX, or on the host
def test_a_damaged_entry_is_never_loaded_from_a_preload(tmp_path, monkeypatch, in_mlx):
    monkeypatch.setattr(disk_tier, "CHECK_IN_MLX", in_mlx)
    (a,) = prompts(4, 1)
    expected = spilled(tmp_path, a)
    path, offset, size = engine(tmp_path).disk.store.location(chain_keys(a, BS)[2])
    data = bytearray(path.read_bytes())
    data[offset + size // 2] ^= 0xFF  # the third entry's arrays
    path.write_bytes(bytes(data))
    second = engine(tmp_path, preload=10**7)
    pre = second.disk.preloaded
    assert pre.wait(30)
    # Wherever loads check, the preload checks the sums as it reads: it stops at the bad
    # entry and deletes its pack (which held all five) before any request.
    assert pre.entries == 2 and not path.exists()
    got = run(second, a)
    assert got[0] == expected[0] and np.allclose(got[1], expected[1], atol=1e-5, rtol=0)
    assert second.stats().disk_hit_tokens == 0
    assert pre._runs == []  # the store has none of the rest: nothing left to hold them for


@pytest.mark.parametrize("preloaded", [True, False])
def test_runs_taken_from_a_preload_are_not_checked_again_in_mlx(tmp_path, monkeypatch, preloaded):
    """Where loads check payloads in MLX (a GPU), a preloaded run was checked as it was
    read: its load adds no check (and reads no flags back); a run read from disk does."""
    monkeypatch.setattr(disk_tier, "CHECK_IN_MLX", True)
    (a,) = prompts(7, 1)
    expected = spilled(tmp_path, a)
    second = engine(tmp_path, preload=10**7 if preloaded else 0)
    assert not preloaded or second.disk.preloaded.wait(30)
    checks, check = [], disk_entries.payload_ok
    monkeypatch.setattr(disk_entries, "payload_ok", lambda *a: (checks.append(1), check(*a))[1])
    got = run(second, a)
    assert second.stats().disk_hit_tokens == 5 * BS and len(checks) == (0 if preloaded else 1)
    assert got[0] == expected[0] and np.allclose(got[1], expected[1], atol=1e-6, rtol=0)


def test_release_with_force_gives_the_memory_back_at_once(tmp_path):
    (a,) = prompts(5, 1)
    spilled(tmp_path, a)
    pre = engine(tmp_path, preload=10**7).disk.preloaded
    assert pre.wait(30) and not pre.release() and pre._runs
    assert pre.release(force=True) and pre._runs == [] and pre._where == {}


def test_entries_no_load_asks_for_are_held_until_the_hold_ends(tmp_path, monkeypatch):
    (a,) = prompts(5, 1)
    spilled(tmp_path, a)
    pre = engine(tmp_path, preload=10**7).disk.preloaded
    assert pre.wait(30) and not pre.release() and pre.held_bytes == 5 * entry_bytes(tmp_path)
    monkeypatch.setattr(preload, "HOLD_SECONDS", time.monotonic() - pre._ended)
    assert pre.release() and pre.held_bytes == 0 and pre._where == {}


def test_an_idle_servers_engine_thread_gives_the_preload_back_once_its_hold_ends(
    tmp_path, monkeypatch
):
    from mlx_paged.server.worker import EngineWorker

    (a,) = prompts(5, 1)
    spilled(tmp_path, a)
    monkeypatch.setattr(preload, "HOLD_SECONDS", 0.0)
    tokenizer = SimpleNamespace(eos_token_ids=[0], has_thinking=False, has_tool_calling=False)
    worker = EngineWorker(lambda: (engine(tmp_path, preload=10**7), tokenizer))
    worker.start(60)
    try:
        pre = worker.engine.disk.preloaded
        assert pre.wait(30) and pre.entries == 5
        for _ in range(100):  # no request comes: the idle loop releases it
            if pre.held_bytes == 0:
                break
            time.sleep(0.1)
        assert pre.held_bytes == 0 and pre._where == {}
    finally:
        worker.stop(30)


@pytest.mark.parametrize("bad", [-1, 1.5, True, "1GB"])
def test_bad_preload_bytes_are_refused(tmp_path, bad):
    with pytest.raises(ValueError, match="kv_disk_preload_bytes"):
        engine(tmp_path, preload=bad)


def test_a_preload_needs_a_directory():
    with pytest.raises(ValueError, match="needs kv_disk_dir"):
        PagedEngine(model_of("llama"), block_size=BS, kv_disk_preload_bytes=1 << 20)


def test_a_load_leaves_its_files_used_in_the_prompts_order(tmp_path, monkeypatch):
    """Files written one after another, then used by a load in any order of reads, are
    found by a later process in the prompt's order: the order a preload reads them in."""
    monkeypatch.setattr(disk, "PACK_ENTRIES", 1)  # a file per entry
    monkeypatch.setattr(disk_tier, "LOAD_BATCH", 1)  # runs of one, two read at once
    (a,) = prompts(7, 1)
    spilled(tmp_path, a)
    keys = chain_keys(a, BS)[:5]
    assert engine(tmp_path).disk.store.keys == keys  # as written
    for age, i in enumerate([4, 2, 0, 3, 1]):
        os.utime(engine(tmp_path).disk.store.location(keys[i])[0], (1e9 + age, 1e9 + age))
    second = engine(tmp_path)
    assert second.disk.store.keys == [keys[i] for i in [4, 2, 0, 3, 1]]
    run(second, a)
    second.disk.store.flush()
    assert second.disk.store.keys == keys and engine(tmp_path).disk.store.keys == keys


def test_a_load_before_the_preload_is_done_reads_and_a_later_load_gives_the_memory_back(
    tmp_path, monkeypatch
):
    (a,) = prompts(8, 1)
    b = [(t + 1) % 97 for t in a]  # on disk: nothing of it
    expected = spilled(tmp_path, a)
    go, read_run = threading.Event(), disk.DiskStore.read_run

    def held(store, *args, **kwargs):  # the preload's thread waits for ``go``
        if threading.current_thread().name == "mlx_paged-disk-preload":
            go.wait(30)
        return read_run(store, *args, **kwargs)

    monkeypatch.setattr(disk.DiskStore, "read_run", held)
    second = engine(tmp_path, preload=10**7)
    pre = second.disk.preloaded
    got = run(second, a)  # read from disk, the preload not done
    assert got[0] == expected[0] and second.stats().disk_hit_tokens == 40 and pre.taken == 0
    go.set()
    assert pre.wait(30) and pre.entries == 5 and pre._runs  # all asked for, held until ...
    run(second, b)  # ... the next load
    assert pre._runs == [] and pre.staging._buffers == [None] * len(pre.staging)


def hybrid_spilled(
    path, seed: int, length: int = 41
) -> tuple[list[int], tuple[list[int], list[float]]]:
    """A prompt served by a Qwen3.5-shaped hybrid over ``path``, written, and its output."""
    (a,) = prompts(seed, 1, length)
    first = hybrid_engine("qwen3_5", path)
    expected = run(first, a)
    assert first.disk.spill_cached() == 5 + 3  # 5 blocks, 3 snapshots
    return a, expected


def test_a_hybrid_preloads_its_blocks_and_reads_its_snapshot(tmp_path, monkeypatch):
    a, expected = hybrid_spilled(tmp_path, 9)
    second = hybrid_engine("qwen3_5", tmp_path, kv_disk_preload_bytes=10**7)
    pre = second.disk.preloaded
    assert pre.wait(30) and set(pre._where) == set(chain_keys(a, BS))  # no snapshot
    reads = counted_reads(monkeypatch, second)
    got = run(second, a)
    assert [len(keys) for keys in reads] == [1] and reads[0][0].endswith("s")  # the snapshot
    assert second.stats().prefix_hit_tokens == 40 and pre.taken == 5
    assert got[0] == expected[0] and np.allclose(got[1], expected[1], atol=1e-5, rtol=0)
