"""Prompt prefixes on disk for ``make_paged_cache``'s caches: ``save_prefix`` and ``load_prefix``.

Parity is against mlx-lm's own caches on the same model and tokens; state is
checked by block and file counts.
"""

from __future__ import annotations

import random

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache
from tiny_models import HYBRIDS, VOCAB, model_of, tiny_model

from mlx_paged import PagedEngine, load_prefix, make_paged_cache, save_prefix
from mlx_paged.blocks import is_cold
from mlx_paged.cache import disk_prefix
from mlx_paged.storage.disk_entries import STATE, chain_keys

BS = 8
DISK = 10**8


def tokens(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB) for _ in range(n)]


def paged(model, path, **kw):
    return make_paged_cache(model, block_size=BS, kv_disk_dir=path, kv_disk_bytes=DISK, **kw)


def forward(model, toks: list[int], cache) -> mx.array:
    """Last-position logits of ``toks`` run on ``cache``."""
    out = model(mx.array(toks)[None], cache=cache)[0, -1]
    mx.eval(out)
    return out


def greedy(model, toks: list[int], cache, steps: int = 4) -> tuple[list[int], list[mx.array]]:
    """``steps`` greedy tokens after running ``toks``, and each step's logits."""
    out, logits = [], [forward(model, toks, cache)]
    for _ in range(steps):
        out.append(int(mx.argmax(logits[-1])))
        logits.append(forward(model, out[-1:], cache))
    return out, logits


def assert_greedy_as_mlx_lm(model, prompt: list[int], n: int, cache, tol: float = 1e-4) -> None:
    """Greedy tokens and logits of ``cache`` (holding ``prompt[:n]``) run on from ``n`` are
    mlx-lm's own cache's on the whole ``prompt``."""
    got = greedy(model, prompt[n:], cache)
    want = greedy(model, prompt, make_prompt_cache(model))
    assert got[0] == want[0]
    for a, b in zip(got[1], want[1], strict=True):
        assert mx.allclose(a, b, atol=tol, rtol=tol), float(mx.abs(a - b).max())


def restart() -> None:
    """What a new process sees: the directory, indexed afresh."""
    disk_prefix._STORES.clear()


@pytest.mark.parametrize("family", ["llama", "ministral3"])
def test_a_loaded_prefix_gives_mlx_lms_tokens_and_logits(tmp_path, family):
    model, prompt = model_of(family), tokens(45)
    saved = paged(model, tmp_path)
    forward(model, prompt, saved)
    assert save_prefix(saved, prompt) == 40  # the 5 full blocks
    store = disk_prefix._DISKS[saved[0].pool].store
    assert len(store.keys) == 5
    restart()

    cache = paged(model, tmp_path)
    assert load_prefix(cache, prompt) == 40
    table = cache[0].table
    assert table.lengths == [40] * len(table.lengths) and len(table.blocks) == 5
    assert [c.offset for c in cache] == [40] * len(cache)
    assert_greedy_as_mlx_lm(model, prompt, 40, cache)


def test_mlx_lms_generation_runs_on_from_a_loaded_prefix(tmp_path):
    model, prompt = model_of("qwen3"), tokens(70, seed=8)

    def run(toks: list[int], cache) -> list[int]:
        steps = generate_step(mx.array(toks), model, max_tokens=6, prompt_cache=cache)
        return [int(t) for t, _ in steps]

    first = paged(model, tmp_path)
    want = run(prompt, first)
    assert want == run(prompt, make_prompt_cache(model))
    assert save_prefix(first, prompt) == 64
    restart()
    cache = paged(model, tmp_path)
    n = load_prefix(cache, prompt)
    assert n == 64 and run(prompt[n:], cache) == want


