"""A load's files mapped side by side into one host region, which the GPU reads in place.

A staged load reads each file's bytes from the page cache into a pinned buffer,
and the GPU then copies that buffer: host memory carries every byte three times,
and the reads set the load's pace. On CUDA a run's file ranges can instead be
mapped (``mmap``) one after another into one reserved range of addresses and
registered with the driver in one call (``cuMemHostRegister``, read-only); the
copy kernel then reads the page cache itself (BENCHMARKS.md, runs 352-353: 1 GiB
in 32-35 ms, against 53-60 ms through staging). Each range starts on a page
boundary of the region, so its bytes begin at an offset in it (``starts``);
``rows`` views them in numpy for the host's checks of the entries' headers.

Linux only (``libc``'s ``mmap``): elsewhere ``MappedRegion`` raises OSError and
loads read through staging. The host reads the headers from the mapping, so a
file another process truncated in place while mapped would fault the process
(SIGBUS); the disk tier never truncates a file (it writes a temporary file and
renames it), and it checks each file's size before mapping it.
"""

from __future__ import annotations

import ctypes
import mmap
import sys
from collections.abc import Callable, Sequence

import mlx.core as mx
import numpy as np

from .disk_format import TRAILER, ArraySpec

PAGE = mmap.PAGESIZE
_MAP_FIXED, _MAP_NORESERVE = 0x10, 0x4000  # Linux's values
_FAILED = ctypes.c_void_p(-1).value
_libc: list[ctypes.CDLL] = []


def _lib() -> ctypes.CDLL:
    if sys.platform != "linux":
        raise OSError("mapped loads need Linux's mmap")
    if not _libc:
        lib = ctypes.CDLL(None, use_errno=True)
        lib.mmap.restype = ctypes.c_void_p
        lib.mmap.argtypes = [
            ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
            ctypes.c_long,
        ]  # fmt: skip
        lib.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        _libc.append(lib)
    return _libc[0]


class MappedRegion:
    """File ranges ``(descriptor, offset, bytes)`` mapped read-only, in order, into one
    reserved range of addresses; ``starts[i]`` is where range ``i``'s first byte lies.

    Raises:
        OSError: if a mapping fails (the region is unmapped again).
    """

    def __init__(self, ranges: Sequence[tuple[int, int, int]]):
        lib = _lib()
        spans = []
        for fd, offset, length in ranges:
            lo = offset // PAGE * PAGE
            spans.append((fd, lo, -(-(offset + length - lo) // PAGE) * PAGE, offset - lo))
        self.size = sum(span[2] for span in spans)
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE
        base = lib.mmap(None, self.size, 0, flags, -1, 0)  # PROT_NONE
        if base in (None, _FAILED):
            raise OSError(ctypes.get_errno(), "reserving addresses for a mapped load failed")
        self.base, self.starts, self.unpin = base, [], None
        at = base
        try:
            for fd, lo, size, delta in spans:
                flags = mmap.MAP_SHARED | _MAP_FIXED
                if lib.mmap(at, size, mmap.PROT_READ, flags, fd, lo) != at:
                    raise OSError(ctypes.get_errno(), "mapping a disk-tier file failed")
                self.starts.append(at + delta)
                at += size
        except OSError:
            lib.munmap(base, self.size)
            raise

    def rows(self, i: int, entries: int, size: int) -> np.ndarray:
        """Range ``i`` as ``(entries, size)`` read-only uint8 rows (valid until ``release``)."""
        buf = (ctypes.c_ubyte * (entries * size)).from_address(self.starts[i])
        view = np.ctypeslib.as_array(buf).reshape(entries, size)
        view.flags.writeable = False
        return view

    def pin(self, register: Callable[[int, int], None], unregister: Callable[[int], None]):
        """Register the whole region with the driver (``register(address, bytes)``) in one
        call; ``release`` unregisters it first."""
        register(self.base, self.size)
        self.unpin = unregister

    def release(self) -> None:
        """Unregister and unmap (once every read of the region is done)."""
        if self.base is None:
            return
        base, self.base = self.base, None
        try:
            if self.unpin is not None:
                self.unpin(base)
        finally:
            _lib().munmap(base, self.size)


class MappedRun:
    """A run of entries (``Run``'s interface, for ``run_blocks``) whose rows lie in the
    ranges of a ``MappedRegion``, ``counts[i]`` entries of ``size`` bytes in range ``i``.

    ``copy(address, bytes)``, when given, copies registered host memory into a new MLX
    array (``Staging.copy_from``); without it the rows go through ``mx.array``."""

    def __init__(
        self,
        region: MappedRegion,
        counts: list[int],
        size: int,
        specs: list[ArraySpec],
        payload: int,
        copy: Callable[[int, int], mx.array] | None,
    ):
        self.region, self.counts, self.size = region, counts, size
        self.specs, self.payload, self.checked, self.copy = specs, payload, False, copy
        self.views = [region.rows(i, n, size) for i, n in enumerate(counts)]

    def __len__(self) -> int:
        return sum(self.counts)

    @property
    def payload_words(self) -> tuple[int, int]:
        """The payload's first and end u32 word in a row."""
        return self.payload // 4, (self.size - TRAILER.size) // 4

    @property
    def sums(self) -> np.ndarray:
        """Each entry's payload word sum, as written: ``(entries,)`` uint32."""
        at = self.size - TRAILER.size + 4
        words = np.concatenate([v[:, at : at + 4] for v in self.views])
        return np.ascontiguousarray(words).view("<u4")[:, 0]

    def trim(self, n: int) -> MappedRun:
        """Keep the first ``n`` entries (the rest failed a check); return this run."""
        kept, left = [], n
        for c in self.counts:
            kept.append(min(c, left))
            left -= kept[-1]
        self.counts = [c for c in kept if c]
        self.views = [v[:c] for v, c in zip(self.views, kept, strict=True) if c]
        return self

    def to_device(self, to_mlx: Callable[[np.ndarray], mx.array]) -> mx.array:
        """The rows in MLX, ``(entries, size)`` uint8: copied from the region by the GPU,
        or through ``mx.array`` (``to_mlx`` is not used: the rows are not staged)."""
        if self.copy is None:
            return mx.array(np.concatenate(self.views))
        parts = [self.copy(v.ctypes.data, v.nbytes) for v in self.views]
        data = parts[0] if len(parts) == 1 else mx.concatenate(parts)
        return data.reshape(len(self), self.size)

    def release(self) -> None:
        """Give the region back; the rows must not be read after."""
        self.views = []
        self.region.release()
