"""``mlx_paged.server --kv-disk-dir``: a restarted server answers a repeated prompt from disk."""

from __future__ import annotations

import signal

from test_server import MODEL, start_server

PROMPT = list(range(1000, 1104))  # 104 tokens: 6 full blocks of 16 before the last token
FLAGS = ("--log-level", "info", "--kv-disk-bytes", "1GB")


def ask(server) -> tuple[str, int]:
    out = server.client().completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0
    )
    return out.choices[0].text, out.usage.prompt_tokens_details.cached_tokens


def test_a_restarted_server_answers_from_disk_and_survives_bad_files(tmp_path):
    disk = tmp_path / "kv"
    first = start_server(tmp_path, "first", "--kv-disk-dir", str(disk), *FLAGS)
    try:
        text, cached = ask(first)
        assert text and cached == 0
        first.proc.send_signal(signal.SIGTERM)  # shutdown writes what the cache holds
        assert first.proc.wait(60) == 0, first.log_tail()
    finally:
        first.stop()
    files = sorted(disk.glob("*.kv*"))  # entry files, and packs of several
    assert files, first.log_tail()

    # Restarted with the newest entries read into memory as it starts (every one here),
    # kept there until a request loads them.
    preload = ("--kv-disk-preload-bytes", "1GB")
    kept = (*preload, "--no-kv-disk-restore")
    second = start_server(tmp_path, "second", "--kv-disk-dir", str(disk), *kept, *FLAGS)
    try:
        # Ready once the preload's thread holds them, not only started.
        assert "preloaded 6 disk-tier entries" in second.log_tail()
        assert second.metrics()["mlx_paged_kv_disk_preloaded_bytes"] > 0
        assert ask(second) == (text, 96)  # all 6 full blocks, from disk
        m = second.metrics()
        assert m["mlx_paged_kv_disk_hit_tokens_total"] == 96
        assert m["mlx_paged_kv_disk_hits_total"] == 6
        assert m["mlx_paged_kv_disk_preload_hits_total"] == 6  # no file read
        assert m["mlx_paged_kv_disk_preloaded_bytes"] == 0  # given back once all were taken
        assert m["mlx_paged_kv_disk_bytes"] == sum(f.stat().st_size for f in disk.glob("*.kv*"))
    finally:
        second.proc.kill()  # no shutdown: nothing more is written
        second.proc.wait()

    # Restored: loaded into the pool before the server reports ready.
    restored = start_server(tmp_path, "restored", "--kv-disk-dir", str(disk), *preload, *FLAGS)
    try:
        assert "restored 96 cached tokens (1 prefixes)" in restored.log_tail()
        m = restored.metrics()
        assert m["mlx_paged_kv_disk_restored_tokens_total"] == 96
        assert m["mlx_paged_kv_disk_hits_total"] == m["mlx_paged_kv_disk_preload_hits_total"] == 6
        assert m["mlx_paged_kv_disk_preloaded_bytes"] == 0  # in the pool now, not the host
        assert ask(restored) == (text, 96)  # all 6 full blocks, from memory
        m = restored.metrics()
        assert m["mlx_paged_kv_disk_hit_tokens_total"] == 0  # no load at request time
        assert m["mlx_paged_kv_disk_hits_total"] == 6
    finally:
        restored.proc.kill()
        restored.proc.wait()
    for f in disk.glob("*.kv*"):  # every file damaged: flipped bytes or cut short
        data = bytearray(f.read_bytes())
        data[len(data) // 3] ^= 0x5A
        f.write_bytes(bytes(data[: len(data) - (len(data) % 7)]))

    third = start_server(tmp_path, "third", "--kv-disk-dir", str(disk), *FLAGS)
    try:
        assert ask(third) == (text, 0)  # recomputed
        assert third.metrics()["mlx_paged_kv_disk_hit_tokens_total"] == 0
        assert "deleting the disk-tier file" in third.log_tail()
        assert ask(third) == (text, 103)  # the memory cache: every token but the last
    finally:
        third.stop()
