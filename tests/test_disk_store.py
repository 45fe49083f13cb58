"""The disk tier's files: round trips, restarts, bad files, the size cap, unusable directories."""

from __future__ import annotations

import errno
import logging
import os
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlx_paged.storage import disk, disk_files, disk_runs
from mlx_paged.storage.disk import DiskStore

FP = "model0fingerprint"


def arrays(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "keys": rng.standard_normal((2, 16, 4, 8)).astype(np.float16),
        "values": rng.standard_normal((2, 16, 4, 8)).astype(np.float32),
        "scales": rng.integers(0, 2**32 - 1, (3, 5), dtype=np.uint32),
    }


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k]) for k in a
    )


def test_an_entry_comes_back_as_written_and_survives_a_restart(tmp_path):
    store = DiskStore(tmp_path, 10**7, FP)
    assert store.put("abc123", arrays(1))
    assert "abc123" in store and store.keys == ["abc123"]
    assert same(store.get("abc123"), arrays(1))
    size = (tmp_path / f"{FP}-abc123.kv").stat().st_size
    assert store.bytes == size
    again = DiskStore(tmp_path, 10**7, FP)
    assert again.keys == ["abc123"] and again.bytes == size
    assert same(again.get("abc123"), arrays(1))
    assert again.counts["hits"] == 1
    assert again.get("missing") is None and again.counts["misses"] == 1


def test_a_read_refreshes_its_files_modification_time_on_the_writer_thread(tmp_path):
    store = DiskStore(tmp_path, 10**7, FP)
    assert store.put("abc123", arrays(1))
    store.put_many_later([(k, arrays(2)) for k in ("p1", "p2", "p3")])
    store.flush()
    files = [tmp_path / f"{FP}-abc123.kv", *tmp_path.glob("*.kvp")]
    assert len(files) == 2
    old = time.time() - 3600
    for f in files:
        os.utime(f, (old, old))
    assert same(store.get("abc123"), arrays(1))
    run = store.read_run(["p2", "p3"])
    assert run is not None and len(run) == 2
    store.flush()
    assert all(f.stat().st_mtime > old + 3000 for f in files)


def test_reads_keep_descriptors_open_until_the_file_goes_or_they_are_closed(tmp_path):
    store = DiskStore(tmp_path, 10**7, FP)
    for key in ("a1", "b2"):
        assert store.put(key, arrays(1))
    assert same(store.get("a1"), arrays(1))
    held = store._files._open
    assert list(held) == [f"{FP}-a1.kv"]
    fd = held[f"{FP}-a1.kv"].fd
    assert same(store.get("a1"), arrays(1)) and held[f"{FP}-a1.kv"].fd == fd  # kept
    store.close_files()  # on the background thread
    store.flush()
    assert not held
    with pytest.raises(OSError):
        os.fstat(fd)  # closed
    # Another process deletes a file: a miss once the descriptors are closed.
    assert same(store.get("b2"), arrays(1))
    (tmp_path / f"{FP}-b2.kv").unlink()
    store.close_files()
    store.flush()
    assert store.get("b2") is None and "b2" not in store
    # A file the store drops (here: the cap) closes its descriptor.
    assert store.get("a1") is not None and list(held) == [f"{FP}-a1.kv"]
    store.discard("a1", "a test")
    assert not held and "a1" not in store


def test_another_fingerprint_never_sees_the_entry(tmp_path):
    DiskStore(tmp_path, 10**7, FP).put("abc", arrays())
    other = DiskStore(tmp_path, 10**7, "othermodel")
    assert "abc" not in other and other.get("abc") is None


def corrupt_truncate(path):
    path.write_bytes(path.read_bytes()[:-100])


