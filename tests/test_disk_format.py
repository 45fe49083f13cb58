"""The disk tier's entry format and its checks: the payload word sum, on the host and in MLX."""

from __future__ import annotations

import logging

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlx_paged.storage import disk_format
from mlx_paged.storage.disk import DiskStore
from mlx_paged.storage.disk_entries import _entry_view, payload_ok
from mlx_paged.storage.disk_format import ALIGN, Run, check, encode, payload_sums

FP = "model0fingerprint"


def entry(seed: int, shape: tuple[int, ...] = (3, 5)) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "k": rng.standard_normal(shape).astype(np.float16),
        "odd": rng.integers(0, 255, 7, dtype=np.uint8),  # 7 bytes: the payload is padded
    }


def row(seed: int) -> np.ndarray:
    return np.frombuffer(encode(FP, f"key{seed}", entry(seed)), dtype=np.uint8).copy()


def test_the_payload_is_aligned_and_the_sum_is_the_weighted_word_sum():
    data = row(0)
    run = Run(data[None], *disk_format.parse(data, FP), checked=False)
    assert run.payload % ALIGN == 0 and (data.size - disk_format.TRAILER.size) % ALIGN == 0
    lo, hi = run.payload_words
    words = data.view("<u4")[lo:hi].astype(np.uint64)
    want = int(np.sum(words * np.arange(1, 2 * words.size, 2, dtype=np.uint64)) % 2**32)
    assert int(run.sums[0]) == want == int(payload_sums(data.view("<u4")[lo:hi]))
    assert check(data) is None
    assert all(np.array_equal(run.arrays(0)[k], v) for k, v in entry(0).items())


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_any_flipped_bit_fails_the_host_check_and_the_mlx_one(data):
    rows = np.stack([row(i) for i in range(3)])
    specs, payload = disk_format.parse(rows[0], FP)
    r = data.draw(st.integers(0, 2))
    byte = data.draw(st.integers(0, rows.shape[1] - 1))
    bit = data.draw(st.integers(0, 7))
    rows[r, byte] ^= 1 << bit
    run = Run(rows, specs, payload, checked=False)
    ok = np.array(payload_ok(mx.array(rows), run)).tolist()
    host = [check(x) for x in rows]
    assert disk_format.check_rows(rows) == host  # the whole run's checks at once
    assert disk_format.check_rows(rows, False) == [check(x, False) for x in rows]
    assert all(h is None for i, h in enumerate(host) if i != r)
    assert host[r] is not None  # the head's CRC-32, the payload's sum or the trailer
    end = rows.shape[1] - disk_format.TRAILER.size
    in_payload_or_sum = payload <= byte < end or byte >= end + 4
    assert ok == [i != r or not in_payload_or_sum for i in range(3)]


def test_mlx_and_the_host_agree_on_large_runs():
    rng = np.random.default_rng(1)
    words = rng.integers(0, 2**32, (4, 300_001), dtype=np.uint32)
    rows = np.zeros((4, 16 + words.shape[1] * 4 + 8), dtype=np.uint8)
    rows[:, 16:-8] = words.view(np.uint8)
    rows[:, -4:] = payload_sums(words)[:, None].view(np.uint8)
    rows[2, -4:] = 0
    run = Run(rows, [], 16, checked=False)
    assert np.array(payload_ok(mx.array(rows), run)).tolist() == [True, True, False, True]


def test_a_run_read_unchecked_leaves_the_payload_to_the_caller(tmp_path, caplog):
    store = DiskStore(tmp_path, 10**7, FP)
    keys = ["a", "b", "c"]
    for i, key in enumerate(keys):
        store.put(key, entry(i))
    path = tmp_path / f"{FP}-b.kv"
    data = bytearray(path.read_bytes())
    data[-20] ^= 0x10  # in the payload
    path.write_bytes(bytes(data))
    run = store.read_run(keys, payloads=False)
    assert len(run) == 3 and not run.checked and store.counts["hits"] == 0
    ok = np.array(payload_ok(mx.array(run.data), run)).tolist()
    assert ok == [True, False, True]
    with caplog.at_level(logging.WARNING, logger="mlx_paged.disk"):
        store.discard("b", "the checksum does not match")
    store.hit(1)
    assert store.keys == ["a", "c"] and not path.exists() and store.counts["hits"] == 1
    assert any("deleting" in r.getMessage() for r in caplog.records), caplog.text
    # Checked on the host, the run stops before a bad payload.
    store.put("b", entry(1))
    path.write_bytes(bytes(data))
    assert len(store.read_run(keys)) == 1


@pytest.mark.parametrize("where", ["header", "trailer"])
def test_a_run_read_unchecked_still_checks_the_head(tmp_path, where):
    store = DiskStore(tmp_path, 10**7, FP)
    store.put("a", entry(0))
    path = tmp_path / f"{FP}-a.kv"
    data = bytearray(path.read_bytes())
    data[30 if where == "header" else -8] ^= 0x01  # a byte of the JSON, or the head's CRC
    path.write_bytes(bytes(data))
    assert store.read_run(["a"], payloads=False) is None and not path.exists()


@pytest.mark.parametrize(
    ("start", "shape", "dtype", "viewed"),
    [
        (32, (4, 2, 6), "float16", True),  # a full-precision block: (bs, heads, head dim bytes)
        (16, (4, 2, 8), "uint32", True),  # packed values
        (48, (4, 2, 4), "bfloat16", True),
        (33, (4, 2, 6), "float16", False),  # not aligned to the type: sliced and copied
    ],
)
def test_entry_views_hold_each_rows_bytes_as_the_dtype(start, shape, dtype, viewed):
    rows = np.random.default_rng(0).integers(0, 256, (3, 96), dtype=np.uint8)
    n = int(np.prod(shape))
    views = {}
    got = _entry_view(mx.array(rows), start, shape, getattr(mx, dtype), views)
    assert got.shape == (3, *shape[:-1], shape[-1] // getattr(mx, dtype).size)
    want = rows[:, start : start + n].reshape(3, *shape)
    assert np.array_equal(np.array(got.view(mx.uint8)).reshape(want.shape), want)
    assert len(views) == viewed  # the rows as the dtype, shared by a run's views


def test_same_headers_finds_exactly_the_rows_of_another_key_or_header():
    rows = np.stack([row(s) for s in range(6)])
    keys = [f"key{s}" for s in range(6)]
    payload = disk_format.parse(rows[0], FP)[1]
    assert disk_format.same_headers(rows, keys, payload).tolist() == [True] * 6
    rows[2, disk_format.PREFIX.size + 5] ^= 1  # a header byte past the key
    rows[4, disk_format.PREFIX.size + 1] ^= 4  # a key byte
    keys[5] = "key05"  # a key of another length than the rows'
    assert disk_format.same_headers(rows, keys, payload).tolist() == [
        True, True, False, True, False, False,
    ]  # fmt: skip
    rows[0, payload] ^= 1  # the payload is not the header's business
    assert disk_format.same_headers(rows, keys, payload)[0]
