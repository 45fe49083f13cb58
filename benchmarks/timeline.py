"""The engine thread's timeline in a served process: steps, prefill forwards, hand-overs.

    python benchmarks/timeline.py OUT.json [--stacks MS] [mlx_paged.server flags]  # serve
    python benchmarks/timeline.py --show OUT.json [--rows 4]          # what it recorded
    python benchmarks/timeline.py --show OUT.json --window 8700 8900  # every event in a span

Recording runs ``mlx_paged.server`` with the engine's steps, its prefill forwards
(batched and alone), each job's hand-over to the engine thread (``submit``, then
``add``) and each request's first token wrapped to note when they start and end,
and writes the events to ``OUT.json`` when the server exits (SIGINT or SIGTERM).
With ``--stacks MS`` it also samples every thread's Python stack each ``MS``
milliseconds and keeps each change, so a window can say where each thread spent it.
``benchmarks/server.py --timeline DIR`` starts the paged server this way.

``--show`` prints how long jobs waited to be handed over, then every prefill
forward of at least ``--rows`` requests: when it started (ms from the first
event), how long it took, its rows and tokens per row, and whether the process
had run that shape before. ``--window FROM_MS TO_MS`` prints every event of that span
instead (steps with their running and waiting requests, forwards, and runs of
hand-overs and first tokens), in ms from ``FROM_MS``: one wave of a served level. With
stacks recorded, it then gives each thread's time in that span by innermost frames.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import sys
import threading
import time
from collections import defaultdict

#: Frames kept of each sampled stack, innermost first.
STACK_DEPTH = 16


def record(path: str) -> None:
    """Wrap the engine thread's calls; write the events to ``path`` at exit."""
    from mlx_paged.engine.engine import PagedEngine
    from mlx_paged.engine.runner import ModelRunner
    from mlx_paged.server.worker import EngineWorker

    events: list[list] = []
    now = time.perf_counter
    step, forward, prefill = PagedEngine.step, ModelRunner.forward, ModelRunner.prefill
    submit, add, on_event = EngineWorker.submit, EngineWorker._add, EngineWorker._on_event
    seen: set[int] = set()

    def timed_step(self, *args, **kwargs):
        t, running, waiting = now(), len(self.running), len(self.waiting)
        out = step(self, *args, **kwargs)
        events.append(["step", t, now(), running, waiting])
        return out

    def timed_forward(self, reqs, n, *args, **kwargs):
        t = now()
        out = forward(self, reqs, n, *args, **kwargs)
        events.append(["forward", t, now(), len(reqs), n])
        return out

    def timed_prefill(self, req, n, logits=False):
        t = now()
        out = prefill(self, req, n, logits)
        events.append(["alone", t, now(), 1, n])
        return out

    def timed_submit(self, job):
        events.append(["submit", now(), id(job)])
        return submit(self, job)

    def timed_add(self, job):
        events.append(["add", now(), id(job)])
        return add(self, job)

    def timed_event(self, event):
        if event.uid not in seen:
            seen.add(event.uid)
            events.append(["first", now(), event.uid])
        return on_event(self, event)

    PagedEngine.step, ModelRunner.forward, ModelRunner.prefill = (
        timed_step,
        timed_forward,
        timed_prefill,
    )
    EngineWorker.submit, EngineWorker._add, EngineWorker._on_event = (
        timed_submit,
        timed_add,
        timed_event,
    )

    def write() -> None:
        with open(path, "w") as f:
            json.dump(events, f)

    atexit.register(write)
    return events


def sample_stacks(events: list[list], every_ms: float) -> None:
    """Sample every other thread's stack each ``every_ms`` on a daemon thread, appending
    ``["stack", t, thread, frames]`` to ``events`` whenever a thread's stack changed."""
    me_name, last = "timeline-stacks", {}

    def frames(frame) -> str:
        out = []
        while frame is not None and len(out) < STACK_DEPTH:
            code = frame.f_code
            out.append(f"{os.path.basename(code.co_filename)}:{frame.f_lineno} {code.co_name}")
            frame = frame.f_back
        return " < ".join(out)

    def run() -> None:
        while True:
            t = time.perf_counter()
            names = {th.ident: th.name for th in threading.enumerate()}
            for ident, frame in sys._current_frames().items():
                name = names.get(ident, str(ident))
                if name == me_name:
                    continue
                stack = frames(frame)
                if last.get(name) != stack:
                    last[name] = stack
                    events.append(["stack", t, name, stack])
            time.sleep(every_ms / 1e3)

    threading.Thread(target=run, name=me_name, daemon=True).start()