def corrupt_flip(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def corrupt_foreign(path):
    data = disk.encode("someothermodel", "abc", arrays())
    path.write_bytes(data)


def corrupt_old_version(path):
    data = bytearray(path.read_bytes())
    data[8:12] = (disk.FORMAT_VERSION + 7).to_bytes(4, "little")
    path.write_bytes(bytes(data))


def corrupt_empty(path):
    path.write_bytes(b"")


def corrupt_grown(path):
    path.write_bytes(path.read_bytes() + b"more")


@pytest.mark.parametrize(
    "damage, message",
    [
        (corrupt_truncate, "truncated"),
        (corrupt_flip, "checksum"),
        (corrupt_foreign, "written for someothermodel"),
        (corrupt_old_version, "format version"),
        (corrupt_empty, "truncated"),
        (corrupt_grown, "rewritten"),
    ],
)
def test_a_bad_file_is_a_miss_deleted_with_a_log_line(tmp_path, caplog, damage, message):
    store = DiskStore(tmp_path, 10**7, FP)
    store.put("abc", arrays())
    path = tmp_path / f"{FP}-abc.kv"
    damage(path)
    with caplog.at_level(logging.WARNING, logger="mlx_paged.disk"):
        assert store.get("abc") is None
    assert not path.exists() and "abc" not in store and store.bytes == 0
    assert any(message in r.getMessage() for r in caplog.records), caplog.text
    assert store.put("abc", arrays(2)) and same(store.get("abc"), arrays(2))


def test_a_killed_writers_files_are_cleaned_up_or_ignored(tmp_path):
    """A writer killed midway leaves a temporary file (deleted once stale) or, never
    renamed, nothing under the entry's name; a torn entry file reads as a miss."""
    store = DiskStore(tmp_path, 10**7, FP)
    store.put("whole", arrays())
    data = disk.encode(FP, "torn", arrays())
    stale = tmp_path / f".{FP}-torn.kv.999.dead.tmp"
    stale.write_bytes(data[:1000])
    old = time.time() - disk.STALE_TEMP_SECONDS - 1
    os.utime(stale, (old, old))
    young = tmp_path / f".{FP}-other.kv.998.live.tmp"
    young.write_bytes(data[:10])
    (tmp_path / f"{FP}-torn.kv").write_bytes(data[: len(data) // 2])
    again = DiskStore(tmp_path, 10**7, FP)
    assert not stale.exists() and young.exists()  # a live writer's file is left alone
    assert again.get("torn") is None and not (tmp_path / f"{FP}-torn.kv").exists()
    assert same(again.get("whole"), arrays())


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("abcdefgh"), st.booleans()), max_size=30))
def test_the_directory_stays_under_its_cap_dropping_the_least_recently_used(tmp_path_factory, ops):
    path = tmp_path_factory.mktemp("cap")
    one = len(disk.encode(FP, "a", arrays()))
    store = DiskStore(path, 3 * one + 10, FP)  # room for three entries
    recent: list[str] = []  # what an LRU of three must hold, most recent last
    for key, write in ops:
        if write:
            assert store.put(key, arrays())
        elif store.get(key) is None:
            assert key not in recent[-3:]
            continue
        recent = [k for k in recent if k != key] + [key]
        on_disk = sum(f.stat().st_size for f in path.glob("*.kv"))
        assert on_disk == store.bytes <= store.max_bytes
        assert sorted(store.keys) == sorted(recent[-3:])


def test_the_cap_counts_every_models_files(tmp_path):
    one = len(disk.encode(FP, "a", arrays()))
    other = DiskStore(tmp_path, 10**7, "othermodel")
    other.put("x", arrays())
    other.put("y", arrays())
    store = DiskStore(tmp_path, 2 * one + 10, FP)  # already full: the oldest goes
    assert sorted(p.name for p in tmp_path.glob("*.kv")) == ["othermodel-x.kv", "othermodel-y.kv"]
    store.put("a", arrays())
    assert sorted(p.name for p in tmp_path.glob("*.kv")) == [f"{FP}-a.kv", "othermodel-y.kv"]


def test_an_unusable_directory_turns_the_tier_off_with_one_warning(tmp_path, caplog):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    with caplog.at_level(logging.WARNING, logger="mlx_paged.disk"):
        store = DiskStore(not_a_dir / "kv", 10**7, FP)
        assert not store.put("a", arrays()) and store.get("a") is None
    assert not store.enabled and len(caplog.records) == 1


def test_a_full_disk_turns_the_tier_off_with_one_warning(tmp_path, caplog, monkeypatch):
    store = DiskStore(tmp_path, 10**7, FP)
    store.put("a", arrays())

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(disk.os, "replace", full)
    with caplog.at_level(logging.WARNING, logger="mlx_paged.disk"):
        assert not store.put("b", arrays())
        assert not store.put("c", arrays())
    assert not store.enabled and len(caplog.records) == 1
    assert not list(tmp_path.glob("*.tmp"))  # its temporary file went too


