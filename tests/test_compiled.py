"""The engine's compiled decode step (``engine/compiled.py``) against the uncompiled one and
mlx-lm alone: the same tokens, one trace per step shape, and the models it leaves alone."""

from __future__ import annotations

import io
import random
from collections import Counter

import mlx.core as mx
import pytest
from scripted import Scripted
from tiny_models import VOCAB, model_of, tiny_model
from tiny_models import solo as dense_solo

from mlx_paged import PagedEngine
from mlx_paged.attention import path_counts
from mlx_paged.cache import DecodeBatch
from mlx_paged.engine.compiled import batch_bucket, width_bucket

BS = 8
MAX_TOKENS = 12
# gemma3_text: sliding-window layers beside full ones (two pools); deepseek_v3: MLA latents
FAMILIES = ["llama", "gemma3_text", "deepseek_v3"]
# recurrent layers beside attention (qwen3_5, lfm2, nemotron_h) or alone (mamba2)
HYBRIDS = ["qwen3_5", "mamba2", "lfm2", "nemotron_h"]


def prompts(seed: int, n: int) -> list[list[int]]:
    rng = random.Random(seed)
    system = [rng.randrange(VOCAB) for _ in range(20)]
    return [system + [rng.randrange(VOCAB) for _ in range(3 + 5 * i)] for i in range(n)]


