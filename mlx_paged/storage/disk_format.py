"""The disk tier's file format: one entry of named arrays, checked when read.

    b"MLXPGKV\\0", format version (u32), key length (u32), header length (u32),
    the key, the header (JSON: the fingerprint and each array's name, dtype,
    shape and byte range; padded with spaces so that the payload starts at a
    multiple of 16 bytes), the payload (the arrays' bytes, zero-padded to a
    multiple of 16), then a CRC-32 (u32) of everything before the payload and
    the payload's word sum (u32).

The word sum reads the payload as little-endian u32 words ``w_i`` and adds up
``w_i * (2i + 1)`` modulo 2**32. Each multiplier is odd, so a change within any
one word always changes the sum; a change spread over several words goes
unseen with a chance near 2**-32, as with CRC-32. Unlike CRC-32, the sum is two
array operations, so a load checks it where the bytes go, on the GPU
(``storage/disk_entries.py``: ``device_sums``), at memory speed; the host
computes the same sum with ``np.dot`` (``payload_sums``). Neither is a defence
against someone forging files.

Entries of one layout (the same arrays, shapes and dtypes under keys of one
length) have the same header and size, so many of them can be read into one
buffer and checked against the first (``same_headers``).
"""

from __future__ import annotations

import json
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

MAGIC = b"MLXPGKV\0"
FORMAT_VERSION = 3
PREFIX = struct.Struct("<8sIII")
#: The head's CRC-32 and the payload's word sum.
TRAILER = struct.Struct("<II")
#: Where the payload starts, and how its size rounds: whole 16-byte words.
ALIGN = 16


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
    ``s`` in ``specs``. ``checked`` says whether the payloads' sums were checked
    on the host; if not, the reader checks them (``sums``, ``payload_words``)
    before trusting a row.
    """

    data: np.ndarray  # (entries, file bytes) uint8
    specs: list[ArraySpec]
    payload: int
    checked: bool = True

    def __len__(self) -> int:
        return self.data.shape[0]

    @classmethod
    def of(cls, fingerprint: str, key: str, arrays: dict[str, np.ndarray]) -> Run:
        """One entry's run, as if written and read back (no file)."""
        data = np.frombuffer(encode(fingerprint, key, arrays), dtype=np.uint8)
        specs, payload = parse(data, fingerprint)
        return cls(data[None], specs, payload)

    @property
    def payload_words(self) -> tuple[int, int]:
        """The payload's first and end u32 word in a row."""
        return self.payload // 4, (self.data.shape[1] - TRAILER.size) // 4

    @property
    def sums(self) -> np.ndarray:
        """Each entry's payload word sum, as written: ``(entries,)`` uint32."""
        at = self.data.shape[1] - TRAILER.size + 4
        return np.ascontiguousarray(self.data[:, at : at + 4]).view("<u4")[:, 0]

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
    key_bytes = key.encode()
    header = json.dumps({"fingerprint": fingerprint, "arrays": specs}).encode()
    header += b" " * (-(PREFIX.size + len(key_bytes) + len(header)) % ALIGN)
    head = PREFIX.pack(MAGIC, FORMAT_VERSION, len(key_bytes), len(header)) + key_bytes + header
    payload = np.zeros(_padded(offset), dtype=np.uint8)
    if chunks:
        np.concatenate(chunks, out=payload[:offset])
    trailer = TRAILER.pack(zlib.crc32(head), int(payload_sums(payload.view("<u4"))))
    return b"".join([head, payload.data, trailer])


def payload_sums(words: np.ndarray) -> np.ndarray:
    """The word sum of each row of ``(..., N)`` little-endian u32 ``words``, on the host."""
    return np.dot(words, _weights(words.shape[-1])).astype(np.uint32)


@lru_cache(maxsize=8)
def _weights(n: int) -> np.ndarray:
    """The sum's multipliers ``2i + 1`` for ``n`` words."""
    return np.arange(1, 2 * n, 2, dtype=np.uint32)