def test_the_store_counts_the_leading_keys_it_has_or_is_writing(tmp_path):
    store = DiskStore(tmp_path, 10**7, FP)
    assert store.put("a1", arrays(1)) and store.put("b2", arrays(2))
    store.put_many_later([("c3", arrays(3))])  # counted from now on, written or not
    assert store.leading(["a1", "b2", "c3", "d4", "a1"]) == 3
    assert store.leading(["d4", "a1"]) == 0 and store.leading([]) == 0
    assert "c3" in store and "d4" not in store
    store.flush()
    assert store.leading(["c3", "b2"]) == 2
    with pytest.raises(ValueError, match="letters and digits"):
        store.leading(["a1", "../x"])


@pytest.mark.parametrize("bad", ["", "a/b", "../x", "a-b"])
def test_keys_and_fingerprints_are_checked(tmp_path, bad):
    store = DiskStore(tmp_path, 10**7, FP)
    with pytest.raises(ValueError, match="letters and digits"):
        store.put(bad, arrays())
    with pytest.raises(ValueError, match="letters and digits"):
        DiskStore(tmp_path, 10**7, bad)
    with pytest.raises(ValueError, match="max_bytes"):
        DiskStore(tmp_path, 0, FP)


@pytest.mark.parametrize("bad", [None, 3, 8, 17])
def test_a_long_run_reads_each_file_into_its_row_and_stops_before_a_bad_one(
    tmp_path, monkeypatch, bad
):
    # Reader tasks take several files each (ceil(26 / 4) = 7 here): rows and errors must
    # still line up.
    monkeypatch.setattr(disk, "READ_THREADS", 4)
    n = 26
    store = DiskStore(tmp_path, 10**8, FP)
    keys = [f"k{i:03d}" for i in range(n)]  # one length: one file size
    for i, key in enumerate(keys):
        store.put(key, arrays(i))
    if bad is not None:
        corrupt_flip(tmp_path / f"{FP}-{keys[bad]}.kv")
    run = store.read_run(keys)
    assert len(run) == (n if bad is None else bad)
    assert all(same(run.arrays(i), arrays(i)) for i in range(len(run)))
    assert sorted(store.keys) == [k for i, k in enumerate(keys) if i != bad]


def test_a_file_under_another_keys_name_is_a_miss(tmp_path, caplog):
    store = DiskStore(tmp_path, 10**7, FP)
    store.put("aaa", arrays(1))
    store.put("bbb", arrays(2))
    (tmp_path / f"{FP}-bbb.kv").write_bytes((tmp_path / f"{FP}-aaa.kv").read_bytes())
    with caplog.at_level(logging.WARNING, logger="mlx_paged.disk"):
        run = store.read_run(["aaa", "bbb"])
    assert len(run) == 1 and same(run.arrays(0), arrays(1))  # the run stops before it
    assert "bbb" not in store and not (tmp_path / f"{FP}-bbb.kv").exists()
    assert any("another key" in r.getMessage() for r in caplog.records), caplog.text


# ---- packs: a run of entries in one file -------------------------------------


def pack_files(path) -> list:
    return sorted(path.glob(f"*{disk.PACK_SUFFIX}"))


def write_pack(store: DiskStore, keys: list[str], seed: int = 0) -> None:
    store.put_many_later([(key, arrays(seed + i)) for i, key in enumerate(keys)])
    store.flush()


def test_a_pack_holds_a_run_of_entries_and_survives_a_restart(tmp_path):
    keys = [f"p{i:03d}" for i in range(20)]
    store = DiskStore(tmp_path, 10**8, FP)
    write_pack(store, keys)
    (pack,) = pack_files(tmp_path)
    assert not list(tmp_path.glob("*.kv")) and store.counts["writes"] == 20
    entry = len(disk.encode(FP, keys[0], arrays()))
    assert pack.stat().st_size == 20 * entry == store.bytes and store.size(keys[3]) == entry
    for again in (store, DiskStore(tmp_path, 10**8, FP)):
        assert sorted(again.keys) == keys and all(k in again for k in keys)
        run = again.read_run(keys[5:])  # from the middle of the pack
        assert len(run) == 15 and all(same(run.arrays(i), arrays(5 + i)) for i in range(15))
    assert DiskStore(tmp_path, 10**8, "othermodel").keys == []


