"""Structured output under load: does a JSON schema on some requests slow or change the rest?

One ``mlx_paged.server`` process; an async ``openai`` client streams greedy chat
completions, ``--concurrency`` at once, ``--max-tokens`` each, every prompt
unique. After a warm-up pass over the same prompts (so every phase finds them in
the prefix index alike), phases alternate ``--rounds`` times:

- ``free``: every request unconstrained;
- ``mixed``: the same requests, with ``--constrained`` of them under a
  ``json_schema`` ``response_format`` (``--schema``: ``notes`` cannot be
  finished within ``max_tokens``, so both phases generate the same tokens;
  ``person`` is a realistic schema that ends early, checked for validity).

One line per phase: output tokens/s and wall time; then mixed / free tokens/s,
whether each unconstrained request's text in ``mixed`` equals its text in
``free``, and how many constrained outputs parse and validate.

    python benchmarks/structured.py --model /root/rnd              # on the GPU
    python benchmarks/structured.py --concurrency 4 --constrained 1 --max-tokens 8  # CPU
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time

import openai
from server import free_port, start, stop

from mlx_paged.embedded import embedded_model_path

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "pattern": "^[a-z]{1,12}@[a-z]{1,12}\\.(com|org)$"},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 6},
        "bio": {"type": "string", "maxLength": 200},
    },
    "required": ["name", "age", "email", "tags", "bio"],
    "additionalProperties": False,
}
# Too long for any max_tokens used here: constrained requests generate as many tokens as the
# others, so the phases' token counts match and tokens/s compares the same work.
NOTES = {
    "type": "object",
    "properties": {
        "notes": {"type": "array", "items": {"type": "string", "maxLength": 40}, "minItems": 400}
    },
    "required": ["notes"],
}
SCHEMAS = {"person": SCHEMA, "notes": NOTES}


def valid(text: str) -> bool:
    """Whether ``text`` is a JSON document that ``SCHEMA`` accepts (checked by hand)."""
    try:
        v = json.loads(text)
    except json.JSONDecodeError:
        return False
    return (
        isinstance(v, dict)
        and set(v) == set(SCHEMA["required"])
        and isinstance(v["name"], str)
        and len(v["name"]) <= 40
        and isinstance(v["age"], int)
        and 0 <= v["age"] <= 150
        and isinstance(v["email"], str)
        and all(t in ("red", "green", "blue") for t in v["tags"])
        and len(v["tags"]) <= 6
        and isinstance(v["bio"], str)
        and len(v["bio"]) <= 200
    )


async def one(client, prompt: str, max_tokens: int, schema: str | None) -> tuple[str, int, str]:
    """(text, output tokens, finish reason) of one streamed chat completion."""
    extra = {}
    if schema is not None:
        fmt = {"type": "json_schema", "json_schema": {"name": schema, "schema": SCHEMAS[schema]}}
        extra = {"response_format": fmt}
    stream = await client.chat.completions.create(
        model=client.model_id,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=max_tokens,
        temperature=0.0,
        stream=True,
        stream_options={"include_usage": True},
        **extra,
    )
    text, tokens, finish = "", 0, ""
    async for chunk in stream:
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return text, tokens, finish


async def phase(client, prompts, constrained: set[int], args) -> tuple[float, list]:
    gate = asyncio.Semaphore(args.concurrency)

    async def run(i: int):
        async with gate:
            schema = args.schema if i in constrained else None
            return await one(client, prompts[i], args.max_tokens, schema)

    t = time.perf_counter()
    results = await asyncio.gather(*(run(i) for i in range(len(prompts))))
    return time.perf_counter() - t, results


async def bench(port: int, model_id: str, prompts: list[str], args) -> None:
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", timeout=3600)
    client.model_id = model_id
    # Every args.concurrency / args.constrained-th request is constrained.
    step = max(1, args.concurrency // max(1, args.constrained))
    constrained = set(range(0, len(prompts), step)) if args.constrained else set()
    await phase(client, prompts, set(), args)  # warm-up: prompts cached, kernels built
    await phase(client, prompts[: args.concurrency], constrained, args)  # grammars' first use
    rates: dict[str, list[float]] = {"free": [], "mixed": []}
    texts: dict[str, list] = {}
    for r in range(args.rounds):
        for name, which in (("free", set()), ("mixed", constrained)):
            wall, res = await phase(client, prompts, which, args)
            out = sum(t for _, t, _ in res)
            rates[name].append(out / wall)
            texts.setdefault(name, res)
            print(
                f"round {r} {name:5s}: {out / wall:8.1f} out tok/s, wall {wall:6.2f}s, "
                f"{out} tokens",
                flush=True,
            )
    free, mixed = statistics.median(rates["free"]), statistics.median(rates["mixed"])
    same = [
        texts["mixed"][i][0] == texts["free"][i][0]
        for i in range(len(prompts))
        if i not in constrained
    ]
    done = [texts["mixed"][i] for i in sorted(constrained)]
    stopped = [t for t, _, f in done if f == "stop"]
    print(
        f"mixed / free tokens/s: {mixed / free:.3f} (medians of {args.rounds} rounds); "
        f"unconstrained texts identical: {sum(same)}/{len(same)}; constrained: "
        f"{len(stopped)}/{len(done)} finished, "
        f"{sum(map(valid, stopped)) if args.schema == 'person' else 'n/a'} of those valid, "
        f"{len(done) - len(stopped)} cut off by max_tokens",
        flush=True,
    )
    await client.close()


class Timed:
    """A constraint that adds the host time of its ``fill`` and ``accept`` to ``spent``."""

    def __init__(self, inner, spent: dict[str, float]):
        self.inner, self.spent = inner, spent

    def fill(self, row) -> None:
        t = time.perf_counter()
        self.inner.fill(row)
        self.spent["fill"] += time.perf_counter() - t

    def accept(self, token: int) -> bool:
        t = time.perf_counter()
        ok = self.inner.accept(token)
        self.spent["accept"] += time.perf_counter() - t
        return ok

    @staticmethod
    def fill_many(constraints: list[Timed], rows) -> None:
        t = time.perf_counter()
        type(constraints[0].inner).fill_many([c.inner for c in constraints], rows)
        constraints[0].spent["fill"] += time.perf_counter() - t


def in_process(model_dir: str, prompts: list[str], args) -> None:
    """The same comparison inside one ``PagedEngine`` (no HTTP, so admissions and batches
    are the same in both phases): ms per decode step, the constraints' own host time per
    step (on the background thread), and whether the unconstrained tokens are identical."""
    import mlx.core as mx

    from mlx_paged import PagedEngine
    from mlx_paged.embedded import load_model
    from mlx_paged.server.grammar import Grammars

    model, tokenizer = load_model(model_dir)
    engine = PagedEngine(model, max_batch_size=args.concurrency)
    make = Grammars(tokenizer, engine.vocab_size).compile(SCHEMAS[args.schema])
    tokens = [tokenizer.encode(p) for p in prompts]
    step = max(1, args.concurrency // max(1, args.constrained))
    per_step: dict[str, list[float]] = {"free": [], "mixed": []}
    for r in range(args.rounds + 1):  # round 0 warms up
        outputs = {}
        for name, k in (("free", 0), ("mixed", args.constrained)):
            spent = {"fill": 0.0, "accept": 0.0}
            uids = []
            for i, t in enumerate(tokens):
                c = Timed(make(), spent) if k and i % step == 0 else None
                uids.append(engine.add_request(t, args.max_tokens, constraint=c))
            out = {uid: [] for uid in uids}
            for event in engine.step():  # admission, prefill and the first decode
                out[event.uid].append(event.token)
            mx.synchronize()
            t0, steps = time.perf_counter(), 0
            while engine.running:
                for event in engine.step():
                    out[event.uid].append(event.token)
                steps += 1
            ms = (time.perf_counter() - t0) / steps * 1e3
            outputs[name] = [out[uid] for uid in uids]
            if r:
                per_step[name].append(ms)
                print(
                    f"in process round {r} {name:5s}: {ms:6.2f} ms/step over {steps} steps; "
                    f"fill {spent['fill'] / steps * 1e3:.3f} ms/step, "
                    f"accept {spent['accept'] / steps * 1e3:.3f} ms/step",
                    flush=True,
                )
        free = [i for i in range(len(tokens)) if i % step or not args.constrained]
        same = sum(outputs["free"][i] == outputs["mixed"][i] for i in free)
        print(f"in process round {r}: unconstrained tokens identical {same}/{len(free)}")
    free, mixed = statistics.median(per_step["free"]), statistics.median(per_step["mixed"])
    print(f"in process: free / mixed step time {free / mixed:.3f} (medians of {args.rounds})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="mlx-lm model directory (default: embedded)")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--constrained", type=int, default=8, help="requests with a json_schema")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--in-process", action="store_true", help="PagedEngine only, no server")
    ap.add_argument(
        "--schema",
        choices=sorted(SCHEMAS),
        default="notes",
        help="notes: never done within max_tokens (same tokens as free); person: finishes",
    )
    args = ap.parse_args()
    model = args.model or str(embedded_model_path())
    prompts = [
        f"Request {i}: write a short profile of person number {i} as JSON, "
        f"with a name, an age, an email, some colour tags and a bio."
        for i in range(args.concurrency)
    ]
    print(
        f"model {os.path.basename(model)}, {args.concurrency} streams, {args.constrained} "
        f"with the json_schema {args.schema!r}, max_tokens {args.max_tokens}",
        flush=True,
    )
    if args.in_process:
        in_process(model, prompts, args)
        return
    port = free_port()
    proc = start("mlx_paged", model, port, argparse.Namespace(concurrency=[args.concurrency]))
    try:
        asyncio.run(bench(port, model, prompts, args))
    finally:
        stop(proc)


if __name__ == "__main__":
    main()
