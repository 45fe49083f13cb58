"""``mlx_lm.server`` against ``mlx_paged.server``: the same model and load, one after the other.

Each server runs as its own process on the same model directory (default: the
embedded SmolLM2, converted by ``mlx_paged.embedded``). An async ``openai``
client sends requests that share one system prompt of ``--system`` tokens and
end in a unique question of ``--question`` tokens, ``--max-tokens`` each,
greedy, streamed, with ``concurrency`` requests in flight. One line per
(server, concurrency): output tokens/s, time to first token p50/p99,
inter-token latency p50, and the server process's peak GPU memory (sampled
with nvidia-smi every 0.2 s; "n/a" where there is none) and what it holds at rest,
``REST_SECONDS`` after the level.

The client is ``benchmarks/clients.py``: by default one event loop for every stream, as
before; ``--client-processes P`` spreads each level's streams over P processes, as
separate users' clients would be. ``--servers null`` adds the null server, canned
chunks with no model, whose times are what the client and the HTTP stack take alone.

Usage:
    python benchmarks/server.py                                    # on the GPU
    python benchmarks/server.py --concurrency 2 --requests 4 --system 64 --max-tokens 8  # CPU
    python benchmarks/server.py --servers null mlx_lm mlx_paged --table --client-processes 4
    python benchmarks/server.py --servers mlx_paged --bursts --concurrency 32   # a fresh
        # server's first burst against its second (the client's connections opened first)
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

from clients import Clients, client, load, pct
from transformers import AutoTokenizer

from mlx_paged.embedded import embedded_model_path

#: Seconds after a level before the server's memory at rest is read: mlx_paged.server's
#: engine thread hands MLX's cached buffers back after half a second with nothing to do.
REST_SECONDS = 1.5
# mlx.launch, from this Python (its module runs nothing under ``python -m``).
LAUNCH = "import sys; from mlx._distributed_utils.launch import main; sys.exit(main())"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(kind: str, model: str, port: int, args: argparse.Namespace) -> subprocess.Popen:
    # Under MLX's launcher with --ranks N (--backend: ring, nccl, ...); rank 0 serves HTTP.
    launch = []
    if getattr(args, "ranks", 1) > 1:
        launch = [sys.executable, "-c", LAUNCH, "-n", str(args.ranks)]
        launch += ["--backend", args.backend, "--"]
    if kind == "null":  # canned chunks: the client's and HTTP's own time (clients.py)
        here = os.path.dirname(os.path.abspath(__file__))
        cmd = [sys.executable, os.path.join(here, "clients.py"), "--port", str(port)]
        cmd += ["--gap-ms", str(args.null_gap_ms)]
    elif kind == "mlx_lm":
        cmd = [
            *launch,
            sys.executable,
            "-m",
            "mlx_lm.server",
            "--model",
            model,
            "--port",
            str(port),
        ]
        cmd += ["--decode-concurrency", str(max(args.concurrency)), "--max-tokens", "4096"]
    else:
        server = ["-m", "mlx_paged.server"]
        if getattr(args, "timeline", None):  # the engine thread's timeline, written at exit
            os.makedirs(args.timeline, exist_ok=True)
            out = os.path.join(args.timeline, f"timeline-{port}.json")
            server = [os.path.join(os.path.dirname(__file__), "timeline.py"), out]
            if getattr(args, "timeline_stacks", None):
                server += ["--stacks", str(args.timeline_stacks)]
        cmd = [*launch, sys.executable, *server, "--model", model]
        cmd += ["--port", str(port), "--max-batch-size", str(max(args.concurrency))]
        cmd += ["--max-queue", "100000"]
        if getattr(args, "no_warm_up", False):
            cmd += ["--no-warm-up"]
        if getattr(args, "prefill_step_size", None):
            cmd += ["--prefill-step-size", str(args.prefill_step_size)]
        cmd += getattr(args, "paged_args", "").split()
    # The server's log goes to a file (a pipe nobody reads would fill and stall it).
    log = tempfile.TemporaryFile("w+")
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, text=True)
    deadline = time.time() + 300
    while time.time() < deadline:
        if proc.poll() is not None:
            log.seek(0)
            raise SystemExit(f"{kind} server exited: {log.read()[-2000:]}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2)
            log.seek(0)
            for line in log:
                if any(s in line for s in ("warmed up", "MLX keeps", "row-bucket")):
                    print(f"{kind}: {line.strip()}")
            return proc
        except OSError:
            time.sleep(1)
    proc.kill()
    raise SystemExit(f"{kind} server did not come up")


def stop(proc: subprocess.Popen) -> None:
    """End a server process: SIGTERM, then SIGKILL if it is still there after 30 s."""
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()


class GpuMemory:
    """Peak GPU memory of one process (``pid``; ``None``: the largest of any process, one
    per GPU under mlx.launch), sampled with nvidia-smi."""

    def __init__(self, pid: int | None):
        self.pid, self.peak, self._stop = pid, 0, threading.Event()
        self.available = shutil.which("nvidia-smi") is not None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> GpuMemory:
        if self.available:
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self.available:
            self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.now())
            time.sleep(0.2)

    def now(self) -> int:
        """MiB the process holds now (the largest process's under mlx.launch); 0 if none."""
        query = [
            "nvidia-smi",
            "--query-compute-apps=pid,used_memory",
            "--format=csv,noheader,nounits",
        ]
        out = subprocess.run(query, capture_output=True, text=True).stdout
        held = [0]
        for line in out.splitlines():
            pid, mib = (x.strip() for x in line.split(","))
            if self.pid is None or pid == str(self.pid):  # None: any process (per GPU)
                held.append(int(mib))
        return max(held)


def scrape(port: int) -> dict[str, float]:
    """The server's Prometheus samples by name and labels (``{}`` where it has none)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            text = r.read().decode()
    except OSError:
        return {}
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def breakdown(before: dict[str, float], after: dict[str, float]) -> str:
    """Where a level's time went, from two scrapes of mlx_paged.server's /metrics: host ms
    per decode step by phase, mean ms per request by first-token phase, and the share of
    prompt tokens the prefix index served."""
    if not after:
        return ""

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    def labelled(name: str, phase: str) -> float:
        return delta(name + '{phase="' + phase + '"}')

    steps = max(1.0, delta("mlx_paged_decode_steps_total"))
    phases = ("admit", "prefill", "build", "dispatch", "wait", "emit", "deliver")
    step = " ".join(
        f"{p} {1000 * labelled('mlx_paged_step_seconds_total', p) / steps:.2f}" for p in phases
    )
    n = max(1.0, delta("mlx_paged_time_to_first_token_seconds_count"))
    first = " ".join(
        f"{p} {1000 * labelled('mlx_paged_first_token_phase_seconds_sum', p) / n:.1f}"
        for p in ("prepare", "submit", "queue", "prefill", "deliver")
    )
    ttft = 1000 * delta("mlx_paged_time_to_first_token_seconds_sum") / n
    prompt = max(1.0, delta("mlx_paged_prompt_tokens_total"))
    cached = 100 * delta("mlx_paged_prefix_cache_hit_tokens_total") / prompt
    compiled = delta("mlx_paged_decode_steps_compiled_total")
    traced = delta("mlx_paged_decode_traces_total")
    return (
        f"    per decode step ({steps:.0f}; {compiled:.0f} compiled, {traced:.0f} new traces), "
        f"ms: {step}\n"
        f"    first token, mean ms: {first} (server TTFT {ttft:.1f}); "
        f"{cached:.1f} % of prompt tokens cached; kernel launch shapes "
        f"{after.get('mlx_paged_kernel_launch_shapes', 0):.0f}"
    )


async def level(
    clients: Clients | None, api, port: int, model: str, prompts, c, tokens, temp, timeout
):
    """``load`` from this loop's client ``api``, or spread over ``clients``' processes."""
    if clients is None:
        return await asyncio.wait_for(load(api, model, prompts, c, tokens, temp), timeout)
    return await asyncio.to_thread(clients.load, port, model, prompts, c, tokens, temp, timeout)


async def bench(
    kind: str, pid: int, port: int, model: str, prompts: list[str], args, requests, results: dict
):
    """Every concurrency level against one running server; one printed line each (and for
    mlx_paged.server, where the time went)."""
    api, clients = client(port), args.clients
    p = clients.processes if clients else 1
    held = GpuMemory(None if getattr(args, "ranks", 1) > 1 else pid)
    if held.available:
        print(f"{kind}: ready, holding {held.now()} MiB of GPU memory", flush=True)
    await level(clients, api, port, model, prompts[: 2 * p], p, 4, 0.0, None)  # warm-up
    for i, (c, n) in enumerate(zip(args.concurrency, requests, strict=True)):
        before = scrape(port) if kind == "mlx_paged" else {}
        with GpuMemory(None if getattr(args, "ranks", 1) > 1 else pid) as mem:
            try:
                wall, res = await level(
                    clients,
                    api,
                    port,
                    model,
                    prompts[:n],
                    c,
                    args.max_tokens,
                    args.temperature,
                    args.level_timeout,
                )
            except TimeoutError:
                print(f"{kind:9s} c={c:3d} n={n:4d}: timed out after {args.level_timeout} s")
                break
        after = scrape(port) if kind == "mlx_paged" else {}
        ttft = [r[0] for r in res]
        gaps = [g for r in res for g in r[1]]
        out = sum(r[2] for r in res)
        peak = f"{mem.peak} MiB" if mem.available else "n/a"
        if mem.available:  # what the idle server holds, once its engine thread has rested
            await asyncio.sleep(REST_SECONDS)
            peak += f", at rest {mem.now()} MiB"
        print(
            f"{kind:9s} c={c:3d} n={n:4d}: {out / wall:8.1f} out tok/s, "
            f"TTFT p50 {pct(ttft, 0.5):.3f}s p99 {pct(ttft, 0.99):.3f}s, "
            f"ITL p50 {1000 * pct(gaps, 0.5):.1f} ms, wall {wall:.1f}s, "
            f"{out} tokens, peak GPU {peak}",
            flush=True,
        )
        if after:
            print(breakdown(before, after), flush=True)
        results[(kind, i)] = out / wall
    await api.close()


async def connect(api, c: int) -> None:
    """Open ``c`` connections in the client's pool, one ``GET /v1/models`` each, all at once.

    The first burst otherwise opens its connections while it is timed, and on the null
    server alone that took its TTFT p50 from 0.034 s to 0.094-0.105 s (the second burst's
    to the first's, BENCHMARKS.md run 521): the client's and the HTTP stack's work, none of
    it the model's. A client that talks to a server keeps its connections open.
    """
    await asyncio.gather(*(api.models.list() for _ in range(c)))


async def bursts(kind: str, port: int, model: str, prompts: list[str], args, ready: float):
    """A fresh server's first burst of ``c`` requests at once, then a second one of other
    prompts: TTFT p50/p99 of each, and the time the server took to report ready. The
    one-loop client opens its ``c`` connections first (``connect``) unless
    ``--new-connections``; client processes open theirs in the first burst."""
    api, c = client(port), max(args.concurrency)
    if args.clients is None and not args.new_connections:
        await connect(api, c)
    for i in range(2):
        before = scrape(port) if kind == "mlx_paged" else {}
        burst = prompts[i * c : (i + 1) * c]
        wall, res = await level(
            args.clients, api, port, model, burst, c, args.max_tokens, 0.0, None
        )
        after = scrape(port) if kind == "mlx_paged" else {}
        ttft = [r[0] for r in res]
        print(
            f"{kind:9s} burst {i + 1} of {c}: TTFT p50 {pct(ttft, 0.5):.3f}s "
            f"p99 {pct(ttft, 0.99):.3f}s, wall {wall:.2f}s (ready after {ready:.1f}s)",
            flush=True,
        )
        if after:
            blocks = after.get("mlx_paged_kv_blocks_total", 0)
            print(f"{breakdown(before, after)}; pool {blocks:.0f} blocks", flush=True)
    await api.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="mlx-lm model directory (default: embedded)")
    ap.add_argument(
        "--servers",
        nargs="+",
        default=["mlx_lm", "mlx_paged"],
        choices=["mlx_lm", "mlx_paged", "null"],
        help="null: canned chunks (benchmarks/clients.py), the client and HTTP stack's own time",
    )
    ap.add_argument(
        "--client-processes",
        type=int,
        default=1,
        help="spread each level's streams over this many client processes",
    )
    ap.add_argument("--null-gap-ms", type=float, default=8.0, help="the null server's chunk gap")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument(
        "--requests",
        type=int,
        nargs="+",
        default=None,
        help="requests per concurrency level (default: 16 at 1, else 256)",
    )
    ap.add_argument("--system", type=int, default=1024, help="shared system prompt tokens")
    ap.add_argument("--question", type=int, default=64, help="unique question tokens")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    ap.add_argument("--ranks", type=int, default=1, help="processes under mlx.launch")
    ap.add_argument(
        "--bursts", action="store_true", help="fresh servers: a first and a second burst"
    )
    ap.add_argument(
        "--new-connections",
        action="store_true",
        help="with --bursts: the first burst opens the client's connections while it is timed",
    )
    ap.add_argument("--no-warm-up", action="store_true", help="mlx_paged.server --no-warm-up")
    ap.add_argument("--prefill-step-size", type=int, help="mlx_paged.server's (default: its own)")
    ap.add_argument(
        "--paged-args", default="", help="more mlx_paged.server flags, e.g. '--kv-memory 4GB'"
    )
    ap.add_argument(
        "--table",
        action="store_true",
        help="2c requests at each concurrency c, and each level's tok/s against the first server's",
    )
    ap.add_argument("--backend", default="nccl", help="mlx.launch's backend with --ranks")
    ap.add_argument(
        "--timeline",
        metavar="DIR",
        help="record the paged server's engine thread (benchmarks/timeline.py) into DIR",
    )
    ap.add_argument(
        "--timeline-stacks",
        type=float,
        metavar="MS",
        help="with --timeline: also sample every thread's stack each MS milliseconds",
    )
    ap.add_argument(
        "--level-timeout", type=float, default=300, help="seconds a concurrency level may take"
    )
    args = ap.parse_args()
    model = args.model or str(embedded_model_path())
    requests = args.requests or [16 if c == 1 else 256 for c in args.concurrency]
    if args.table:  # the serving-speed table: 2c requests at each concurrency c
        requests = [2 * c for c in args.concurrency]
    tok = AutoTokenizer.from_pretrained(model)
    rng = random.Random(0)
    words = sorted(w for w in tok.get_vocab() if w.isalpha() and len(w) > 3)

    def text(n: int) -> str:
        out: list[str] = []
        while len(tok.encode(" ".join(out))) < n:
            out.append(rng.choice(words))
        return " ".join(out)

    system = text(args.system)
    n_max = max(requests)
    prompts = [f"{system}\nQuestion {i}: {text(args.question)}\nAnswer:" for i in range(n_max)]
    print(
        f"model {os.path.basename(model)}, system {len(tok.encode(system))} tokens, "
        f"question ~{args.question}, max_tokens {args.max_tokens}",
        flush=True,
    )
    results: dict[tuple[str, int], float] = {}  # (server, level) -> tok/s
    args.clients = Clients(args.client_processes) if args.client_processes > 1 else None
    try:
        for kind in args.servers:
            port = free_port()
            t0 = time.perf_counter()
            proc = start(kind, model, port, args)
            try:
                if args.bursts:
                    ready = time.perf_counter() - t0
                    asyncio.run(bursts(kind, port, model, prompts, args, ready))
                    continue
                asyncio.run(bench(kind, proc.pid, port, model, prompts, args, requests, results))
            finally:
                stop(proc)
    finally:
        if args.clients:
            args.clients.close()

    servers = [kind for kind in args.servers if kind != "null"]  # ratios of real servers
    base = servers[0] if servers else None
    for kind in servers[1:]:
        for level, c in enumerate(args.concurrency):  # a level given twice: its own ratio
            if (base, level) in results and (kind, level) in results:
                ratio = results[(kind, level)] / results[(base, level)]
                print(f"{kind} / {base} c={c} (level {level + 1}): {ratio:.2f}x tok/s")


if __name__ == "__main__":
    main()
