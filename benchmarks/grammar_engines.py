"""llguidance against xgrammar on the work structured output does per request.

For each engine and JSON schema: the one-off tokenizer setup, the schema's
compile time (what a request waits for before its first token), and the
per-token mask time while a valid document is fed token by token (what each
constrained request adds to a decode step). Host-only work, no model: the
numbers hold for any backend. Either engine may be missing; its rows say so.

    python benchmarks/grammar_engines.py --tokenizer PATH  # e.g. the embedded model's folder
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
from transformers import AutoTokenizer

SCHEMAS = {
    "flat": {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
    },
    "nested": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer"},
                    "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.com$"},
                    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}},
                },
                "required": ["id", "email", "tags"],
            },
            "scores": {"type": "array", "items": {"type": "number"}},
            "active": {"type": "boolean"},
        },
        "required": ["user", "scores", "active"],
    },
}
DOCS = {
    "flat": {"name": "Ada Lovelace, mathematician and writer", "age": 36},
    "nested": {
        "user": {"id": 1234, "email": "ada@example.com", "tags": ["a", "c", "b", "a"]},
        "scores": [1.5, 2.25, 3.0, 10.125, 7.5],
        "active": True,
    },
}


def stats(seconds: list[float]) -> str:
    us = np.array(seconds) * 1e6
    p50, p99 = np.percentile(us, [50, 99])
    return f"mean {us.mean():7.1f} us  p50 {p50:7.1f} us  p99 {p99:8.1f} us"


def run_llguidance(hf, vocab: int, eos: int) -> None:
    import llguidance
    import llguidance.hf
    from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

    t = time.perf_counter()
    tok = llguidance.hf.from_tokenizer(hf, n_vocab=vocab, eos_token=eos)
    print(f"llguidance {llguidance.__version__}: tokenizer setup {time.perf_counter() - t:.3f} s")
    for name, schema in SCHEMAS.items():
        t = time.perf_counter()
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema)
        matcher = llguidance.LLMatcher(tok, grammar, log_level=0)
        compile_s = time.perf_counter() - t
        mask = allocate_token_bitmask(1, vocab)
        times = []
        for token in hf.encode(json.dumps(DOCS[name]), add_special_tokens=False):
            t = time.perf_counter()
            fill_next_token_bitmask(matcher, mask)
            times.append(time.perf_counter() - t)
            assert matcher.consume_token(token), matcher.get_error()
        print(f"  {name:7s} compile {compile_s * 1e3:7.2f} ms  mask {stats(times)}")


def run_xgrammar(hf, vocab: int, eos: int) -> None:
    try:
        import xgrammar as xgr
    except ImportError as e:
        print(f"xgrammar: not importable here ({e})")
        return
    t = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab, stop_token_ids=[eos])
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    print(f"xgrammar: tokenizer setup {time.perf_counter() - t:.3f} s")
    for name, schema in SCHEMAS.items():
        t = time.perf_counter()
        compiled = compiler.compile_json_schema(json.dumps(schema))
        matcher = xgr.GrammarMatcher(compiled)
        compile_s = time.perf_counter() - t
        mask = xgr.allocate_token_bitmask(1, vocab)
        times = []
        for token in hf.encode(json.dumps(DOCS[name]), add_special_tokens=False):
            t = time.perf_counter()
            matcher.fill_next_token_bitmask(mask)
            times.append(time.perf_counter() - t)
            assert matcher.accept_token(token)
        print(f"  {name:7s} compile {compile_s * 1e3:7.2f} ms  mask {stats(times)}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokenizer", required=True, help="A Hugging Face tokenizer directory.")
    args = p.parse_args()
    hf = AutoTokenizer.from_pretrained(args.tokenizer)
    vocab, eos = len(hf), hf.eos_token_id
    try:
        run_llguidance(hf, vocab, eos)
    except ImportError as e:
        print(f"llguidance: not importable here ({e})")
    run_xgrammar(hf, vocab, eos)


if __name__ == "__main__":
    main()
