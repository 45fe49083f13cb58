"""A long prompt re-sent to a restarted ``mlx_paged.server``: from its disk tier, against recompute.

Each server is a process of its own (``server.py``'s ``start``), and each request a
``/v1/completions`` call for one greedy token, timed from the call to its reply. The
prompt is ``--tokens`` random token ids.

1. A server without a disk tier answers another prompt of the same length first (its
   first-use work), then the prompt (the recompute: the baseline), then the prompt again
   (from its memory cache).
2. A server with ``--kv-disk-dir`` answers the prompt and is stopped with SIGTERM: its
   shutdown writes the cached blocks to the directory.
3. ``--restarts`` times: a server on that directory answers the prompt as its first request
   (plain), and, with ``--kv-disk-preload-bytes``, so do one that preloads and keeps the
   entries in host memory for the request to load (``--no-kv-disk-restore``), and one that
   preloads and restores them into its pool before it reports ready (the default). Each
   is killed (SIGKILL), so the directory stays as the shutdown left it. The time each took
   to report ready (load, warm-up and, preloading, the preload and the restore) is
   printed too, and a restore's tokens and seconds.

Usage:
    python benchmarks/server_restart.py --model /root/l1b32 --tokens 32768 \\
        --kv-disk-preload-bytes 2GB                                  # on the GPU
    python benchmarks/server_restart.py --tokens 2048 --paged-args "--model-dtype float32"
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import tempfile
import time
import urllib.request
from pathlib import Path

from server import free_port, start, stop

from mlx_paged.embedded import embedded_model_path


def ask(port: int, prompt: list[int]) -> tuple[float, int]:
    """One greedy token for ``prompt``: the seconds to the reply, and its cached tokens."""
    body = {"prompt": prompt, "max_tokens": 1, "temperature": 0.0}
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=600) as r:
        reply = json.loads(r.read())
    seconds = time.perf_counter() - t0
    details = reply["usage"].get("prompt_tokens_details") or {}
    return seconds, details.get("cached_tokens", 0)


def metrics(port: int) -> dict[str, float]:
    """The server's ``/metrics`` samples, by name and labels."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        lines = r.read().decode().splitlines()
    return {k: float(v) for k, v in (x.rsplit(" ", 1) for x in lines if not x.startswith("#"))}


def phases(before: dict[str, float], after: dict[str, float]) -> str:
    """The server's own first-token time and its phases over one request, in ms."""
    name = "mlx_paged_first_token_phase_seconds_sum"
    got = [(k[len(name) + 8 : -2], after[k] - before.get(k, 0.0)) for k in after if name in k]
    total = "mlx_paged_time_to_first_token_seconds_sum"
    lead = f"server {1e3 * (after[total] - before.get(total, 0.0)):.1f} ms: "
    return lead + ", ".join(f"{phase} {1e3 * s:.1f}" for phase, s in got)


class Server:
    """One ``mlx_paged.server`` process with ``extra`` flags, and how long it took to be ready."""

    def __init__(self, args: argparse.Namespace, extra: list[str]):
        self.port = free_port()
        opts = argparse.Namespace(
            concurrency=[1], no_warm_up=False, prefill_step_size=None,
            paged_args=" ".join([args.paged_args, *extra]),
        )  # fmt: skip
        t0 = time.perf_counter()
        self.proc = start("mlx_paged", args.model, self.port, opts)
        self.ready_s = time.perf_counter() - t0

    def line(self, name: str, prompt: list[int], recompute: float | None) -> float:
        before = metrics(self.port)
        seconds, cached = ask(self.port, prompt)
        after = metrics(self.port)
        ratio = f" ({seconds / recompute:.3f}x the recompute)" if recompute else ""
        hits = ("mlx_paged_kv_disk_hit_tokens_total", "mlx_paged_kv_disk_preload_hits_total")
        disk = ", ".join(f"{k[18:]}={after[k]:.0f}" for k in hits if k in after)
        load = "mlx_paged_kv_disk_load_seconds_total"
        restored = "mlx_paged_kv_disk_restored_tokens_total"
        if before.get(restored):
            disk += f", {before[restored]:.0f} tokens restored in {before[load]:.3f} s"
        if load in after:
            disk += f", the load {1e3 * (after[load] - before.get(load, 0.0)):.1f} ms"
        print(
            f"{name}: {seconds:.3f} s{ratio}, {cached} cached tokens, ready after "
            f"{self.ready_s:.1f} s; {disk}; {phases(before, after)}",
            flush=True,
        )
        return seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="model directory (default: the embedded one)")
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--restarts", type=int, default=2)
    ap.add_argument("--dir", default=None, help="the disk tier's directory (default: a temp one)")
    ap.add_argument("--kv-disk-preload-bytes", default=None, help="e.g. 2GB; also time a preload")
    ap.add_argument("--paged-args", default="", help="more mlx_paged.server flags, one string")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    args.model = args.model or str(embedded_model_path())
    vocab = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    rng = random.Random(args.seed)
    prompt, other = ([rng.randrange(1000, vocab - 1000) for _ in range(args.tokens)] for _ in "ab")
    tmp = None if args.dir else tempfile.mkdtemp(prefix="kvdisk-")
    disk = Path(args.dir or tmp)
    shutil.rmtree(disk, ignore_errors=True)
    disk.mkdir(parents=True)
    tier = ["--kv-disk-dir", str(disk)]
    try:
        base = Server(args, [])
        try:
            base.line("recompute, the process's first prompt", other, None)
            recompute = base.line("recompute", prompt, None)
            base.line("memory cache", prompt, recompute)
        finally:
            stop(base.proc)
        first = Server(args, tier)
        try:
            first.line("first server with the disk tier", prompt, recompute)
        finally:
            stop(first.proc)  # its shutdown writes the cached blocks
        size = sum(f.stat().st_size for f in disk.rglob("*") if f.is_file())
        print(f"the disk tier holds {size / 1e9:.2f} GB", flush=True)
        preload = args.kv_disk_preload_bytes
        kinds = [("plain", [])]
        if preload:
            flag = ["--kv-disk-preload-bytes", preload]
            kinds.append((f"preloaded {preload}", [*flag, "--no-kv-disk-restore"]))
            kinds.append((f"preloaded {preload} and restored", flag))
        for r in range(args.restarts):
            for name, extra in kinds:
                server = Server(args, [*tier, *extra])
                try:
                    server.line(f"restart {r + 1}, {name}", prompt, recompute)
                finally:
                    server.proc.kill()
                    server.proc.wait()
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
