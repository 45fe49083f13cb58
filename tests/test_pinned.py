"""Staging buffers for the disk tier's loads: pinned copies on CUDA, MLX's own memory elsewhere."""

from __future__ import annotations

import gc

import mlx.core as mx
import numpy as np
import pytest

from mlx_paged.storage.pinned import PAGE, Staging


def fill(staging: Staging, i: int, rows: int, size: int, seed: int) -> np.ndarray:
    data = staging.buffer(i, rows, size)
    data[:] = np.random.default_rng(seed).integers(0, 256, (rows, size), dtype=np.uint8)
    return data


def test_buffers_are_reused_page_aligned_and_grown():
    staging = Staging()
    a = fill(staging, 0, 4, 1000, 0)
    b = fill(staging, 1, 4, 1000, 1)
    assert a.ctypes.data % PAGE == 0 and b.ctypes.data % PAGE == 0
    assert a.ctypes.data != b.ctypes.data
    assert staging.buffer(2, 3, 1000).ctypes.data == a.ctypes.data  # buffer 0 again, smaller
    bigger = staging.buffer(0, 64, 1000)
    assert bigger.shape == (64, 1000) and bigger.ctypes.data % PAGE == 0


def test_off_cuda_a_buffer_a_read_made_is_copied_once_then_made_mlx_memory():
    staging = Staging()
    data = fill(staging, 0, 3, 4001, 2)  # rows of a size no 16-byte load divides
    assert staging.pinned is None and staging.shared is None  # not tried until the first copy
    got = staging.to_mlx(data)
    assert staging.pinned is False and staging.shared is True  # the CPU: nothing pinned
    assert got.shape == (3, 4001) and np.array_equal(np.array(got), data)
    data[:] = 9  # a copy: a later write does not show
    assert not np.array_equal(np.array(got + 0), data)
    again = fill(staging, 0, 3, 4001, 3)  # buffer 0 again: now an MLX array's memory
    assert again.ctypes.data != data.ctypes.data
    got = staging.to_mlx(again)
    again[:] = 9  # the buffer itself: the write shows
    assert np.array_equal(np.array(got + 0), again)


def test_off_cuda_reserved_buffers_are_handed_to_mlx_without_a_copy():
    staging = Staging(2)
    staging.reserve(4096)
    assert staging.shared is True
    data = fill(staging, 1, 3, 1000, 4)
    got = staging.to_mlx(data)
    assert got.shape == (3, 1000) and np.array_equal(np.array(got), data)
    data[:] = 7
    assert np.array_equal(np.array(got + 0), np.full((3, 1000), 7, np.uint8))


def test_where_mlx_would_not_see_writes_through_a_view_loads_copy(monkeypatch):
    """The first use checks that a write through a buffer's view shows in MLX; a view that
    is not the array's memory fails it, and ``to_mlx`` then copies."""
    in_mlx = Staging._in_mlx

    def detached(staging: Staging, nbytes: int) -> np.ndarray:
        view = in_mlx(staging, nbytes)
        copy = view.copy()  # not the MLX array's memory
        staging._owners[copy.ctypes.data] = staging._owners.pop(view.ctypes.data)
        return copy

    monkeypatch.setattr(Staging, "_in_mlx", detached)
    staging = Staging(2)
    staging.reserve(4096)
    assert staging.shared is False
    data = fill(staging, 0, 2, 100, 5)
    got = staging.to_mlx(data)
    data[:] = 1
    assert np.array_equal(np.array(got), np.array(got + 0)) and not np.array_equal(
        np.array(got + 0), data
    )


