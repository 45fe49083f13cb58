"""The disk tier's file reads and pack layout: what ``DiskStore`` does to its files.

Functions of paths and buffers, no index: read an entry file or a run of a
pack's entries into rows of a buffer and check each one's checksums; plan which
reader thread reads which rows; read a pack's keys; group entries into packs.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from .disk_format import ArraySpec, check, entry_key, parse, parse_head, same_header

SUFFIX = ".kv"
PACK_SUFFIX = ".kvp"
#: Most entries one pack holds.
PACK_ENTRIES = 64
#: Bytes a start reads of a pack's first entry to find its size (its header fits), and
#: of each entry to find its key (the prefix and a key of up to 236 bytes).
HEAD_BYTES = 1 << 20
HEAD_KEY = 256
_UTIME_FD = os.utime in os.supports_fd

#: One reader task's piece: (file, index in its pack or None, the file's bytes, first
#: row of the buffer, entries).
Segment = tuple[str, "int | None", int, int, int]


def plan_reads(rows: list[tuple[str, int | None, int]], threads: int) -> list[list[Segment]]:
    """Split ``(file, index in its pack or None, file bytes)`` rows into one task per
    reader thread, each a list of segments; a pack's entries that follow each other in a
    task form one segment, read with one call."""
    share = -(-len(rows) // threads)
    tasks: list[list[Segment]] = [[]]
    filled = 0
    for r, (name, index, total) in enumerate(rows):
        if filled == share:
            tasks.append([])
            filled = 0
        task = tasks[-1]
        last = task[-1] if task else None
        if last and index is not None and last[0] == name and last[1] == index - last[4]:
            task[-1] = (name, last[1], total, last[3], last[4] + 1)
        else:
            task.append((name, index, total, r, 1))
        filled += 1
    return tasks


def read_segments(
    directory: Path,
    fingerprint: str,
    payloads: bool,
    segments: list[Segment],
    data: np.ndarray,
) -> list[Exception | None]:
    """Read each segment into its rows of ``data``, in turn; one error (or ``None``) per
    entry. ``payloads``: check the payloads' sums too, not only the heads'. Runs on
    reader threads: no shared state."""
    errors: list[Exception | None] = []
    for name, index, total, row, count in segments:
        out = data[row : row + count]
        if index is None:
            errors.append(read_entry(directory / name, out[0], fingerprint, payloads))
        else:
            errors += read_pack(directory / name, index, total, out, payloads)
    return errors


def valid_rows(
    data: np.ndarray, keys: Sequence[str], errors: list[Exception | None], fingerprint: str
) -> tuple[int, list[ArraySpec] | None, int, Exception | None]:
    """How many rows of ``data`` (read for ``keys``, with their read ``errors``) are valid
    from the first on: no error, and the first one's header, ``keys``' key in each; the
    first row's array specs and payload start; and the error of the row after them, if
    any."""
    n, specs, payload = 0, None, 0
    for key, error in zip(keys, errors, strict=False):
        if error is None and n == 0:
            try:
                specs, payload = parse(data[0], fingerprint)
            except ValueError as e:
                error = e
        if error is None and not same_header(data[0], data[n], key, payload):
            error = ValueError("written for another key, or in another layout than the first")
        if error is not None:
            return n, specs, payload, error
        n += 1
    return n, specs, payload, None


def read_pack(
    path: Path, index: int, total: int, out: np.ndarray, payloads: bool = True
) -> list[Exception | None]:
    """Read entries ``index, index + 1, ...`` of the pack at ``path`` (``total`` bytes when
    indexed) into the rows of ``out`` and check each one's checksums (``payloads``: the
    payload's too)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as e:
        return [e] * len(out)
    try:
        got = os.fstat(fd).st_size
        if got != total:
            error = ValueError(f"truncated or rewritten ({got} bytes, {total} indexed)")
            return [error] * len(out)
        os.lseek(fd, index * out.shape[1], os.SEEK_SET)
        got = os.readv(fd, list(out))
        if got != out.size:
            return [ValueError(f"truncated ({got} of {out.size} bytes read)")] * len(out)
        why = [check(row, payloads) for row in out]
        errors = [None if w is None else ValueError(f"an entry: {w}") for w in why]
        if not any(errors):
            _touch(fd, path)
        return errors
    except OSError as e:
        return [e] * len(out)
    finally:
        os.close(fd)