def stacks_in(events: list[list], base: float, end: float) -> None:
    """Print, per thread, the time from ``base`` to ``end`` (seconds) under each sampled
    stack, longest first (a stack holds from its sample until the thread's next one)."""
    by_thread: dict[str, list[list]] = defaultdict(list)
    for e in events:
        if e[0] == "stack":
            by_thread[e[2]].append(e)
    for name, samples in sorted(by_thread.items()):
        spent: dict[str, float] = defaultdict(float)
        for here, after in zip(samples, [*samples[1:], None], strict=True):
            start, stop = here[1], after[1] if after else end
            spent[here[3]] += max(0.0, min(stop, end) - max(start, base))
        top = sorted(((t, s) for s, t in spent.items() if t > 0), reverse=True)[:6]
        if top:
            print(f"thread {name}:")
            for t, s in top:
                print(f"  {1e3 * t:9.1f} ms  {s}")


def show(path: str, rows: int) -> None:
    """Print the hand-over waits and the prefill forwards of at least ``rows`` requests."""
    with open(path) as f:
        events = sorted((e for e in json.load(f) if e[0] != "stack"), key=lambda e: e[1])
    if not events:
        print("no events")
        return
    t0 = events[0][1]
    submitted = {e[2]: e[1] for e in events if e[0] == "submit"}
    waits = sorted(1e3 * (e[1] - submitted[e[2]]) for e in events if e[0] == "add")
    if waits:
        p50, worst = waits[len(waits) // 2], waits[-1]
        print(f"{len(waits)} jobs handed over: wait p50 {p50:.1f} ms, max {worst:.1f} ms")
    shapes: set[tuple] = set()
    for kind, start, end, *shape in (e for e in events if e[0] in ("forward", "alone")):
        new = (kind, *shape) not in shapes
        shapes.add((kind, *shape))
        if shape[0] >= rows:
            took = 1e3 * (end - start)
            print(
                f"{1e3 * (start - t0):10.1f} ms  {kind:7s} {shape[0]:3d} x {shape[1]:5d}  "
                f"{took:7.1f} ms{'  (new shape)' if new else ''}"
            )


def window(path: str, start_ms: float, end_ms: float) -> None:
    """Print every event from ``start_ms`` to ``end_ms`` (ms from the first event), in ms
    from ``start_ms``; a run of hand-overs or first tokens on one line."""
    with open(path) as f:
        everything = sorted(json.load(f), key=lambda e: e[1])
    events = [e for e in everything if e[0] != "stack"]
    if not events:
        print("no events")
        return
    base = events[0][1] + start_ms / 1e3
    rows = [e for e in events if 0 <= e[1] - base <= (end_ms - start_ms) / 1e3]
    i = 0
    while i < len(rows):
        kind, at = rows[i][0], 1e3 * (rows[i][1] - base)
        if kind in ("submit", "add", "first"):
            j = i
            while j + 1 < len(rows) and rows[j + 1][0] == kind:
                j += 1
            n, last = j - i + 1, 1e3 * (rows[j][1] - base)
            span = f"{at:.1f}" if n == 1 else f"{at:.1f}-{last:.1f}"
            print(f"{span:>15} ms  {n} {kind}")
            i = j + 1
            continue
        took = 1e3 * (rows[i][2] - rows[i][1])
        if kind == "step":
            what = f"step: {rows[i][3]} running, {rows[i][4]} waiting"
        else:
            what = f"{kind}: {rows[i][3]} x {rows[i][4]} tokens"
        print(f"{at:15.1f} ms  {what}, {took:.1f} ms")
        i += 1
    stacks_in(everything, base, base + (end_ms - start_ms) / 1e3)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--show":
        ap = argparse.ArgumentParser(description="Show a recorded timeline.")
        ap.add_argument("--show", required=True, metavar="OUT.json")
        ap.add_argument("--rows", type=int, default=4, help="forwards of at least this many")
        ap.add_argument(
            "--window",
            type=float,
            nargs=2,
            metavar=("FROM_MS", "TO_MS"),
            help="instead, every event in this span (ms from the first event)",
        )
        args = ap.parse_args()
        if args.window:
            window(args.show, *args.window)
        else:
            show(args.show, args.rows)
        return
    if len(sys.argv) < 2 or sys.argv[1].startswith("-"):  # --help, or no OUT.json first
        raise SystemExit(__doc__)
    events, flags = record(sys.argv[1]), sys.argv[2:]
    if flags[:1] == ["--stacks"]:
        if len(flags) < 2:
            raise SystemExit("--stacks needs a sampling period in milliseconds")
        sample_stacks(events, float(flags[1]))
        flags = flags[2:]
    from mlx_paged.server import main as serve

    serve(flags)


if __name__ == "__main__":
    main()