def run(engine: PagedEngine, batch: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
    uids = [engine.add_request(p, m) for p, m in zip(batch, max_tokens, strict=True)]
    out: dict[int, list[int]] = {u: [] for u in uids}
    for event in engine.stream():
        out[event.uid].append(event.token)
        engine.check_invariants()
    return [out[u] for u in uids]


@pytest.mark.parametrize("family", FAMILIES + HYBRIDS)
def test_compiled_steps_give_the_tokens_of_uncompiled_ones_and_of_mlx_lm(family):
    """Requests of staggered lengths and budgets, so the batch shrinks and the block tables
    widen as they decode: every request gets mlx-lm's own tokens, with or without the
    compiled step; the compiled engine traced once per step shape it met. A hybrid's steps
    read its state arrays as they are while its requests hold slots 0 .. B-1 (B a row
    bucket), and gather their slots otherwise: padded to a bucket with the last row's
    slot, or once the second request (slot 1) stops before the third."""
    batch, budgets = prompts(1, 4), [MAX_TOKENS, 5, 9, 3]
    compiled = PagedEngine(model_of(family), block_size=BS, compile_decode=True)
    plain = PagedEngine(model_of(family), block_size=BS, compile_decode=False)
    assert compiled.runner.compiled is not None and plain.runner.compiled is None
    shapes, slots = record_shapes(compiled)
    got = run(compiled, batch, budgets)
    assert got == run(plain, batch, budgets)
    assert got == [dense_solo(family, tuple(p), m) for p, m in zip(batch, budgets, strict=True)]
    assert len(shapes) == compiled.clock.decode_steps  # every step went through it
    assert compiled.runner.compiled.traces == len(set(shapes)) > 1
    if family in HYBRIDS:  # slots 0-3; 0-2 padded to 4 rows; 0 and 2; 0
        assert [s[0][0][0] for s in shapes] == [4, 4, 4, 4, 2, 2, 2, 2, 1, 1, 1]
        assert slots == [None] * 2 + [[0, 1, 2, 2]] * 2 + [[0, 2]] * 4 + [None] * 3


@pytest.mark.parametrize("family", HYBRIDS)
def test_a_hybrid_whose_requests_stop_last_slot_first_compiles_every_step(family):
    """Budgets that end the requests in reverse slot order keep the running ones in slots
    0 .. B-1: every step of 4, 2 or 1 rows reads and replaces the first rows of the state
    arrays with no gather; 3 rows pad to 4 with the last row's slot, gathered."""
    batch, budgets = prompts(2, 4), [MAX_TOKENS, 9, 5, 3]
    compiled = PagedEngine(model_of(family), block_size=BS, compile_decode=True)
    shapes, slots = record_shapes(compiled)
    got = run(compiled, batch, budgets)
    assert got == [dense_solo(family, tuple(p), m) for p, m in zip(batch, budgets, strict=True)]
    assert len(shapes) == compiled.clock.decode_steps
    assert [s[0][0][0] for s in shapes] == [4, 4, 4, 4, 2, 2, 2, 2, 1, 1, 1]
    assert slots == [None] * 2 + [[0, 1, 2, 2]] * 2 + [None] * 7


@pytest.mark.gpu
@pytest.mark.skipif(not mx.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_compiled_steps_on_the_gpu_give_the_uncompiled_tokens(family):
    """The compiled step over the fused CUDA kernels, against the same engine uncompiled on
    the same GPU; the 300-token prompt's steps split their keys (split-K), whose counters
    every layer's launch shares in a compiled graph."""
    rng = random.Random(5)
    batch = [*prompts(3, 4), [rng.randrange(VOCAB) for _ in range(300)]]
    budgets = [MAX_TOKENS, 5, 9, 3, 20]
    compiled = PagedEngine(model_of(family), block_size=BS, compile_decode=True)
    plain = PagedEngine(model_of(family), block_size=BS, compile_decode=False)
    shapes, _ = record_shapes(compiled)
    assert run(compiled, batch, budgets) == run(plain, batch, budgets)
    assert compiled.runner.compiled.traces == len(set(shapes)) > 1


def record_shapes(engine: PagedEngine) -> tuple[list[tuple], list[list[int] | None]]:
    """Record, per compiled step, what its trace is keyed by (the shapes and dtypes of its
    arguments and of the pool arrays, then whether each layer group's tables hold cold
    blocks), and the state slots it gathered (``None``: the first rows of a hybrid's state
    arrays, or no state)."""
    decode, pools = engine.runner.compiled, engine.runner.pools.values()
    forward, shapes, slots = decode._forward, [], []

    def recorded(cold, *args):
        gathered = len(args) > 1 + DecodeBatch.STEP_ARRAYS * len(decode.kinds)
        slots.append(args[-1].tolist() if gathered else None)
        arrays = [a for pool in pools for a in (*pool.keys, *pool.values)]
        state = [a.shape for a in arrays if a is not None]  # mamba2 has no attention
        if engine.runner.states is not None:
            state += [a.shape for layer in engine.runner.states.arrays for a in layer]
        colds = [p.cold for p in pools if p.cold is not None]  # a cold tier grows too
        state += [a.shape for c in colds for a in c.blobs]
        shapes.append((*[(a.shape, a.dtype) for a in args], *state, cold))
        return forward(cold, *args)

    decode._forward = recorded
    return shapes, slots


def test_a_steady_batch_replays_without_tracing_again():
    """Steps of one batch whose tables stay within one width bucket, in a pool of fixed
    size (a growing pool's new arrays are a new shape), trace nothing new."""
    engine = PagedEngine(model_of("llama"), block_size=BS, num_blocks=64, compile_decode=True)
    for p in prompts(2, 3):
        engine.add_request(p, 40)
    for _ in range(6):
        engine.step()
    traces = engine.runner.compiled.traces
    for _ in range(8):  # 3 rows, tables of 5-8 blocks: one width bucket
        engine.step()
    assert engine.runner.compiled.traces == traces
    assert len(engine.running) == 3


def test_a_compiled_steps_tables_and_write_positions_hold_no_ops():
    """The block tables and write positions a compiled step takes are arrays made on the
    host, padded to the width bucket there: a pad, or write slots worked out by ops before
    the trace, would add to every step's graph and launches."""
    engine = PagedEngine(model_of("llama"), block_size=BS, num_blocks=64, compile_decode=True)
    decode = engine.runner.compiled
    forward, seen = decode._forward, []

    def recorded(cold, tokens, *arrays):
        dots = [io.StringIO() for _ in arrays]
        for dot, a in zip(dots, arrays, strict=True):
            mx.export_to_dot(dot, a)
        blocks = max(len(t.blocks) for r in engine.running for t in r.tables.values())
        seen.append((sum(d.getvalue().count("label =") for d in dots), arrays[0].shape[1], blocks))
        return forward(cold, tokens, *arrays)

    decode._forward = recorded
    run(engine, prompts(3, 2), [MAX_TOKENS, 6])  # tables of 3-5 blocks, width buckets 4 and 8
    assert seen and [ops for ops, _, _ in seen] == [0] * len(seen)
    assert any(width > blocks for _, width, blocks in seen), seen  # some tables were padded


def test_a_shrinking_batch_traces_once_per_row_bucket():
    """Seven requests that stop one after another decode at every size from 7 to 1, within
    one width bucket: sizes 7, 6, 5 pad to 8 rows, 4 and 3 to 4, then 2 and 1. The padded
    rows change nobody's tokens (the parity tests above) and advance no table."""
    engine = PagedEngine(model_of("llama"), block_size=BS, num_blocks=64, compile_decode=True)
    shapes, _ = record_shapes(engine)
    rng = random.Random(4)
    system = [rng.randrange(VOCAB) for _ in range(12)]  # 17 tokens, 25 at the end: 3-4 blocks
    batch = [system + [rng.randrange(VOCAB) for _ in range(5)] for _ in range(7)]
    budgets = list(range(2, 9))  # request i decodes i + 1 steps after its prefill's token
    got = run(engine, batch, budgets)
    assert [len(t) for t in got] == budgets
    assert [s[0][0][0] for s in shapes] == [8, 8, 8, 4, 4, 2, 1]
    assert {s[1][0][1] for s in shapes} == {4}  # the tables' width bucket
    assert engine.runner.compiled.traces == 4
    assert not engine.running
    engine.check_invariants()


def test_replayed_steps_count_their_attention_paths():
    """``path_counts`` (the attention path each layer call took) reads the same with the
    compiled step, whose Python runs only when it traces, as without it."""
    counted = []
    for compiled in (True, False):
        engine = PagedEngine(model_of("llama"), block_size=BS, compile_decode=compiled)
        before = Counter(path_counts)
        run(engine, prompts(1, 4), [MAX_TOKENS, 5, 9, 3])
        counted.append(path_counts - before)
    assert counted[0] == counted[1]
    assert (
        sum(counted[0].values())
        > engine.clock.decode_steps * model_of("llama").args.num_hidden_layers
    )


def test_row_and_width_buckets():
    rows = (1, 2, 3, 5, 8, 9, 16, 17, 64)
    assert [batch_bucket(b) for b in rows] == [1, 2, 4, 8, 8, 16, 16, 24, 64]
    assert [width_bucket(w) for w in (1, 3, 33, 64, 65, 129)] == [1, 4, 64, 64, 128, 192]


def test_a_forward_that_cannot_be_traced_decodes_uncompiled(caplog):
    """The scripted model reads its positions on the host, which a trace cannot: the first
    compiled step falls back, with one warning, and the tokens are the uncompiled ones."""
    tokens = []
    for compiled in (True, False):
        model = Scripted(VOCAB, eos=2)
        model.length, model.reply = 5, [7, 8, 9, 2]
        engine = PagedEngine(model, block_size=BS, compile_decode=compiled)
        with caplog.at_level("WARNING", logger="mlx_paged.engine"):
            tokens.append(run(engine, [[1, 3, 4, 5, 6], [1, 3, 4, 5, 6]], [4, 4]))
        assert engine.runner.compiled is None
    assert tokens[0] == tokens[1] == [[7, 8, 9, 2]] * 2
    warned = [r for r in caplog.records if "cannot be compiled" in r.getMessage()]
    assert len(warned) == 1


@pytest.mark.parametrize("bits", [4, 8])
def test_compiled_steps_over_the_cold_tier_give_the_uncompiled_tokens(bits):
    """Blocks behind a 16-token hot tail move to the cold tier as the requests decode: the
    steps whose tables hold cold blocks trace apart from the others and read both tiers
    (on the CPU through a plan made from the padded tables, against the host's plan of the
    uncompiled step), with the tokens of the uncompiled engine."""
    # 64 tokens move to the cold tier together once a request holds 80: the last one after
    # its 6th step, and every other request's blocks behind its hot tail with them.
    rng = random.Random(3)
    batch = [[rng.randrange(VOCAB) for _ in range(50 + 8 * i)] for i in range(4)]
    budgets = [2 * MAX_TOKENS, 5, 9, MAX_TOKENS]
    model = tiny_model("llama", head_dim=32)  # quantized in groups of 32
    engines = [
        PagedEngine(
            model, block_size=BS, kv_bits=bits, kv_group_size=32, hot_tokens=16, compile_decode=c
        )
        for c in (True, False)
    ]
    shapes, _ = record_shapes(engines[0])
    got = run(engines[0], batch, budgets)
    assert got == run(engines[1], batch, budgets)
    assert [len(t) for t in got] == budgets
    assert engines[0].stats().migrations == engines[1].stats().migrations > 0
    assert len(shapes) == engines[0].clock.decode_steps
    assert {s[-1] for s in shapes} == {(False,), (True,)}
    assert engines[0].runner.compiled.traces == len(set(shapes))


def test_on_unless_turned_off_by_argument_or_environment(monkeypatch):
    monkeypatch.delenv("MLX_PAGED_COMPILE", raising=False)
    assert PagedEngine(model_of("llama"), block_size=BS).runner.compiled is not None
    monkeypatch.setenv("MLX_PAGED_COMPILE", "Off")
    assert PagedEngine(model_of("llama"), block_size=BS).runner.compiled is None
    engine = PagedEngine(model_of("llama"), block_size=BS, compile_decode=True)
    assert engine.runner.compiled is not None
    monkeypatch.setenv("MLX_PAGED_COMPILE", "on")
    engine = PagedEngine(model_of("llama"), block_size=BS, compile_decode=False)
    assert engine.runner.compiled is None
    with pytest.raises(ValueError, match="compile_decode must be True, False or None"):
        PagedEngine(model_of("llama"), compile_decode="yes")
    monkeypatch.setenv("MLX_PAGED_COMPILE", "maybe")
    with pytest.raises(ValueError, match="MLX_PAGED_COMPILE must be one of 1, on, true, yes"):
        PagedEngine(model_of("llama"))


def test_a_hybrids_warm_up_traces_both_slot_orders():
    """After ``warm_up``, bursts whose requests stop first-slot-first (their slots
    gathered) and last-slot-first (the first rows read as they are) trace nothing new."""
    from mlx_paged.engine.warmup import warm_up

    engine = PagedEngine(
        model_of("qwen3_5"), block_size=BS, num_blocks=96, max_batch_size=4, compile_decode=True
    )
    warm_up(engine)
    traces = engine.runner.compiled.traces
    shapes, slots = record_shapes(engine)
    rng = random.Random(6)
    system = [rng.randrange(VOCAB) for _ in range(2 * BS)]  # as long as the warm-up's prefix
    batch = [system + [rng.randrange(VOCAB) for _ in range(3 + i)] for i in range(4)]
    for budgets in ([2, 3, 4, 5], [5, 4, 3, 2]):
        got = run(engine, batch, budgets)
        want = [dense_solo("qwen3_5", tuple(p), m) for p, m in zip(batch, budgets, strict=True)]
        assert got == want
    assert engine.runner.compiled.traces == traces
    assert slots == [
        *([None, [1, 2, 3, 3], [2, 3], [3]]),  # slots 0, 1, 2 stop in turn: gathered
        *([None, [0, 1, 2, 2], None, None]),  # slots 3, 2, 1 stop in turn: the first rows
    ]


def test_a_hybrids_state_rows_grow_by_bucket_as_requests_arrive():
    """Requests arriving one a step take slots 0, 1, 2, ...: the state arrays hold 1, 2, 4,
    then 8 rows, so the compiled steps over them meet one array shape per bucket, not one
    per request count; the tokens are mlx-lm's."""
    engine = PagedEngine(
        model_of("qwen3_5"), block_size=BS, num_blocks=96, max_batch_size=8, compile_decode=True
    )
    shapes, _ = record_shapes(engine)
    rng = random.Random(8)
    batch = [[rng.randrange(VOCAB) for _ in range(5 + i)] for i in range(6)]
    uids, held, events = [], [], []
    for prompt in batch:
        uids.append(engine.add_request(prompt, MAX_TOKENS))
        events += engine.step()
        held.append(engine.runner.states.rows_held)
    assert held == [1, 2, 4, 4, 8, 8]
    events += engine.stream()
    rows = {s[-2][0] for s in shapes}  # the last state entry's rows, per compiled step
    assert rows <= {1, 2, 4, 8} and len(shapes) == engine.clock.decode_steps
    for prompt, uid in zip(batch, uids, strict=True):
        got = [e.token for e in events if e.uid == uid]
        assert got == dense_solo("qwen3_5", tuple(prompt), MAX_TOKENS)