def read_entry(
    path: Path, out: np.ndarray, fingerprint: str, payloads: bool = True
) -> Exception | None:
    """Read the entry file at ``path`` into ``out`` (its whole size) and check its length
    and checksums (``payloads``: the payload's too); the error, or ``None``. A bare file
    descriptor, not a file object: a small file's read is mostly per-call cost."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as e:
        return e
    try:
        got = os.readv(fd, [out])
        grown = os.fstat(fd).st_size > out.size
        if got == out.size and not grown:
            why = check(out, payloads)
            if why is None:
                _touch(fd, path)
                return None
            error = ValueError(why)
        else:
            error = ValueError(f"truncated or rewritten ({got} bytes read, {out.size} indexed)")
    except OSError as e:
        return e
    finally:
        os.close(fd)
    try:  # the header may say more: another format, version or fingerprint
        parse(out[:got], fingerprint)
    except (ValueError, KeyError, UnicodeDecodeError) as e:
        error = ValueError(str(e)) if str(e) else error
    return error


def _touch(fd: int, path: Path) -> None:
    """Mark a file most recently used, for a later process too."""
    try:
        os.utime(fd if _UTIME_FD else path)
    except OSError:
        pass


def pack_keys(path: Path, size: int, fingerprint: str) -> tuple[list[str], int]:
    """The keys of the pack at ``path`` (``size`` bytes) in order, and its bytes per entry.

    Raises:
        ValueError: a first entry that does not parse, or a size that is not a whole
            number (two at least) of entries.
    """
    with open(path, "rb", buffering=0) as f:
        head = np.frombuffer(f.read(min(size, HEAD_BYTES)), dtype=np.uint8)
        _, _, entry = parse_head(head, fingerprint)
        if size % entry or size < 2 * entry:
            raise ValueError(f"truncated or grown: {size} bytes, entries of {entry}")
        keys = []
        for i in range(size // entry):
            f.seek(i * entry)
            keys.append(entry_key(np.frombuffer(f.read(HEAD_KEY), dtype=np.uint8)))
    return keys, entry


def group_packs(entries: list[tuple[str, bytes]], most: int) -> list[list[tuple[str, bytes]]]:
    """Runs of ``(key, entry bytes)`` of one size that follow each other, ``most`` at most
    each: a run of one is a file of its own, a longer one a pack."""
    groups: list[list[tuple[str, bytes]]] = []
    for key, data in entries:
        last = groups[-1] if groups else None
        if last and len(last) < most and len(last[0][1]) == len(data):
            last.append((key, data))
        else:
            groups.append([(key, data)])
    return groups


def write_file(directory: Path, name: str, datas: list[bytes]) -> None:
    """Write ``datas`` as file ``name``: under a temporary name of this writer's own, then
    renamed, so a reader sees a whole file or none (OSError if it could not be)."""
    temp = directory / f".{name}.{os.getpid()}.{uuid.uuid4().hex}.tmp"
    try:
        with open(temp, "wb") as f:
            for data in datas:
                f.write(data)
        os.replace(temp, directory / name)
    except OSError:
        temp.unlink(missing_ok=True)
        raise


def list_files(directory: Path, stale: float) -> list[tuple[float, str, int]]:
    """``(modified, name, bytes)`` of every entry file and pack in ``directory``; deletes
    temporary files older than ``stale`` seconds (a dead writer's)."""
    found, now = [], time.time()
    for entry in os.scandir(directory):
        if not entry.is_file():
            continue
        try:
            stat = entry.stat()
        except FileNotFoundError:
            continue
        if entry.name.endswith(".tmp"):
            if now - stat.st_mtime > stale:
                Path(entry.path).unlink(missing_ok=True)
        elif entry.name.endswith((SUFFIX, PACK_SUFFIX)):
            found.append((stat.st_mtime, entry.name, stat.st_size))
    return found