def test_a_load_leaves_the_last_token_to_run_and_saves_only_what_the_cache_holds(tmp_path):
    model, prompt = model_of("llama"), tokens(48, seed=1)
    saved = paged(model, tmp_path)
    forward(model, prompt[:30], saved)  # the cache holds 30 of the 48 tokens: 3 blocks
    assert save_prefix(saved, prompt) == 24
    assert save_prefix(saved, prompt) == 24  # nothing new to write
    forward(model, prompt[30:], saved)
    assert save_prefix(saved, mx.array(prompt)) == 48
    cache = paged(model, tmp_path)
    assert load_prefix(cache, prompt) == 40  # 48 are on disk; the last block holds the last token
    assert load_prefix(paged(model, tmp_path), prompt + [1]) == 48
    assert load_prefix(paged(model, tmp_path), tokens(48, seed=2)) == 0  # another prompt


def test_a_window_lost_before_the_save_ends_the_load_where_it_is_missing(tmp_path):
    model = model_of("ministral3")  # sliding window of 20 tokens on every other layer
    prompt = tokens(45, seed=3)
    saved = paged(model, tmp_path)
    out, _ = greedy(model, prompt, saved, steps=30)  # decoding past the window drops blocks
    held = prompt + out[:-1]  # 74 tokens in the cache
    windowed = next(c.table for c in saved if c.window is not None)
    assert windowed.first == 6  # blocks 0-5 went back
    assert save_prefix(saved, held) == 72

    pool = next(c.pool for c in saved if c.window is not None)
    free = pool.blocks.num_free
    cache = paged(model, tmp_path)
    # Past block 6, the window's blocks are on disk: the load takes all 9.
    full = held + [out[-1]]
    assert load_prefix(cache, full) == 72
    got = forward(model, full[72:], cache)
    want = forward(model, full, make_prompt_cache(model))
    assert mx.allclose(got, want, atol=1e-4, rtol=1e-4), float(mx.abs(got - want).max())
    # 50 tokens: the window before token 48 needs blocks 3-5, which no file has.
    short = paged(model, tmp_path)
    assert load_prefix(short, held[:50]) == 0
    assert all(c.table.blocks == [] and c.offset == 0 for c in short)
    del cache, short
    assert pool.blocks.num_free == free


def test_cold_blocks_come_back_bit_for_bit(tmp_path):
    model, prompt = tiny_model("llama", head_dim=64), tokens(101, seed=4)  # groups of 32 or more
    saved = paged(model, tmp_path, kv_bits=8, hot_tokens=16)
    forward(model, prompt[:100], saved)
    forward(model, prompt[100:], saved)  # the step that moves the due blocks to the cold tier
    assert [is_cold(b) for b in saved[0].table.blocks] == [True] * 10 + [False] * 3
    assert save_prefix(saved, prompt) == 96
    restart()
    cache = paged(model, tmp_path, kv_bits=8, hot_tokens=16)
    assert load_prefix(cache, prompt) == 96
    assert [is_cold(b) for b in cache[0].table.blocks] == [True] * 10 + [False] * 2
    for mine, theirs in zip(cache, saved, strict=True):
        for a, b in zip(mine.keys_and_values(), theirs.keys_and_values(), strict=True):
            assert mx.array_equal(a, b[:, :, :96])