class RecordingDriver:
    """Stands in for the CUDA driver: records which addresses are pinned, and checks that a
    buffer is still alive (its bytes readable) when it is unpinned."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []

    def register(self, buf: np.ndarray) -> None:
        self.calls.append(("register", buf.ctypes.data))

    def unregister(self, buf: np.ndarray) -> None:
        assert buf.base is not None and int(buf[:1].sum()) >= 0
        self.calls.append(("unregister", buf.ctypes.data))


def test_a_pinned_buffer_is_unpinned_before_its_memory_can_be_freed():
    """A buffer freed while still pinned leaves the driver a stale mapping, on which later
    allocations fail; growing a buffer and dropping the staging unpin first."""
    staging = Staging()
    driver = staging._pins.driver = RecordingDriver()
    staging.pinned = True  # as after a passed check on CUDA
    a = staging.buffer(0, 4, 1000).ctypes.data
    b = staging.buffer(1, 4, 1000).ctypes.data
    grown = staging.buffer(0, 64, 1000).ctypes.data  # buffer 0 grows: the old one goes
    want = [("register", a), ("register", b), ("unregister", a), ("register", grown)]
    assert driver.calls == want
    del staging  # its finalizer unpins what is still pinned
    gc.collect()
    assert sorted(driver.calls[4:]) == sorted([("unregister", b), ("unregister", grown)])


def reserved_pinned(count: int, nbytes: int) -> tuple[Staging, RecordingDriver, list[int]]:
    """A staging of ``count`` buffers reserved as on CUDA after a passed check, its driver
    and the buffers' addresses."""
    staging = Staging(count)
    driver = staging._pins.driver = RecordingDriver()
    staging.pinned = True
    staging.reserve(nbytes)
    return staging, driver, [b.ctypes.data for b in staging._buffers]


def test_reserve_makes_and_pins_every_buffer_once_so_that_loads_pin_nothing():
    staging, driver, held = reserved_pinned(3, 64_000)
    assert len(set(held)) == 3 and all(b.size == 64_000 for b in staging._buffers)
    assert driver.calls == [("register", a) for a in held]
    for i in range(6):  # runs up to the reserved size reuse the buffers, pinning nothing
        assert staging.buffer(i, 16, 4000).ctypes.data == held[i % 3]
    assert len(driver.calls) == 3


def test_off_cuda_reserve_makes_the_buffers_and_pins_nothing():
    staging = Staging(3)
    staging.reserve(4096)
    assert staging.pinned is False  # tried: the CPU
    assert [b.size for b in staging._buffers] == [4096] * 3


@pytest.mark.gpu
@pytest.mark.skipif(not mx.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_a_pinned_copy_equals_the_host_bytes():
    staging = Staging()
    for i, (rows, size) in enumerate([(3, 4001), (64, 4096), (1, 17), (200, 5000)]):
        data = fill(staging, i, rows, size, i)
        got = staging.to_mlx(data)
        assert staging.pinned, "the pinned copy failed its check on this GPU"
        assert got.shape == (rows, size) and np.array_equal(np.array(got), data)
    loose = np.ones((2, 64), dtype=np.uint8)  # not a staging buffer: plain mx.array
    assert np.array_equal(np.array(staging.to_mlx(loose)), loose)


def test_rows_inside_a_reserved_buffer_are_handed_to_mlx_from_where_they_lie():
    staging = Staging(2)
    staging.reserve(8 * 1000)
    whole = fill(staging, 1, 8, 1000, 5)
    rows = whole[3:6]  # a run that starts inside the buffer
    assert staging.holds(rows) and not staging.holds(np.ones((3, 1000), np.uint8))
    got = staging.to_mlx(rows)
    assert got.shape == (3, 1000) and np.array_equal(np.array(got), whole[3:6])
    whole[4] = 11  # the buffer itself, not a copy
    assert np.array_equal(np.array(got + 0)[1], np.full(1000, 11, np.uint8))


def test_drop_unpins_and_frees_every_buffer():
    staging, driver, held = reserved_pinned(2, 4096)
    staging.drop()
    assert staging._buffers == [None, None] and not staging._pins.buffers
    assert driver.calls[2:] == [("unregister", a) for a in held]


@pytest.mark.gpu
@pytest.mark.skipif(not mx.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_rows_inside_a_pinned_buffer_copy_from_where_they_lie():
    staging = Staging()
    whole = fill(staging, 0, 40, 1000 + 8, 6)  # rows 8-byte aligned, not 16
    for lo, hi in [(0, 40), (1, 2), (3, 17), (39, 40)]:
        got = staging.to_mlx(whole[lo:hi])
        assert staging.pinned, "the pinned copy failed its check on this GPU"
        assert np.array_equal(np.array(got), whole[lo:hi]), (lo, hi)
