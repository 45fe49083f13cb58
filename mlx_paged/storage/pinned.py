"""The disk tier's staging buffers: pinned host memory on CUDA, MLX's own memory elsewhere.

MLX 0.32's CUDA backend puts an array made from host data (``mx.array(numpy)``)
in managed memory, which the GPU then pages in: 1.1-2.3 GB/s on an H100
(BENCHMARKS.md, run 130), slower than the GPU recomputes a 1B model's K/V.
``Staging`` keeps a few reusable host buffers; on CUDA it registers them with the
driver (``cuMemHostRegister``, mapped), and ``to_mlx`` copies a buffer's rows
into a new MLX array with a kernel that reads the host memory directly, in
16-byte loads. The first use checks that copy against ``mx.array`` on a test
pattern. Where it cannot run (no CUDA, no driver library, a failed call or
check) ``to_mlx`` is ``mx.array``.

Elsewhere (the CPU, and Metal's unified memory) the buffers can be MLX's own
memory: ``Staging`` makes each buffer an MLX array and reads into a numpy view
of it (the buffer protocol), and ``to_mlx`` returns the rows as a slice of that
array, with no copy. This too is checked on a test pattern at first use (a write
through the view must show in MLX's ops, also after the array was read once);
where it fails ``to_mlx`` is ``mx.array``. A buffer that a reader thread grows is
plain numpy memory (making an MLX array takes the thread of MLX calls): its rows
are copied once, and ``to_mlx`` replaces it with an MLX one for the next run.
Metal has not been run here; its first use runs the same check.

A pinned buffer is unpinned before its memory can go back to the system (when a
buffer grows, and when its ``Staging`` is collected): memory freed while still
registered leaves the driver a stale mapping, on which later allocations in the
process fail ("resource already mapped", BENCHMARKS.md run 152).
"""

from __future__ import annotations

import ctypes
import logging
import weakref

import mlx.core as mx
import numpy as np

logger = logging.getLogger("mlx_paged.disk")

PAGE = 4096
_REGISTER_FLAGS = 0x01 | 0x02  # CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_DEVICEMAP
_THREADS, _BLOCKS = 256, 1024

_SOURCE = """
    const uint4* src = reinterpret_cast<const uint4*>(address[0]);
    uint4* dst = reinterpret_cast<uint4*>(out);
    const long n = count[0];
    const long stride = (long)gridDim.x * blockDim.x;
    for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        dst[i] = src[i];
    }
"""


class _Driver:
    """The CUDA driver calls that pin host memory, made in MLX's (primary) context."""

    def __init__(self) -> None:
        self.lib = ctypes.CDLL("libcuda.so.1")
        self._check(self.lib.cuInit(0), "cuInit")
        device, self.context = ctypes.c_int(), ctypes.c_void_p()
        self._check(self.lib.cuDeviceGet(ctypes.byref(device), 0), "cuDeviceGet")
        self._check(
            self.lib.cuDevicePrimaryCtxRetain(ctypes.byref(self.context), device),
            "cuDevicePrimaryCtxRetain",
        )

    def register(self, buf: np.ndarray) -> None:
        self._in_context(
            "cuMemHostRegister_v2",
            ctypes.c_void_p(buf.ctypes.data),
            ctypes.c_size_t(buf.nbytes),
            ctypes.c_uint(_REGISTER_FLAGS),
        )

    def unregister(self, buf: np.ndarray) -> None:
        self._in_context("cuMemHostUnregister", ctypes.c_void_p(buf.ctypes.data))

    def _in_context(self, name: str, *args: object) -> None:
        self._check(self.lib.cuCtxPushCurrent_v2(self.context), "cuCtxPushCurrent")
        try:
            self._check(getattr(self.lib, name)(*args), name)
        finally:
            self.lib.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))

    @staticmethod
    def _check(code: int, what: str) -> None:
        if code != 0:
            raise OSError(f"{what} returned CUDA error {code}")