def test_packs_split_at_their_size_limit_and_at_an_entry_of_another_size(tmp_path):
    keys = [f"q{i:03d}" for i in range(disk.PACK_ENTRIES + 10)]
    items = [(key, arrays(i)) for i, key in enumerate(keys)]
    odd = {"keys": np.zeros(3, dtype=np.float32)}
    items.insert(4, ("odd", odd))  # another size: its own file, between two packs
    store = DiskStore(tmp_path, 10**9, FP)
    store.put_many_later(items)
    store.flush()
    sizes = sorted(
        p.stat().st_size // len(disk.encode(FP, keys[0], arrays())) for p in pack_files(tmp_path)
    )
    assert sizes == [4, 6, disk.PACK_ENTRIES]  # 4, the odd one, then 64 and 6
    assert (tmp_path / f"{FP}-odd.kv").exists() and same(store.get("odd"), odd)
    run = store.read_run(keys)  # across three packs
    assert len(run) == len(keys) and all(same(run.arrays(i), arrays(i)) for i in range(len(keys)))


@pytest.mark.parametrize("damage", [corrupt_flip, corrupt_truncate, corrupt_grown])
def test_a_bad_pack_goes_as_a_whole(tmp_path, caplog, damage):
    keys = [f"r{i:03d}" for i in range(12)]
    store = DiskStore(tmp_path, 10**8, FP)
    write_pack(store, keys)
    (pack,) = pack_files(tmp_path)
    damage(pack)
    with caplog.at_level(logging.WARNING, logger="mlx_paged.disk"):
        run = store.read_run(keys)
    if damage is corrupt_flip:  # the middle entry's checksum: the run stops before it
        assert len(run) == 6 and all(same(run.arrays(i), arrays(i)) for i in range(6))
    else:  # the pack's size no longer matches its index: no entry is trusted
        assert run is None
    assert not pack.exists() and store.keys == [] and store.bytes == 0
    assert any("deleting" in r.getMessage() for r in caplog.records), caplog.text


@pytest.mark.parametrize("where", ["header", "trailer"])
def test_a_pack_read_unchecked_checks_the_runs_heads_at_once(tmp_path, monkeypatch, where):
    """Payloads left to the caller (the GPU checks them): the reader tasks only read, and
    the run's heads are checked in one pass after them; a damaged head still ends the run."""
    monkeypatch.setattr(disk, "READ_THREADS", 4)  # tasks of 3 entries
    keys = [f"u{i:03d}" for i in range(12)]
    store = DiskStore(tmp_path, 10**8, FP)
    write_pack(store, keys)
    (pack,) = pack_files(tmp_path)
    entry = store.size(keys[0])
    data = bytearray(pack.read_bytes())
    data[7 * entry + 30 if where == "header" else 8 * entry - 8] ^= 0x01  # entry 7: JSON, head CRC
    pack.write_bytes(bytes(data))
    checked = []
    real = disk_files.check_rows
    for module in (disk_files, disk_runs):  # the reader tasks' checks, and the run's
        monkeypatch.setattr(
            module, "check_rows", lambda rows, *a: checked.append(len(rows)) or real(rows, *a)
        )
    run = store.read_run(keys, payloads=False)
    assert checked == [12]  # one pass over the run, none on the reader tasks
    assert len(run) == 7 and all(same(run.arrays(i), arrays(i)) for i in range(7))
    assert not pack.exists() and store.keys == []


@pytest.mark.parametrize("damage", [corrupt_truncate, corrupt_grown, corrupt_old_version])
def test_a_start_deletes_a_bad_pack_with_a_log_line(tmp_path, caplog, damage):
    write_pack(DiskStore(tmp_path, 10**8, FP), [f"s{i:03d}" for i in range(6)])
    (pack,) = pack_files(tmp_path)
    damage(pack)
    with caplog.at_level(logging.WARNING, logger="mlx_paged.disk"):
        store = DiskStore(tmp_path, 10**8, FP)
    assert store.keys == [] and store.bytes == 0 and not pack.exists()
    assert any("deleting" in r.getMessage() for r in caplog.records), caplog.text