def test_a_prefix_the_engine_spilled_loads_into_a_cache(tmp_path):
    model, prompt = model_of("llama"), tokens(45, seed=5)
    engine = PagedEngine(model, block_size=BS, kv_disk_dir=tmp_path, kv_disk_bytes=DISK)
    engine.add_request(prompt, 1)
    list(engine.stream())
    assert engine.disk.spill_cached() > 0
    cache = paged(model, tmp_path)
    assert load_prefix(cache, prompt) == 40
    got = forward(model, prompt[40:], cache)
    want = forward(model, prompt, make_prompt_cache(model))
    assert mx.allclose(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("in_mlx", [False, True], ids=["threads", "mlx"])
def test_a_damaged_file_ends_the_load_before_it_and_goes(tmp_path, monkeypatch, in_mlx):
    monkeypatch.setattr(disk_prefix, "CHECK_IN_MLX", in_mlx)
    model, prompt = model_of("llama"), tokens(45, seed=9)
    saved = paged(model, tmp_path)
    forward(model, prompt[:16], saved)
    assert save_prefix(saved, prompt) == 16  # one file of 2 entries
    forward(model, prompt[16:], saved)
    assert save_prefix(saved, prompt) == 40  # and one of the other 3
    late = max(tmp_path.iterdir(), key=lambda f: f.stat().st_size)
    data = bytearray(late.read_bytes())
    data[len(data) // 2] ^= 0xFF  # the second of its 3 entries' arrays
    late.write_bytes(bytes(data))
    restart()
    cache = paged(model, tmp_path)
    assert load_prefix(cache, prompt) == 24  # 2 blocks, then the first good entry of 3
    assert not late.exists()  # deleted with a log line
    got = forward(model, prompt[24:], cache)
    want = forward(model, prompt, make_prompt_cache(model))
    assert mx.allclose(got, want, atol=1e-4, rtol=1e-4)
    assert load_prefix(paged(model, tmp_path), prompt) == 16  # the damaged file is gone


def test_another_model_or_block_size_never_hits(tmp_path):
    model, prompt = model_of("llama"), tokens(45, seed=6)
    saved = paged(model, tmp_path)
    forward(model, prompt, saved)
    assert save_prefix(saved, prompt) == 40
    other = tiny_model("llama", seed=1)
    assert load_prefix(paged(other, tmp_path), prompt) == 0
    bigger = make_paged_cache(model, block_size=16, kv_disk_dir=tmp_path, kv_disk_bytes=DISK)
    assert load_prefix(bigger, prompt) == 0


def test_bad_input_is_refused(tmp_path):
    model = model_of("llama")
    with pytest.raises(ValueError, match="kv_disk_bytes must be"):
        make_paged_cache(model, kv_disk_dir=tmp_path)
    with pytest.raises(ValueError, match="needs kv_disk_dir"):
        make_paged_cache(model, kv_disk_bytes=DISK)
    with pytest.raises(ValueError, match="no attention layers"):
        paged(model_of("mamba2"), tmp_path)
    with pytest.raises(ValueError, match="max_kv_size"):
        paged(model_of("qwen3"), tmp_path, max_kv_size=32)  # no make_cache of its own
    with pytest.raises(ValueError, match="kv_disk_dir"):
        save_prefix(make_paged_cache(model), tokens(9))
    cache = paged(model, tmp_path)
    with pytest.raises(ValueError, match="token ids"):
        load_prefix(cache, "hello")
    with pytest.raises(ValueError, match="token ids"):
        save_prefix(cache, [1.5, 2])
    forward(model, tokens(9), cache)
    with pytest.raises(ValueError, match="empty cache"):
        load_prefix(cache, tokens(20))


def test_a_directory_that_cannot_be_written_saves_nothing(tmp_path, caplog):
    model, prompt = model_of("llama"), tokens(20, seed=7)
    (tmp_path / "file").write_text("")
    cache = paged(model, tmp_path / "file")  # not a directory: the store turns off, warned
    forward(model, prompt, cache)
    assert save_prefix(cache, prompt) == 0
    assert load_prefix(paged(model, tmp_path / "file"), prompt) == 0
    assert "cannot be used" in caplog.text


# ---- models with recurrent layers: their state is saved at a block boundary ----


def store_of(cache):
    return disk_prefix._disk_of(cache, "test")[0].store


def pool_free(cache) -> list[int]:
    """Free blocks per pool of ``cache``."""
    pools = {id(c.pool): c.pool for c in cache if hasattr(c, "pool")}
    return [p.blocks.num_free for p in pools.values()]


@pytest.mark.parametrize("family", HYBRIDS)  # falcon_h1's layers are CacheLists
def test_a_hybrid_prefix_saved_at_a_block_boundary_gives_mlx_lms_tokens(tmp_path, family):
    model, prompt = model_of(family), tokens(45, seed=10)
    saved = paged(model, tmp_path)
    forward(model, prompt[:40], saved)  # the state after 40 tokens: 5 blocks
    assert save_prefix(saved, prompt) == 40
    store = store_of(saved)
    keys = chain_keys(prompt[:40], BS)
    assert set(store.keys) == {*keys, keys[-1] + STATE}
    restart()

    cache = paged(model, tmp_path)
    assert load_prefix(cache, prompt) == 40
    assert_greedy_as_mlx_lm(model, prompt, 40, cache)


def test_a_hybrid_load_ends_at_the_deepest_saved_state(tmp_path):
    model, prompt = model_of("qwen3_5"), tokens(45, seed=11)
    saved = paged(model, tmp_path)
    forward(model, prompt, saved)  # 45 tokens: the state is past any block boundary
    assert save_prefix(saved, prompt) == 0  # 5 blocks of K/V, no state to load them with
    empty = paged(model, tmp_path, num_blocks=16)
    assert load_prefix(empty, prompt) == 0 and pool_free(empty) == [16]

    again = paged(model, tmp_path)
    forward(model, prompt[:16], again)
    assert save_prefix(again, prompt) == 16  # the state at 16
    forward(model, prompt[16:32], again)
    assert save_prefix(again, prompt) == 32  # and at 32
    cache = paged(model, tmp_path)
    assert load_prefix(cache, prompt) == 32
    assert [len(c.table.blocks) for c in cache if hasattr(c, "table")][0] == 4
    got = forward(model, prompt[32:], cache)
    want = forward(model, prompt, make_prompt_cache(model))
    assert mx.allclose(got, want, atol=1e-4, rtol=1e-4), float(mx.abs(got - want).max())

    # A damaged state at 32: the load falls back to the one at 16 and gives back 2 blocks.
    store = store_of(cache)
    path, offset, size = store.location(chain_keys(prompt[:32], BS)[-1] + STATE)
    data = bytearray(path.read_bytes())
    data[offset + size // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    restart()
    cache = paged(model, tmp_path, num_blocks=16)
    assert load_prefix(cache, prompt) == 16
    assert pool_free(cache) == [14] and not path.exists()
    got = forward(model, prompt[16:], cache)
    assert mx.allclose(got, want, atol=1e-4, rtol=1e-4), float(mx.abs(got - want).max())


def test_a_hybrid_prefix_the_engine_spilled_loads_into_a_cache(tmp_path):
    model, prompt = model_of("lfm2"), tokens(45, seed=12)
    engine = PagedEngine(
        model, block_size=BS, state_snapshot_interval=16, kv_disk_dir=tmp_path,
        kv_disk_bytes=DISK,
    )  # fmt: skip
    engine.add_request(prompt, 1)
    list(engine.stream())
    assert engine.disk.spill_cached() == 5 + 3  # blocks, and states at 16, 32 and 40
    cache = paged(model, tmp_path)
    assert load_prefix(cache, prompt) == 40
    got = forward(model, prompt[40:], cache)
    want = forward(model, prompt, make_prompt_cache(model))
    assert mx.allclose(got, want, atol=1e-4, rtol=1e-4), float(mx.abs(got - want).max())


def test_the_state_of_a_batch_is_refused(tmp_path):
    model, prompt = model_of("lfm2"), tokens(16, seed=13)
    cache = paged(model, tmp_path)
    forward(model, prompt, cache)
    state = next(c for c in cache if not hasattr(c, "pool"))
    state.cache = [None if a is None else mx.concatenate([a, a]) for a in state.cache]
    with pytest.raises(ValueError, match="one sequence"):
        save_prefix(cache, prompt)
    assert store_of(cache).keys == []  # refused before anything was written


@pytest.mark.gpu
@pytest.mark.skipif(not mx.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_a_prefix_loaded_on_the_gpu_gives_mlx_lms_tokens_there(tmp_path, family):
    """The GPU's load path (pinned staging buffers, the sums checked in MLX) and, for
    qwen3_5, the CUDA GatedDeltaNet kernel, against mlx-lm's caches on the same GPU."""
    dims = dict(linear_key_head_dim=32, linear_value_head_dim=32) if family == "qwen3_5" else {}
    model, prompt = tiny_model(family, **dims), tokens(45, seed=14)
    saved = paged(model, tmp_path)
    forward(model, prompt[:40], saved)
    assert save_prefix(saved, prompt) == 40
    restart()
    cache = paged(model, tmp_path)
    assert load_prefix(cache, prompt) == 40
    assert_greedy_as_mlx_lm(model, prompt, 40, cache, tol=1e-3)
