"""KVPool on CPU MLX (float32): exact round trips, copy-on-write, exhaustion, bad input."""

from __future__ import annotations

import gc
from dataclasses import dataclass

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from mlx_paged import PoolExhaustedError, PoolTooSmallError
from mlx_paged.blocks import BlockTable
from mlx_paged.storage import KVPool

RNG = np.random.default_rng(0)


def chunk(n: int, heads: int = 2, k_dim: int = 4, v_dim: int | None = None):
    """Random K and V shaped (1, heads, n, dim), float32, as numpy."""
    k = RNG.standard_normal((1, heads, n, k_dim)).astype(np.float32)
    v = RNG.standard_normal((1, heads, n, v_dim or k_dim)).astype(np.float32)
    return k, v


def write(pool: KVPool, table: BlockTable, layer: int, k: np.ndarray, v: np.ndarray) -> None:
    """write_prefill, or append for a single token."""
    op = pool.append if k.shape[2] == 1 else pool.write_prefill
    op(table, layer, mx.array(k), mx.array(v))


def visible(pool: KVPool, table: BlockTable, layer: int = 0) -> tuple[np.ndarray, np.ndarray]:
    k, v = pool.gather_visible(table, layer)
    return np.array(k), np.array(v)


def assert_visible(pool, table, layer, k, v) -> None:
    """gather_visible returns exactly ``k`` and ``v`` (same shape, dtype and bits)."""
    got_k, got_v = visible(pool, table, layer)
    assert got_k.dtype == k.dtype and got_v.dtype == v.dtype
    np.testing.assert_array_equal(got_k, k)
    np.testing.assert_array_equal(got_v, v)


def snapshot(pool: KVPool, *tables: BlockTable):
    """Everything a failed write must leave alone."""
    return (
        [(list(t.blocks), t.first, list(t.lengths)) for t in tables],
        list(pool.blocks.refcounts),
        pool.blocks.stats(),
    )


# ---- round trips ----------------------------------------------------------