def _padded(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def parse(buf: np.ndarray, fingerprint: str) -> tuple[list[ArraySpec], int]:
    """An entry's array specs and where its payload starts."""
    specs, payload, want = parse_head(buf, fingerprint)
    if want != buf.size:
        raise ValueError(f"truncated or grown: {buf.size} bytes, the header says {want}")
    return specs, payload


def parse_head(buf: np.ndarray, fingerprint: str) -> tuple[list[ArraySpec], int, int]:
    """An entry's array specs, where its payload starts and its whole size, from bytes
    that begin with it (its header at least)."""
    if buf.size < PREFIX.size + TRAILER.size:
        raise ValueError(f"truncated ({buf.size} bytes)")
    magic, version, key_len, header_len = PREFIX.unpack_from(buf)
    if magic != MAGIC:
        raise ValueError("not a disk-tier file")
    if version != FORMAT_VERSION:
        raise ValueError(f"format version {version}, this build reads {FORMAT_VERSION}")
    payload = PREFIX.size + key_len + header_len
    if payload > buf.size - TRAILER.size:
        raise ValueError(f"truncated ({buf.size} bytes)")
    header = json.loads(bytes(buf[PREFIX.size + key_len : payload]))
    if header["fingerprint"] != fingerprint:
        raise ValueError(f"written for {header['fingerprint']}")
    specs = [
        ArraySpec(name, np.dtype(dtype), tuple(shape), start, size)
        for name, dtype, shape, start, size in header["arrays"]
    ]
    return specs, payload, payload + _padded(sum(s.size for s in specs)) + TRAILER.size


def entry_key(buf: np.ndarray) -> str:
    """The key of the entry ``buf`` begins with (its prefix and key at least)."""
    magic, version, key_len, _ = PREFIX.unpack_from(buf)
    if magic != MAGIC or version != FORMAT_VERSION:
        raise ValueError("an entry of a pack is not a disk-tier entry of this format")
    return bytes(buf[PREFIX.size : PREFIX.size + key_len]).decode()


def same_headers(rows: np.ndarray, keys: Sequence[str], payload: int) -> np.ndarray:
    """Per row of ``rows`` (entries of one size, one per key), whether it begins as the
    first does (``payload`` bytes: the prefix and the header) but for its key, which is
    ``keys[i]``: a few array operations for the whole run."""
    first = rows[0]
    lo, hi = PREFIX.size, PREFIX.size + PREFIX.unpack_from(first)[2]
    encoded = [k.encode() for k in keys]
    ok = np.array([len(k) == hi - lo for k in encoded], dtype=bool)
    want = b"".join(k if len(k) == hi - lo else bytes(hi - lo) for k in encoded)
    head = rows[: len(keys), :payload]
    ok &= (head[:, :lo] == first[:lo]).all(axis=1)
    ok &= (head[:, lo:hi] == np.frombuffer(want, np.uint8).reshape(len(keys), hi - lo)).all(axis=1)
    ok &= (head[:, hi:] == first[hi:payload]).all(axis=1)
    return ok


def check_rows(rows: np.ndarray, payload_too: bool = True) -> list[str | None]:
    """``check`` of each row of ``rows`` (entries of one size, as a pack holds): the
    lengths, trailers and payload sums read for all rows at once, then a CRC-32 per head;
    only a row that fails is checked alone (for what is wrong with it)."""
    n, size = rows.shape
    if not n or size < PREFIX.size + TRAILER.size or size % 4:
        return [check(row, payload_too) for row in rows]
    _, _, key_len, header_len = PREFIX.unpack_from(rows[0])
    payload, end = PREFIX.size + key_len + header_len, size - TRAILER.size
    lengths = rows[:, PREFIX.size - 8 : PREFIX.size].view("<u4")  # (n, 2): key, header
    if payload > end or payload % 4 or (lengths != (key_len, header_len)).any():
        return [check(row, payload_too) for row in rows]
    trailers = rows[:, end:].view("<u4")  # (n, 2): the head's CRC-32, the payload's sum
    ok = np.fromiter(map(zlib.crc32, rows[:, :payload]), np.uint32, n) == trailers[:, 0]
    if payload_too:
        ok &= payload_sums(rows[:, payload:end].view("<u4")) == trailers[:, 1]
    return [None if good else check(row, payload_too) for row, good in zip(rows, ok, strict=True)]


def check(buf: np.ndarray, payload_too: bool = True) -> str | None:
    """What is wrong with an entry's bytes (which of its checks fails), or ``None``: the
    head's CRC-32, and unless ``payload_too`` is false, the payload's word sum."""
    if buf.size < PREFIX.size + TRAILER.size or buf.size % 4:
        return "the size is not an entry's"
    _, _, key_len, header_len = PREFIX.unpack_from(buf)
    payload, end = PREFIX.size + key_len + header_len, buf.size - TRAILER.size
    if payload > end or payload % 4:
        return "the header does not fit"
    crc, total = TRAILER.unpack_from(buf, end)
    if zlib.crc32(buf[:payload]) != crc:
        return "the checksum of the header does not match (corrupted)"
    if payload_too and int(payload_sums(buf[payload:end].view("<u4"))) != total:
        return "the checksum of the arrays does not match (corrupted)"
    return None