def test_the_cap_drops_a_least_recently_used_pack_whole(tmp_path):
    entry = len(disk.encode(FP, "t000", arrays()))
    store = DiskStore(tmp_path, 36 * entry, FP)  # a pack holds at most 9 entries
    write_pack(store, [f"a{i:03d}" for i in range(20)])
    assert len(pack_files(tmp_path)) == 3  # 9, 9 and 2
    for name in "bcd":  # 20 + 3 * 8 = 44 entries > 36: the oldest pack (9) goes, whole
        write_pack(store, [f"{name}{i:03d}" for i in range(8)])
    kept = sorted(store.keys)
    assert kept == sorted(
        [f"a{i:03d}" for i in range(9, 20)] + [f"{n}{i:03d}" for n in "bcd" for i in range(8)]
    )
    assert store.bytes == len(kept) * entry <= 36 * entry


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.tuples(st.just("file"), st.integers(0, 9), st.integers(1, 50)),
            st.tuples(
                st.just("pack"),
                st.lists(st.integers(0, 9), min_size=2, max_size=5),
                st.integers(1, 50),
            ),  # fmt: skip
            st.tuples(st.just("drop"), st.integers(0, 20), st.just(0)),
        ),
        max_size=30,
    ),
    st.permutations(range(10)),
)
def test_the_index_keeps_its_bytes_and_where_each_key_lies(ops, order):
    from mlx_paged.storage.disk_index import DiskIndex

    index, made = DiskIndex(FP), []
    own: set[str] = set()  # keys with a file of their own
    packed: dict[str, str] = {}  # key -> the pack last written with it
    for kind, what, size in ops:
        if kind == "drop":
            if made:
                name = made[what % len(made)]
                index.drop(name)
                own -= {k for k in own if index.name(k) == name}
                packed = {k: p for k, p in packed.items() if p != name}
            continue
        keys = [f"k{k}" for k in ([what] if kind == "file" else dict.fromkeys(what))]
        if kind == "file":
            name = index.name(keys[0])
            index.add(name, size)
            own.add(keys[0])
        else:
            name = f"{FP}-{keys[0]}-{len(made)}.kvp"
            index.add(name, size * len(keys), keys, size)
            packed |= dict.fromkeys(keys, name)
        made.append(name)
    assert index.bytes == sum(index.files.values())
    for key in own | set(packed):  # its own file first, else the pack last written with it
        expected = (index.name(key), True) if key in own else (packed[key], False)
        name, at, _ = index.locate(key)
        assert (name, at is None) == expected
    assert sorted(index.keys()) == sorted(own | set(packed))
    assert index.locate("nothere") is None
    # The leading keys of a walk that the index holds, or that are being written.
    walk = [f"k{k}" for k in order]
    held = [k in own or k in packed for k in walk] + [False]
    assert index.leading(walk, set()) == held.index(False)
    writing = {index.name(k) for k in walk[::2]}
    held = [k in own or k in packed or index.name(k) in writing for k in walk] + [False]
    assert index.leading(walk, writing) == held.index(False)


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["put", "pack", "get"]),
            st.lists(st.sampled_from("abcdefgh"), min_size=1, max_size=6, unique=True),
        ),
        max_size=25,
    )
)
def test_files_and_packs_stay_under_the_cap_least_recently_used_file_first(tmp_path_factory, ops):
    path = tmp_path_factory.mktemp("packcap")
    one = len(disk.encode(FP, "a", arrays()))
    store = DiskStore(path, 12 * one, FP)  # twelve entries; a pack holds three at most
    files: list[tuple[str, list[str]]] = []  # (name, keys), least recently used first
    packed: dict[str, str] = {}  # key -> the pack last written with it

    def add(name: str, keys: list[str]) -> None:
        nonlocal files
        files = [f for f in files if f[0] != name] + [(name, keys)]
        while len([k for _, ks in files for k in ks]) * one > store.max_bytes:
            gone = files.pop(0)[0]
            for k in [k for k, p in packed.items() if p == gone]:
                del packed[k]

    for op, keys in ops:
        if op == "get":
            key = keys[0]
            name = f"s{key}" if any(f[0] == f"s{key}" for f in files) else packed.get(key)
            assert (store.get(key) is None) == (name is None)
            if name is not None:
                files = [f for f in files if f[0] != name] + [f for f in files if f[0] == name]
            continue
        if op == "put":
            keys = keys[:1]
            assert store.put(keys[0], arrays())
        else:
            store.put_many_later([(k, arrays()) for k in keys])
            store.flush()
        for i in range(0, len(keys), 3):
            chunk = keys[i : i + 3]
            if len(chunk) == 1:
                add(f"s{chunk[0]}", chunk)
            else:
                name = f"p{len(files)}-{i}-{len(ops)}-{id(chunk)}"
                packed.update(dict.fromkeys(chunk, name))
                add(name, chunk)
        on_disk = sum(f.stat().st_size for f in path.glob("*.kv*"))
        assert on_disk == store.bytes <= store.max_bytes
        singles = {ks[0] for n, ks in files if n.startswith("s")}
        assert sorted(store.keys) == sorted(singles | set(packed))