class _Pins:
    """The buffers pinned with ``driver``, each held here until it is unpinned."""

    def __init__(self) -> None:
        self.driver: _Driver | None = None
        self.buffers: dict[int, np.ndarray] = {}  # address -> buffer

    def __contains__(self, buf: np.ndarray) -> bool:
        return buf.ctypes.data in self.buffers

    def pin(self, buf: np.ndarray) -> None:
        self.driver.register(buf)
        self.buffers[buf.ctypes.data] = buf

    def unpin(self, buf: np.ndarray) -> None:
        if self.buffers.pop(buf.ctypes.data, None) is not None:
            self.driver.unregister(buf)

    def unpin_all(self) -> None:
        for buf in list(self.buffers.values()):
            try:
                self.unpin(buf)
            except OSError as e:
                logger.warning("mlx_paged: unpinning a staging buffer failed: %s", e)


class Staging:
    """Reusable host buffers, and their copy into MLX (see the module docstring).

    Args:
        count: How many buffers: reads may fill all but one while MLX copies from one.
    """

    def __init__(self, count: int = 2) -> None:
        self._buffers: list[np.ndarray | None] = [None] * count
        self._kernel = None
        self.pinned: bool | None = None  # None: not tried yet
        self.shared: bool | None = None  # buffers in MLX's memory (not on CUDA); None: not tried
        self._owners: dict[int, mx.array] = {}  # a shared buffer's address -> its MLX array
        self._pins = _Pins()  # the buffers pinned now
        # Unpinned when this staging goes (at exit the process's mappings go with it).
        weakref.finalize(self, self._pins.unpin_all).atexit = False

    def __len__(self) -> int:
        return len(self._buffers)

    def start(self) -> bool:
        """Try (and check) the pinned copy now, as the first ``to_mlx`` would; whether copies
        run pinned. Call it on the thread that makes the MLX calls."""
        return self._ready()

    def holds(self, data: np.ndarray) -> bool:
        """Whether ``data`` is a contiguous view inside one of the buffers."""
        return self._find(data)[0] is not None

    def drop(self) -> None:
        """Unpin and free every buffer (no ``to_mlx`` copy of theirs may still be running)."""
        for i, held in enumerate(self._buffers):
            if held is not None:
                self._pins.unpin(held)
                self._owners.pop(held.ctypes.data, None)
                self._buffers[i] = None

    def buffer(self, i: int, rows: int, size: int) -> np.ndarray:
        """A ``(rows, size)`` uint8 view of buffer ``i % count``, grown (and pinned) as needed."""
        need = -(-rows * size // 16) * 16
        i %= len(self._buffers)
        held = self._buffers[i]
        if held is None or held.size < need:
            if held is not None:
                self._pins.unpin(held)
                self._owners.pop(held.ctypes.data, None)
            raw = np.empty(need + PAGE, dtype=np.uint8)
            held = raw[(-raw.ctypes.data) % PAGE :][:need]
            self._buffers[i] = held
            if self.pinned:  # a driver call, no MLX one: any thread may grow a buffer
                self._pin(held)
        return held[: rows * size].reshape(rows, size)

    def reserve(self, nbytes: int) -> None:
        """Make every buffer ``nbytes`` long now, pinned where copies run pinned: pinning
        (``cuMemHostRegister``) while a load runs costs that load. Call it on the thread
        that makes the MLX calls (the first call builds and checks the copy)."""
        self._ready()
        for i in range(len(self._buffers)):
            self.buffer(i, 1, nbytes)
            if self.pinned:
                self._pin(self._buffers[i])
            elif self.shared and self._buffers[i].ctypes.data not in self._owners:
                self._buffers[i] = self._in_mlx(self._buffers[i].size)

    def stage(self, data: np.ndarray) -> np.ndarray:
        """``(rows, size)`` uint8 ``data`` copied into buffer 0, as a read would leave it."""
        out = self.buffer(0, *data.shape)
        out[:] = data
        return out

    def to_mlx(self, data: np.ndarray) -> mx.array:
        """``data`` (rows of one of the buffers, from its start) as an MLX array. Call it
        on the thread that makes the MLX calls: the first call builds and checks the copy."""
        if self.pinned is None and self._ready():
            for held in self._buffers:
                if held is not None:
                    self._pin(held)
        i, at = self._find(data)
        base = self._buffers[i] if i is not None else None
        if self.shared and base is not None:
            owner = self._owners.get(base.ctypes.data)
            if owner is not None:
                return owner[at : at + data.size].reshape(data.shape)
            # A buffer a reader thread made: copied this time, in MLX's memory from the next.
            self._buffers[i] = self._in_mlx(base.size)
        if not self.pinned or base is None or base not in self._pins:
            return mx.array(data)  # also a buffer a reader thread made while pinning began
        # From the 16-byte word at or before the data: a buffer starts on a page and ends
        # on a word, so the copy's words lie inside it.
        skip = data.ctypes.data % 16
        out = self._copy(data.ctypes.data - skip, skip + data.size)
        return (out[skip:] if skip else out).reshape(data.shape)

    # ---- internals --------------------------------------------------------

    def _find(self, data: np.ndarray) -> tuple[int | None, int]:
        """``(buffer, byte offset)`` of a contiguous ``data`` inside one; ``(None, 0)``."""
        if not data.flags.c_contiguous:
            return None, 0
        for i, held in enumerate(self._buffers):
            if held is not None:
                at = data.ctypes.data - held.ctypes.data
                if 0 <= at and at + data.nbytes <= held.nbytes:
                    return i, at
        return None, 0

    def _ready(self) -> bool:
        """Whether pinned copies run here: tried, and checked, once."""
        if self.pinned is None:
            self.pinned = False
            if mx.default_device() != mx.gpu or not mx.cuda.is_available():
                self.shared = self._check_shared()
                return False
            try:
                self._pins.driver = _Driver()
                self._kernel = mx.fast.cuda_kernel(
                    "mlx_paged_pinned_copy", ["address", "count"], ["out"], _SOURCE
                )
                self.pinned = self._check()
            except (OSError, AttributeError, RuntimeError, ValueError) as e:
                self._off(str(e))
        return bool(self.pinned)

    def _in_mlx(self, nbytes: int) -> np.ndarray:
        """A new buffer of ``nbytes`` in MLX's memory: a numpy view of an MLX array."""
        owner = mx.zeros((nbytes,), dtype=mx.uint8)
        mx.eval(owner)
        view = np.frombuffer(memoryview(owner), dtype=np.uint8)
        self._owners[view.ctypes.data] = owner
        return view

    def _check_shared(self) -> bool:
        """Whether writes through a buffer's view show in MLX's ops (also after a first
        read), so that ``to_mlx`` may hand out the buffer itself."""
        pattern = np.random.default_rng(0).integers(0, 256, 3 * PAGE, dtype=np.uint8)
        try:
            view = self._in_mlx(pattern.size)
            owner = self._owners.pop(view.ctypes.data)
            seen = []
            for want in (pattern, np.ascontiguousarray(pattern[::-1])):
                view[:] = want
                seen.append(bool(mx.array_equal(owner[: want.size] + 0, mx.array(want))))
        except (BufferError, TypeError, ValueError, RuntimeError) as e:
            logger.info("mlx_paged: disk-tier loads copy through mx.array: %s", e)
            return False
        if not all(seen):
            logger.info(
                "mlx_paged: disk-tier loads copy through mx.array: MLX did not see "
                "a write through a buffer's view"
            )
        return all(seen)

    def _pin(self, buf: np.ndarray) -> None:
        if buf in self._pins:
            return
        try:
            self._pins.pin(buf)
        except OSError as e:
            self._off(f"pinning {buf.nbytes} bytes failed: {e}")

    def _check(self) -> bool:
        pattern = np.random.default_rng(0).integers(0, 256, 3 * PAGE, dtype=np.uint8)
        raw = np.empty(4 * PAGE, dtype=np.uint8)
        buf = raw[(-raw.ctypes.data) % PAGE :][: 3 * PAGE]
        buf[:] = pattern
        self._pins.driver.register(buf)
        try:
            got = np.array(self._copy(buf.ctypes.data, buf.size))
        finally:
            mx.synchronize()
            self._pins.driver.unregister(buf)
        if not np.array_equal(got, pattern):
            self._off("the pinned copy did not match mx.array on a test pattern")
            return False
        return True

    def _copy(self, address: int, nbytes: int) -> mx.array:
        words = -(-nbytes // 16)
        (out,) = self._kernel(
            inputs=[mx.array([address], dtype=mx.uint64), mx.array([words], dtype=mx.int64)],
            grid=(_BLOCKS * _THREADS, 1, 1),
            threadgroup=(_THREADS, 1, 1),
            output_shapes=[(words * 16,)],
            output_dtypes=[mx.uint8],
        )
        return out[:nbytes]

    def _off(self, why: str) -> None:
        logger.info("mlx_paged: disk-tier loads copy through mx.array: %s", why)
        self.pinned = False