@pytest.mark.parametrize("num_blocks", [8, None])
@pytest.mark.parametrize(
    "chunks", [[8], [16], [13], [5, 1, 1, 1, 9], [3, 5, 8, 1, 1], [1] * 10, [20, 1, 4]]
)
def test_cold_round_trip(chunks, num_blocks):
    """Chunks written one after another read back as their exact concatenation."""
    pool = KVPool(num_layers=1, block_size=8, num_blocks=num_blocks)
    table = pool.new_table()
    ks, vs = [], []
    for n in chunks:
        k, v = chunk(n)
        write(pool, table, 0, k, v)
        ks.append(k)
        vs.append(v)
        total = sum(x.shape[2] for x in ks)
        assert table.lengths == [total]
        assert table.blocks == list(range(-(-total // 8)))  # a cold pool hands out 0, 1, ...
        assert_visible(pool, table, 0, np.concatenate(ks, axis=2), np.concatenate(vs, axis=2))
    pool.blocks.check_invariants(tables=[table.blocks])


def test_gather_returns_a_token_range():
    """gather(start, end) is the slice [start, end) of what was written."""
    pool = KVPool(num_layers=1, block_size=4, num_blocks=8)
    table = pool.new_table()
    k, v = chunk(15)
    write(pool, table, 0, k, v)
    for start, end in [(0, 15), (5, 11), (4, 8), (14, 15), (3, 4)]:
        gk, gv = pool.gather(table, 0, start, end)
        np.testing.assert_array_equal(np.array(gk), k[:, :, start:end])
        np.testing.assert_array_equal(np.array(gv), v[:, :, start:end])


def test_different_key_and_value_head_dims():
    """An MLA-style layer (1 head, K dim 32, V dim 8) round-trips exactly."""
    pool = KVPool(num_layers=1, block_size=8, num_blocks=4)
    table = pool.new_table()
    k1, v1 = chunk(11, heads=1, k_dim=32, v_dim=8)
    k2, v2 = chunk(1, heads=1, k_dim=32, v_dim=8)
    write(pool, table, 0, k1, v1)
    write(pool, table, 0, k2, v2)
    assert pool.keys[0].shape == (4, 8, 1, 32)
    assert pool.values[0].shape == (4, 8, 1, 8)
    assert pool.blocks.bytes_per_block == 8 * (32 + 8) * 4
    assert pool.blocks.stats().bytes == 4 * 8 * (32 + 8) * 4
    assert_visible(pool, table, 0, np.concatenate([k1, k2], 2), np.concatenate([v1, v2], 2))


def test_growable_pool_grows_arrays_and_keeps_contents():
    """With num_blocks=None every layer's arrays grow and old tokens survive."""
    pool = KVPool(num_layers=2, block_size=4, num_blocks=None)
    table = pool.new_table()
    data = [chunk(10), chunk(10)]
    for layer, (k, v) in enumerate(data):
        write(pool, table, layer, k, v)
    assert pool.blocks.capacity == 3
    more = [chunk(9), chunk(9)]
    for layer, (k, v) in enumerate(more):
        write(pool, table, layer, k, v)
    assert pool.blocks.capacity == 5  # 19 tokens; growing by the shortfall (a quarter of 3 is 0)
    for layer in range(2):
        assert pool.keys[layer].shape == (5, 4, 2, 4)
        k = np.concatenate([data[layer][0], more[layer][0]], 2)
        v = np.concatenate([data[layer][1], more[layer][1]], 2)
        assert_visible(pool, table, layer, k, v)
    assert pool.blocks.stats().bytes == 5 * 2 * 4 * (2 * 4 + 2 * 4) * 4


def test_dropped_table_gives_its_blocks_back():
    """A table garbage-collected without release returns its blocks to the pool."""
    pool = KVPool(num_layers=1, block_size=4, num_blocks=4)
    table = pool.new_table()
    write(pool, table, 0, *chunk(9))
    assert pool.blocks.refcounts == [1, 1, 1, 0]
    del table
    gc.collect()
    assert pool.blocks.refcounts == [0, 0, 0, 0]
    pool.blocks.check_invariants(tables=[])


# ---- sharing and copy-on-write --------------------------------------------


@pytest.mark.parametrize("num_layers", [1, 2])
@pytest.mark.parametrize("suffixes", [(6, 3), (1, 1), (3, 12)])
def test_shared_partial_tail_is_copied_on_write(num_layers, suffixes):
    """Two tables sharing a half-full tail block each write their own suffix safely."""
    pool = KVPool(num_layers=num_layers, block_size=8, num_blocks=8)
    t1 = pool.new_table()
    prefix = [chunk(13) for _ in range(num_layers)]
    for layer, (k, v) in enumerate(prefix):
        write(pool, t1, layer, k, v)
    t2 = pool.fork(t1)
    assert t1.blocks == t2.blocks == [0, 1]
    assert pool.blocks.refcounts[:3] == [2, 2, 0]
    pool.blocks.check_invariants(tables=[t1.blocks, t2.blocks])

    # t1 writes first: its tail is shared, so it gets a private copy (block 2).
    s1 = [chunk(suffixes[0]) for _ in range(num_layers)]
    write(pool, t1, 0, *s1[0])
    assert t1.blocks[:2] == [0, 2]
    assert pool.blocks.refcounts[:3] == [2, 1, 1]
    for layer in range(1, num_layers):  # the copy covered every layer, not just this one
        np.testing.assert_array_equal(np.array(pool.keys[layer][2]), np.array(pool.keys[layer][1]))
        np.testing.assert_array_equal(
            np.array(pool.values[layer][2]), np.array(pool.values[layer][1])
        )
    for layer in range(1, num_layers):
        write(pool, t1, layer, *s1[layer])
    assert t1.blocks[:2] == [0, 2]  # later layers wrote in place

    # t2 is now the sole owner of block 1 and writes in place.
    s2 = [chunk(suffixes[1]) for _ in range(num_layers)]
    for layer in range(num_layers):
        write(pool, t2, layer, *s2[layer])
    assert t2.blocks[:2] == [0, 1]
    assert pool.blocks.refcounts[:3] == [2, 1, 1]
    assert len(t1.blocks) == -(-(13 + suffixes[0]) // 8)
    assert len(t2.blocks) == -(-(13 + suffixes[1]) // 8)
    pool.blocks.check_invariants(tables=[t1.blocks, t2.blocks])

    for layer in range(num_layers):
        (pk, pv), (ak, av), (bk, bv) = prefix[layer], s1[layer], s2[layer]
        assert_visible(pool, t1, layer, np.concatenate([pk, ak], 2), np.concatenate([pv, av], 2))
        assert_visible(pool, t2, layer, np.concatenate([pk, bk], 2), np.concatenate([pv, bv], 2))


def buffer_address(a: mx.array) -> int:
    """Where ``a``'s data lies (the view is dropped at once: it would hold the buffer)."""
    mx.eval(a)
    view = np.asarray(memoryview(a))
    address = view.ctypes.data
    del view
    return address


def test_copy_on_write_copies_update_the_pool_in_place():
    """A burst of copies into one pool leaves every layer's arrays in their buffers: had
    a write's value still read the array it writes, MLX would have copied the whole
    array for each block copied (DESIGN.md: exactly one reference to each pool array)."""
    pool = KVPool(num_layers=3, block_size=4, num_blocks=64)
    table = pool.new_table()
    for layer in range(3):
        write(pool, table, layer, *chunk(10))
    before = [buffer_address(a) for a in (*pool.keys, *pool.values)]
    for dst in range(20, 30):  # checked after each: a copy's new buffer differs from its input
        pool.copy_block(dst % 3, dst)
        assert [buffer_address(a) for a in (*pool.keys, *pool.values)] == before, dst
    for layer in range(3):
        for dst in range(20, 30):
            src = dst % 3
            np.testing.assert_array_equal(
                np.array(pool.keys[layer][dst]), np.array(pool.keys[layer][src])
            )
            np.testing.assert_array_equal(
                np.array(pool.values[layer][dst]), np.array(pool.values[layer][src])
            )


def test_queued_copies_are_made_together_in_one_evaluation(monkeypatch):
    """Copies wait for the arrays' next use and are made there with one evaluation: one
    per copy waited for the device once per request adopting a partial block (run 291)."""
    pool = KVPool(num_layers=3, block_size=4, num_blocks=64)
    table = pool.new_table()
    for layer in range(3):
        write(pool, table, layer, *chunk(10))
    want = [np.array(a[:3]) for a in (*pool.keys, *pool.values)]
    evals = []
    eval_ = mx.eval
    monkeypatch.setattr(mx, "eval", lambda *a: evals.append(a) or eval_(*a))
    for dst in range(20, 30):
        pool.copy_block(dst % 3, dst)
    assert evals == []
    arrays = (*pool.keys, *pool.values)
    assert len(evals) == 1
    for a, blocks in zip(arrays, want, strict=True):
        for dst in range(20, 30):
            np.testing.assert_array_equal(np.array(a[dst]), blocks[dst % 3])


@settings(max_examples=60, deadline=None)
@given(copies=st.lists(st.tuples(st.integers(0, 7), st.integers(0, 7)), max_size=12))
def test_queued_copies_read_what_each_source_held_when_it_was_copied(copies):
    """Against copies made one at a time: a source that is a queued destination, a
    destination queued twice and a destination that is an earlier copy's source."""
    pool = KVPool(num_layers=2, block_size=2, num_blocks=8)
    table = pool.new_table()
    for layer in range(2):
        write(pool, table, layer, *chunk(16))
    model = [np.array(a) for a in (*pool.keys, *pool.values)]
    for src, dst in copies:
        pool.copy_block(src, dst)
        for m in model:
            m[dst] = m[src]
    for a, m in zip((*pool.keys, *pool.values), model, strict=True):
        np.testing.assert_array_equal(np.array(a), m)


def test_truncated_fork_copies_before_overwriting():
    """After truncating into a shared block, new tokens go to a copy; the fork keeps its own."""
    pool = KVPool(num_layers=1, block_size=4, num_blocks=8)
    t1 = pool.new_table()
    k, v = chunk(10)
    write(pool, t1, 0, k, v)
    t2 = pool.fork(t1)
    pool.truncate(t1, 0, 6)  # drops t1's reference to block 2 only
    assert t1.blocks == [0, 1]
    assert pool.blocks.refcounts[:3] == [2, 2, 1]
    k2, v2 = chunk(3)
    write(pool, t1, 0, k2, v2)
    assert t1.blocks[0] == 0 and t1.blocks[1] not in (0, 1, 2)
    pool.blocks.check_invariants(tables=[t1.blocks, t2.blocks])
    assert_visible(
        pool, t1, 0, np.concatenate([k[:, :, :6], k2], 2), np.concatenate([v[:, :, :6], v2], 2)
    )
    assert_visible(pool, t2, 0, k, v)


def test_later_layers_of_a_step_reuse_the_reservation(monkeypatch):
    """Layer 0 reserves a prefill chunk's blocks; the other layers of the step do not."""
    pool = KVPool(num_layers=3, block_size=4, num_blocks=8)
    table = pool.new_table()
    calls = []
    reserve = pool.reserve
    monkeypatch.setattr(pool, "reserve", lambda *a: calls.append(a[1:]) or reserve(*a))
    k, v = chunk(6)
    for layer in range(3):
        write(pool, table, layer, k, v)
    assert calls == [(0, 6)] and table.blocks == [0, 1]
    for layer in range(3):
        assert_visible(pool, table, layer, k, v)


def test_fork_between_layers_still_copies_on_write():
    """A fork taken after layer 0 reserved the chunk makes layer 1 copy the shared blocks."""
    pool = KVPool(num_layers=2, block_size=4, num_blocks=8)
    t1 = pool.new_table()
    k, v = chunk(6)
    write(pool, t1, 0, k, v)
    t2 = pool.fork(t1)  # shares blocks 0 and 1, which layer 1 has not written yet
    k1, v1 = chunk(6)
    write(pool, t1, 1, k1, v1)
    assert t2.blocks == [0, 1] and sorted(t1.blocks) == [2, 3]
    assert pool.blocks.refcounts[:4] == [1, 1, 1, 1]
    pool.blocks.check_invariants(tables=[t1.blocks, t2.blocks])
    assert_visible(pool, t1, 0, k, v)
    assert_visible(pool, t1, 1, k1, v1)
    assert_visible(pool, t2, 0, k, v)


def test_fork_after_drop_before_keeps_the_window():
    """A fork of a table that gave back its head blocks reads the same tokens."""
    pool = KVPool(num_layers=1, block_size=4, num_blocks=6)
    t1 = pool.new_table()
    k, v = chunk(10)
    write(pool, t1, 0, k, v)
    pool.drop_before(t1, 8)
    t2 = pool.fork(t1)
    assert (t2.blocks, t2.first, t2.lengths) == ([2], 2, [10])
    assert pool.blocks.refcounts[:3] == [0, 0, 2]
    assert_visible(pool, t2, 0, k[:, :, 8:], v[:, :, 8:])
    k2, v2 = chunk(1)
    write(pool, t2, 0, k2, v2)  # block 2 is shared: t2 copies it first
    assert t2.blocks != [2] and t1.blocks == [2]
    pool.blocks.check_invariants(tables=[t1.blocks, t2.blocks])
    assert_visible(pool, t1, 0, k[:, :, 8:], v[:, :, 8:])
    assert_visible(
        pool, t2, 0, np.concatenate([k[:, :, 8:], k2], 2), np.concatenate([v[:, :, 8:], v2], 2)
    )


# ---- storage dtype --------------------------------------------------------


def test_kv_dtype_stores_float16_and_reads_float32():
    """kv_dtype=float16 stores halves; gather casts back to the input dtype."""
    pool = KVPool(num_layers=1, block_size=4, num_blocks=4, kv_dtype=mx.float16)
    table = pool.new_table()
    k, v = chunk(6)
    write(pool, table, 0, k, v)
    assert pool.keys[0].dtype == mx.float16
    assert pool.values[0].dtype == mx.float16
    assert pool.blocks.bytes_per_block == 4 * 2 * (4 + 4) * 2

    def rounded(x):
        return x.astype(np.float16).astype(np.float32)

    assert not np.array_equal(rounded(k), k)  # the cast is visible in this data
    assert_visible(pool, table, 0, rounded(k), rounded(v))


def test_default_dtype_is_the_models():
    """Without kv_dtype the pool stores the dtype it was given."""
    pool = KVPool(num_layers=1, block_size=4, num_blocks=4)
    table = pool.new_table()
    k, v = chunk(3)
    write(pool, table, 0, k, v)
    assert pool.keys[0].dtype == mx.float32
    assert pool.values[0].dtype == mx.float32


# ---- giving blocks back ---------------------------------------------------


def test_drop_before_releases_only_whole_leading_blocks():
    """drop_before(p) gives back the blocks holding only tokens before p."""
    pool = KVPool(num_layers=1, block_size=4, num_blocks=6)
    table = pool.new_table()
    k, v = chunk(14)
    write(pool, table, 0, k, v)
    other = pool.fork(table)
    assert table.blocks == [0, 1, 2, 3]
    pool.drop_before(table, 3)  # block 0 still holds token 3
    assert (table.blocks, table.first) == ([0, 1, 2, 3], 0)
    pool.drop_before(table, 9)  # blocks 0 and 1 hold tokens 0..7 only
    assert (table.blocks, table.first) == ([2, 3], 2)
    assert pool.blocks.refcounts == [1, 1, 2, 2, 0, 0]
    pool.drop_before(table, 11)  # still inside block 2: nothing to give back
    assert table.blocks == [2, 3]
    assert_visible(pool, table, 0, k[:, :, 8:], v[:, :, 8:])
    pool.blocks.check_invariants(tables=[table.blocks, other.blocks])
    pool.release(other)
    assert pool.blocks.refcounts == [0, 0, 1, 1, 0, 0]

    k2, v2 = chunk(3)  # writes continue after a drop
    write(pool, table, 0, k2, v2)
    assert len(table.blocks) == 3
    assert_visible(
        pool, table, 0, np.concatenate([k[:, :, 8:], k2], 2), np.concatenate([v[:, :, 8:], v2], 2)
    )


def test_truncate_releases_blocks_no_layer_reaches():
    """truncate frees tail blocks only once every layer is shorter."""
    pool = KVPool(num_layers=2, block_size=4, num_blocks=8)
    table = pool.new_table()
    data = [chunk(14), chunk(14)]
    for layer, (k, v) in enumerate(data):
        write(pool, table, layer, k, v)
    assert table.blocks == [0, 1, 2, 3]
    pool.truncate(table, 0, 5)
    assert table.blocks == [0, 1, 2, 3]  # layer 1 still reaches token 13
    assert table.lengths == [5, 14]
    pool.truncate(table, 1, 9)
    assert table.blocks == [0, 1, 2]
    assert pool.blocks.refcounts[:4] == [1, 1, 1, 0]
    pool.truncate(table, 1, 8)  # a block boundary: block 2 is no longer needed
    assert table.blocks == [0, 1]
    assert pool.blocks.refcounts[:4] == [1, 1, 0, 0]
    pool.blocks.check_invariants(tables=[table.blocks])
    assert_visible(pool, table, 0, data[0][0][:, :, :5], data[0][1][:, :, :5])
    assert_visible(pool, table, 1, data[1][0][:, :, :8], data[1][1][:, :, :8])


def test_release_empties_the_table():
    """release gives every block back and resets the table for reuse."""
    pool = KVPool(num_layers=1, block_size=4, num_blocks=4)
    table = pool.new_table()
    write(pool, table, 0, *chunk(9))
    version = table.version
    pool.release(table)
    assert (table.blocks, table.first, table.lengths) == ([], 0, [0])
    assert table.version > version
    assert pool.blocks.refcounts == [0, 0, 0, 0]
    k, v = chunk(2)
    write(pool, table, 0, k, v)
    assert_visible(pool, table, 0, k, v)


# ---- exhaustion -----------------------------------------------------------


def test_exhausted_pool_raises_and_changes_nothing():
    """A write that needs a block while another table holds the rest fails cleanly."""
    pool = KVPool(num_layers=1, block_size=4, num_blocks=4)
    t1, t2 = pool.new_table(), pool.new_table()
    k1, v1 = chunk(12)
    k2, v2 = chunk(4)
    write(pool, t1, 0, k1, v1)
    write(pool, t2, 0, k2, v2)
    before = snapshot(pool, t1, t2)
    with pytest.raises(PoolExhaustedError, match="needs 1 more blocks"):
        write(pool, t2, 0, *chunk(1))
    with pytest.raises(PoolExhaustedError):
        write(pool, t2, 0, *chunk(5))
    assert snapshot(pool, t1, t2) == before
    pool.blocks.check_invariants(tables=[t1.blocks, t2.blocks])
    assert_visible(pool, t1, 0, k1, v1)
    assert_visible(pool, t2, 0, k2, v2)

    pool.release(t1)  # now there is room
    k3, v3 = chunk(5)
    write(pool, t2, 0, k3, v3)
    assert_visible(pool, t2, 0, np.concatenate([k2, k3], 2), np.concatenate([v2, v3], 2))


def test_exhausted_copy_on_write_changes_nothing():
    """When even the copy of a shared tail cannot get a block, nothing moves."""
    pool = KVPool(num_layers=1, block_size=4, num_blocks=4)
    t1 = pool.new_table()
    k, v = chunk(6)
    write(pool, t1, 0, k, v)
    t2 = pool.fork(t1)
    t3 = pool.new_table()
    write(pool, t3, 0, *chunk(8))
    before = snapshot(pool, t1, t2, t3)
    with pytest.raises(PoolExhaustedError):
        write(pool, t2, 0, *chunk(1))
    assert snapshot(pool, t1, t2, t3) == before
    pool.blocks.check_invariants(tables=[t1.blocks, t2.blocks, t3.blocks])
    assert_visible(pool, t2, 0, k, v)


def test_exhaustion_after_copy_on_write_changes_nothing():
    """A failed write must not keep the private copy it made of a shared tail."""
    pool = KVPool(num_layers=1, block_size=4, num_blocks=4)
    t1 = pool.new_table()
    write(pool, t1, 0, *chunk(6))
    t2 = pool.fork(t1)
    t3 = pool.new_table()
    write(pool, t3, 0, *chunk(4))  # one block left: enough to copy, not to also extend
    before = snapshot(pool, t1, t2, t3)
    with pytest.raises(PoolExhaustedError):
        write(pool, t2, 0, *chunk(4))
    assert snapshot(pool, t1, t2, t3) == before


def test_write_larger_than_the_pool_raises_value_error():
    """A table that would need more blocks than the pool has is a caller error
    (``PoolTooSmallError``, a ``ValueError``)."""
    pool = KVPool(num_layers=1, block_size=4, num_blocks=4)
    table = pool.new_table()
    with pytest.raises(PoolTooSmallError, match="17 tokens need 5 blocks of 4.*num_blocks"):
        write(pool, table, 0, *chunk(17))
    assert (table.blocks, table.lengths) == ([], [0])
    assert pool.blocks.refcounts == [0, 0, 0, 0]
    k, v = chunk(12)
    write(pool, table, 0, k, v)
    with pytest.raises(ValueError, match="num_blocks"):
        write(pool, table, 0, *chunk(5))
    assert table.lengths == [12]
    assert_visible(pool, table, 0, k, v)


# ---- bad input ------------------------------------------------------------


def f32(*shape):
    return mx.zeros(shape, dtype=mx.float32)


@pytest.mark.parametrize(
    "keys, values, match",
    [
        (f32(2, 3, 4), f32(2, 3, 4), "keys must be an mx.array shaped"),
        (f32(1, 2, 3, 4), f32(2, 3, 4), "values must be an mx.array shaped"),
        (f32(2, 2, 3, 4), f32(2, 2, 3, 4), "for one sequence"),
        (np.zeros((1, 2, 3, 4), np.float32), f32(1, 2, 3, 4), "keys must be an mx.array"),
        ([[[[0.0]]]], f32(1, 1, 1, 1), "keys must be an mx.array"),
        (f32(1, 2, 3, 4), f32(1, 2, 2, 4), "must agree on batch, heads, tokens"),
        (f32(1, 2, 3, 4), f32(1, 1, 3, 4), "must agree on batch, heads, tokens"),
        (f32(1, 2, 3, 4), mx.zeros((1, 2, 3, 4), mx.bfloat16), "must share a dtype"),
    ],
)
def test_bad_write_raises_value_error(keys, values, match):
    """Malformed K/V are refused before anything is allocated or created."""
    pool = KVPool(num_layers=1, block_size=4, num_blocks=4)
    table = pool.new_table()
    with pytest.raises(ValueError, match=match):
        pool.write_prefill(table, 0, keys, values)
    assert (table.blocks, table.lengths) == ([], [0])
    assert pool.keys[0] is None
    assert pool.blocks.refcounts == [0, 0, 0, 0]


@pytest.mark.parametrize(
    "keys, values, match",
    [
        (f32(1, 1, 1, 4), f32(1, 1, 1, 4), r"stores \(K heads, K dim, V heads, V dim\)"),
        (f32(1, 2, 1, 8), f32(1, 2, 1, 4), r"= \(2, 4, 2, 4\)"),
        (f32(1, 2, 1, 4), f32(1, 2, 1, 8), r"= \(2, 4, 2, 4\)"),
        (
            mx.zeros((1, 2, 1, 4), mx.bfloat16),
            mx.zeros((1, 2, 1, 4), mx.bfloat16),
            "layer 0 holds mlx.core.float32 K/V",
        ),
    ],
)
@pytest.mark.parametrize("then_one", [False, True])
def test_second_write_must_match_the_first(keys, values, match, then_one):
    """Heads, head dims and dtype are fixed by a layer's first write.

    A checked one-token write primes the shortcut that skips re-checking repeated
    one-token writes; it must not let a different shape or dtype through.
    """
    pool = KVPool(num_layers=1, block_size=4, num_blocks=4)
    table = pool.new_table()
    k, v = chunk(3)
    write(pool, table, 0, k, v)
    if then_one:
        k1, v1 = chunk(1)
        write(pool, table, 0, k1, v1)
        k, v = np.concatenate([k, k1], axis=2), np.concatenate([v, v1], axis=2)
    before = snapshot(pool, table)
    with pytest.raises(ValueError, match=match):
        pool.write_prefill(table, 0, keys, values)
    assert snapshot(pool, table) == before
    assert_visible(pool, table, 0, k, v)


def test_append_takes_one_token():
    """append refuses a chunk of several tokens."""
    pool = KVPool(num_layers=1, block_size=4, num_blocks=4)
    table = pool.new_table()
    with pytest.raises(ValueError, match="append writes one token"):
        pool.append(table, 0, f32(1, 2, 2, 4), f32(1, 2, 2, 4))
    assert table.lengths == [0]


# ---- property test --------------------------------------------------------

BS, NUM_BLOCKS, MAX_TABLES = 4, 8, 4


def values_for(keys: np.ndarray) -> np.ndarray:
    """The V the machine writes with ``keys``: distinct from K, so a K/V mix-up shows."""
    return -2 * keys - 1


@dataclass(eq=False)  # compared by identity
class Seq:
    """A live table and the model of what it should read back."""

    table: BlockTable
    keys: np.ndarray  # (T, 1, 2): every token written, in order
    first: int = 0  # leading blocks given back

    @property
    def values(self) -> np.ndarray:
        return values_for(self.keys)


class KVPoolMachine(RuleBasedStateMachine):
    """Random writes, forks, releases, truncations and drops on a small fixed pool.

    After every step the refcounts must match the live tables exactly and each
    table must read back exactly the tokens its model says it holds.
    """

    def __init__(self):
        super().__init__()
        self.pool = KVPool(num_layers=1, block_size=BS, num_blocks=NUM_BLOCKS)
        self.seqs: list[Seq] = []
        self.counter = 0
        self.new_table()

    def tokens(self, n: int) -> np.ndarray:
        """``n`` token vectors never seen before, shaped (n, 1, 2)."""
        c = np.arange(self.counter, self.counter + n, dtype=np.float32)
        self.counter += n
        return np.stack([c, c + 0.5], axis=-1)[:, None, :]

    def pick(self, data) -> Seq:
        return self.seqs[data.draw(st.integers(0, len(self.seqs) - 1))]

    # ---- rules ----

    @precondition(lambda self: len(self.seqs) < MAX_TABLES)
    @rule()
    def new_table(self):
        self.seqs.append(Seq(self.pool.new_table(), np.zeros((0, 1, 2), np.float32)))

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), n=st.integers(1, 9))
    def write(self, data, n):
        seq = self.pick(data)
        table, blocks = seq.table, self.pool.blocks
        start, end = len(seq.keys), len(seq.keys) + n
        total = -(-end // BS) - seq.first
        touched = table.blocks[start // BS - seq.first : total]
        shared = [i for i, b in enumerate(touched) if blocks.refcounts[b] > 1]
        required = len(shared) + total - len(table.blocks)  # copies plus new blocks
        new = self.tokens(n)
        k = mx.array(new.swapaxes(0, 1)[None])  # (1, 1, n, 2)
        v = mx.array(values_for(new).swapaxes(0, 1)[None])
        before = [list(s.table.blocks) for s in self.seqs]
        others = [list(s.table.blocks) for s in self.seqs if s is not seq]
        if total > NUM_BLOCKS:
            event("write larger than the pool")
            with pytest.raises(ValueError, match="num_blocks"):
                self.pool.write_prefill(table, 0, k, v)
            assert [list(s.table.blocks) for s in self.seqs] == before
            assert table.lengths == [start]
        elif required > blocks.num_available:
            # The write must fail without writing anything or touching other tables.
            # (It may keep a private copy of a shared tail: see the xfail test above.)
            event("pool exhausted")
            with pytest.raises(PoolExhaustedError):
                self.pool.write_prefill(table, 0, k, v)
            assert table.lengths == [start]
            assert [list(s.table.blocks) for s in self.seqs if s is not seq] == others
        else:
            event("copy-on-write" if shared else "plain write")
            (self.pool.append if n == 1 else self.pool.write_prefill)(table, 0, k, v)
            seq.keys = np.concatenate([seq.keys, new])
            # Exactly the shared blocks in the write range moved; nothing else did.
            old = before[self.seqs.index(seq)]
            offset = start // BS - seq.first
            for i, b in enumerate(old):
                moved = i - offset in shared
                assert (table.blocks[i] != b) == moved, f"block {i}: {b} -> {table.blocks[i]}"

    @precondition(lambda self: self.seqs and len(self.seqs) < MAX_TABLES)
    @rule(data=st.data())
    def fork(self, data):
        seq = self.pick(data)
        if seq.first:
            event("fork after drop_before")
        self.seqs.append(Seq(self.pool.fork(seq.table), seq.keys.copy(), seq.first))

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def release(self, data):
        seq = self.pick(data)
        self.pool.release(seq.table)
        if len(self.seqs) > 1 and data.draw(st.booleans()):
            self.seqs.remove(seq)
        else:  # a released table is empty and can be written again
            seq.keys, seq.first = seq.keys[:0], 0

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def truncate(self, data):
        seq = self.pick(data)
        length = data.draw(st.integers(seq.first * BS, len(seq.keys)))
        self.pool.truncate(seq.table, 0, length)
        seq.keys = seq.keys[:length]

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def drop_before(self, data):
        seq = self.pick(data)
        position = data.draw(st.integers(0, len(seq.keys)))
        self.pool.drop_before(seq.table, position)
        seq.first = max(seq.first, position // BS)

    # ---- checks after every step ----

    @invariant()
    def tables_match_model(self):
        self.pool.blocks.check_invariants(tables=[s.table.blocks for s in self.seqs])
        for seq in self.seqs:
            table, length = seq.table, len(seq.keys)
            assert table.lengths == [length]
            assert table.first == seq.first
            assert len(table.blocks) == -(-length // BS) - seq.first
            if self.pool.keys[0] is None:  # nothing written to the pool yet
                assert length == 0
                continue
            k, v = visible(self.pool, table)
            np.testing.assert_array_equal(k[0].swapaxes(0, 1), seq.keys[seq.first * BS :])
            np.testing.assert_array_equal(v[0].swapaxes(0, 1), seq.values[seq.first * BS :])


KVPoolMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=50, deadline=None)
test_kv_pool_machine = KVPoolMachine.TestCase
