"""The disk tier's file format: one entry of named arrays, checked when read.

    b"MLXPGKV\\0", format version (u32), key length (u32), header length (u32),
    the key, the header (JSON: the fingerprint and each array's name, dtype,
    shape and byte range), the arrays' bytes, then a CRC-32 (u32) of
    everything before it.

Entries of one layout (the same arrays, shapes and dtypes under keys of one
length) have the same header and size, so many of them can be read into one
buffer and checked against the first (``same_header``). CRC-32 catches torn
and flipped bytes at several GB/s a core; it is no defence against someone
forging files.
"""

from __future__ import annotations

import json
import struct
import zlib
from dataclasses import dataclass

import numpy as np

MAGIC = b"MLXPGKV\0"
FORMAT_VERSION = 2
PREFIX = struct.Struct("<8sIII")
CRC = struct.Struct("<I")


@dataclass(frozen=True)
class ArraySpec:
    """Where one array lies in an entry's payload."""

    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    start: int
    size: int


@dataclass
class Run:
    """Entries read by ``DiskStore.read_run``: row ``i`` of ``data`` is file ``i``.

    ``data[:, payload:payload + s.size]`` holds array ``s`` of each entry, for
    ``s`` in ``specs``.
    """

    data: np.ndarray  # (entries, file bytes) uint8
    specs: list[ArraySpec]
    payload: int

    def __len__(self) -> int:
        return self.data.shape[0]

    @classmethod
    def of(cls, fingerprint: str, key: str, arrays: dict[str, np.ndarray]) -> Run:
        """One entry's run, as if written and read back (no file)."""
        data = np.frombuffer(encode(fingerprint, key, arrays), dtype=np.uint8)
        specs, payload = parse(data, fingerprint)
        return cls(data[None], specs, payload)

    def arrays(self, i: int) -> dict[str, np.ndarray]:
        """Entry ``i``'s arrays (copies)."""
        row = self.data[i, self.payload :]
        return {
            s.name: row[s.start : s.start + s.size].view(s.dtype).reshape(s.shape).copy()
            for s in self.specs
        }


def encode(fingerprint: str, key: str, arrays: dict[str, np.ndarray]) -> bytes:
    """An entry file's bytes."""
    specs, chunks, offset = [], [], 0
    for name, a in arrays.items():
        a = np.ascontiguousarray(a)
        specs.append([name, a.dtype.str, list(a.shape), offset, a.nbytes])
        chunks.append(a.reshape(-1).view(np.uint8))
        offset += a.nbytes
    header = json.dumps({"fingerprint": fingerprint, "arrays": specs}).encode()
    key_bytes = key.encode()
    head = PREFIX.pack(MAGIC, FORMAT_VERSION, len(key_bytes), len(header)) + key_bytes + header
    crc = zlib.crc32(head)
    for c in chunks:
        crc = zlib.crc32(c, crc)
    return b"".join([head, *chunks, CRC.pack(crc)])


def parse(buf: np.ndarray, fingerprint: str) -> tuple[list[ArraySpec], int]:
    """An entry's array specs and where its payload starts."""
    specs, payload, want = parse_head(buf, fingerprint)
    if want != buf.size:
        raise ValueError(f"truncated or grown: {buf.size} bytes, the header says {want}")
    return specs, payload


def parse_head(buf: np.ndarray, fingerprint: str) -> tuple[list[ArraySpec], int, int]:
    """An entry's array specs, where its payload starts and its whole size, from bytes
    that begin with it (its header at least)."""
    if buf.size < PREFIX.size + CRC.size:
        raise ValueError(f"truncated ({buf.size} bytes)")
    magic, version, key_len, header_len = PREFIX.unpack_from(buf)
    if magic != MAGIC:
        raise ValueError("not a disk-tier file")
    if version != FORMAT_VERSION:
        raise ValueError(f"format version {version}, this build reads {FORMAT_VERSION}")
    payload = PREFIX.size + key_len + header_len
    if payload > buf.size - CRC.size:
        raise ValueError(f"truncated ({buf.size} bytes)")
    header = json.loads(bytes(buf[PREFIX.size + key_len : payload]))
    if header["fingerprint"] != fingerprint:
        raise ValueError(f"written for {header['fingerprint']}")
    specs = [
        ArraySpec(name, np.dtype(dtype), tuple(shape), start, size)
        for name, dtype, shape, start, size in header["arrays"]
    ]
    return specs, payload, payload + sum(s.size for s in specs) + CRC.size


def entry_key(buf: np.ndarray) -> str:
    """The key of the entry ``buf`` begins with (its prefix and key at least)."""
    magic, version, key_len, _ = PREFIX.unpack_from(buf)
    if magic != MAGIC or version != FORMAT_VERSION:
        raise ValueError("an entry of a pack is not a disk-tier entry of this format")
    return bytes(buf[PREFIX.size : PREFIX.size + key_len]).decode()


def same_header(first: np.ndarray, entry: np.ndarray, key: str, payload: int) -> bool:
    """Whether ``entry`` begins as ``first`` does (``payload`` bytes: the prefix and the
    header) but for its key, which is ``key``."""
    lo, hi = PREFIX.size, PREFIX.size + PREFIX.unpack_from(first)[2]
    return (
        np.array_equal(entry[:lo], first[:lo])
        and bytes(entry[lo:hi]) == key.encode()
        and np.array_equal(entry[hi:payload], first[hi:payload])
    )


def crc_ok(buf: np.ndarray) -> bool:
    """Whether an entry's bytes end with the CRC-32 of the rest."""
    (crc,) = CRC.unpack_from(buf, buf.size - CRC.size)
    return zlib.crc32(buf[: -CRC.size]) == crc
