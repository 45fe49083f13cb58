"""One kernel body, two preludes: what each build may spell, that each build parses, and
kernels reading the quantized cold tier directly (the reference on the CPU, the CUDA
build on a GPU)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import mlx.core as mx
import pytest
from test_kernels import cuda_only
from test_parity import max_diff
from tiny_models import VOCAB, tiny_model

from mlx_paged import PagedEngine, make_paged_cache
from mlx_paged.attention import path_counts, routing, set_attention_path
from mlx_paged.attention.kernels import source
from mlx_paged.attention.kernels.cuda import COLD_SLOTS, cuda_plan, paged_decode_cuda
from mlx_paged.attention.kernels.plan import cold_lane_elems, plan_decode, rows_per_step
from mlx_paged.attention.kernels.reference import reference_paged_decode
from mlx_paged.attention.kernels.synthetic import dense_decode, random_paged_batch

CUDA_ONLY = [
    r"__\w+",  # __shfl_xor_sync, __syncthreads, __shared__, __ldcg, __half, ...
    r"\bthreadIdx\b",
    r"\bblockIdx\b",
    r"\bgridDim\b",
    r"\batomic\w*",
    r"\bmake_uint4\b",
    r"\bexp2f\b",
    r"\bfmaxf\b",
]
METAL_ONLY = [
    r"\bthreadgroup\b",
    r"\bsimd\w*",
    r"\bmetal::",
    r"\bas_type\b",
    r"\bdevice\b",
    r"\bthread\b",
    r"\bthread_index_in_threadgroup\b",
    r"\bthreadgroup_position_in_grid\b",
    r"\bmem_flags\b",
]
LAMBDA = r"\[[&=]?\]\s*\("


def spelled(text: str, patterns: list[str]) -> list[str]:
    """The matches of ``patterns`` in ``text``, comments left out."""
    code = re.sub(r"//[^\n]*", "", text)
    return [m for p in patterns for m in re.findall(p, code)]


@pytest.mark.parametrize("name", ["paged_decode.kernel", "block_read.kernel"])
def test_the_body_uses_only_the_preludes_spellings(name):
    body = "".join(source.sections(name).values())
    assert spelled(body, CUDA_ONLY + METAL_ONLY + [LAMBDA]) == []
    # Every PD_ name it uses is defined by both preludes.
    used = set(re.findall(r"\bPD_[A-Z0-9_]+", re.sub(r"//[^\n]*", "", body))) - {"PD_COLD"}
    for backend in source.BACKENDS:
        defined = set(re.findall(r"#define (PD_\w+)", source.prelude(backend)["header"]))
        assert used <= defined, (backend, used - defined)


def test_each_build_spells_only_its_own_language():
    for merge_inline in (True, False):
        header, body = source.decode_source("cuda", merge_inline)
        assert spelled(header + body, METAL_ONLY) == []
    header, body = source.block_read_source("cuda")
    assert spelled(header + body, METAL_ONLY) == []
    metal = [source.decode_source("metal", False), source.merge_source("metal")]
    metal.append(source.block_read_source("metal"))
    for header, body in metal:
        assert spelled(header + body, CUDA_ONLY) == []
        # MLX adds Metal's position attributes to the signature where the body names them.
        assert "threadgroup_position_in_grid" in body


def test_both_builds_run_the_same_body():
    sections = source.sections("paged_decode.kernel")
    cuda = source.decode_source("cuda", merge_inline=True)
    metal = source.decode_source("metal", merge_inline=False)
    merge = source.merge_source("metal")
    for part in ("header",):
        assert sections[part] in cuda[0] and sections[part] in metal[0]
    assert sections["decode"] in cuda[1] and sections["decode"] in metal[1]
    assert sections["attend"] in cuda[1] and sections["attend"] in metal[1]
    assert sections["write"] in cuda[1] and sections["write"] not in metal[1]  # FW: CUDA only
    assert sections["merge"] in cuda[1] and sections["merge"] in merge[1]
    assert sections["merge"] not in metal[1]  # Metal merges in a second launch
    read = source.sections("block_read.kernel")
    for backend in source.BACKENDS:
        header, body = source.block_read_source(backend)
        assert read["header"] in header and read["copy"] in body
    with pytest.raises(ValueError, match="backend"):
        source.prelude("rocm")


# ---- compiling the builds where a compiler is at hand ------------------------------

TEMPLATE = (
    "typename T, typename OT, int DK, int DV, int HQ, int HKV, int G, int HG, int BS, "
    "int WINDOW, bool SINKS, int SCALE_BITS, int NW, int WH, int RS, bool PF, int QBITS, int QGS, "
    "int CE"
)
DECODE_INPUTS = [
    *("queries:T", "keys:T", "values:T", "block_tables:int32_t", "starts:int32_t"),
    *("lengths:int32_t", "sinks:float", "cold:uint32_t"),
]
DECODE_OUTPUTS = ["out:T", "part_out:float", "part_max:float", "part_sum:float"]
MERGE_INPUTS = ["part_out:float", "part_max:float", "part_sum:float", "sinks:float"]


def kernel_function(name, body, inputs, outputs, space="", attrs=(), qualifier="", extra=""):
    """A templated function shaped like the one MLX generates around ``body``, and its
    instantiation for the llama-1B shape. Names are ``name:type``; ``T`` stays the
    template's. ``extra`` adds template parameters (CUDA's ``bool FW``)."""
    pairs = [(x.split(":")[0], x.split(":")[1]) for x in (*inputs, *outputs)]
    params = [f"const {space}{t}* {n}" for n, t in pairs[: len(inputs)]]
    params += [f"const int* {n}_shape" for n, _ in pairs[: len(inputs)]]
    params += [f"{space}{t}* {n}" for n, t in pairs[len(inputs) :]]
    params += list(attrs)
    signature = f"{qualifier}void {name}({', '.join(params)})"
    return f"template <{TEMPLATE}{extra}>\n{signature} {{\n{body}\n}}\n"


def instantiation(
    name, dtype, rows, prefetch, bits, warps, inputs, outputs, attrs=(), qualifier="", hg=4, ce=16,
    fw=None, rope=False,
):  # fmt: skip
    """The explicit instantiation of ``kernel_function(name, ...)`` for ``dtype``, with ``hg``
    query heads per warp, ``ce`` elements of a cold row a lane and (CUDA) ``fw`` and
    ``rope`` (not traditional)."""
    args = f"{dtype}, {dtype}, 128, 128, 32, 8, 4, {hg}, 16, 0, true, 1000, {warps}, 1, {rows}, "
    args += f"{str(prefetch).lower()}, {bits}, 64, {ce}"
    args += "" if fw is None else f", {str(fw).lower()}, {128 if rope else 0}, false"
    types = [f"const {x.split(':')[1]}*" for x in inputs] + ["const int*"] * len(inputs)
    types += [f"{x.split(':')[1]}*" for x in outputs]
    types += [a.split()[0] for a in attrs]
    types = [t.replace("const T*", f"const {dtype}*").replace("T*", f"{dtype}*") for t in types]
    return f"template {qualifier}void {name}<{args}>({', '.join(types)});\n"


def read_function(body, space="", attrs=(), qualifier=""):
    """The block-read kernel as MLX would wrap it, instantiated for float16 rows of 128."""
    params = [f"const {space}T* keys", f"const {space}T* values", f"const {space}int* slots"]
    params += ["const int* keys_shape", "const int* values_shape", "const int* slots_shape"]
    params += [f"{space}T* k_out", f"{space}T* v_out", *attrs]
    code = "template <typename T, int HK, int CK, int HV, int CV, int U>\n"
    code += f"{qualifier}void block_read({', '.join(params)}) {{\n{body}\n}}\n"
    types = [p.rsplit(" ", 1)[0].replace("T*", "float*") for p in params]
    return (
        code + f"template {qualifier}void block_read<float, 8, 16, 8, 16, 4>({', '.join(types)});\n"
    )


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
@pytest.mark.parametrize(("bits", "lane_bytes"), [(0, 16), (4, 16), (4, 8), (8, 16), (8, 8)])
def test_the_metal_build_parses_as_cpp_with_metal_stand_ins(tmp_path, bits, lane_bytes):
    """Not a Metal compiler (none runs here): g++ with tests/metal_mock.h checks that the
    Metal build is well-formed C++ with the prelude's spellings, for every tier and both
    widths of a lane's load of a cold row."""
    attrs = ["uint3 threadgroup_position_in_grid", "uint thread_index_in_threadgroup"]
    attrs += ["uint3 threadgroups_per_grid", "uint3 threads_per_threadgroup"]
    header, body = source.decode_source("metal", merge_inline=False)
    _, merge = source.merge_source("metal")
    code = Path(__file__).with_name("metal_mock.h").read_text() + header
    inputs = [*DECODE_INPUTS, "cold_base:int32_t"]  # Metal's first cold row is an input
    code += kernel_function("decode", body, inputs, DECODE_OUTPUTS, "device ", attrs)
    code += kernel_function("merge", merge, MERGE_INPUTS, ["out:T"], "device ", attrs)
    dtype = "float16_t"
    ce = cold_lane_elems(bits, lane_bytes) if bits else 0
    rows = rows_per_step(128, 128, 4, COLD_SLOTS if bits else 8, ce)  # the mock's is 4 bytes
    code += instantiation(
        "decode", dtype, rows, False, bits, 4, inputs, DECODE_OUTPUTS, attrs,
        ce=ce or 16,
    )  # fmt: skip
    code += instantiation("merge", dtype, 8, False, bits, 4, MERGE_INPUTS, ["out:T"], attrs)
    read_header, read_body = source.block_read_source("metal")
    read_header = read_header.split("// ---- header", 1)[-1]
    code += read_header[read_header.index("template <int H") :]
    code += read_function(read_body, "device ", attrs)
    path = tmp_path / "metal_build.cpp"
    path.write_text(code)
    cmd = ["g++", "-std=c++17", "-fsyntax-only", "-Wno-unknown-pragmas", str(path)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_the_cuda_build_compiles_without_spilling(tmp_path):
    """nvcc builds the CUDA decode kernel for the launch shapes cuda.py picks for the
    llama-1B shape (16 rows per step, prefetched, and 4 heads per warp at full precision;
    with a cold tier 4 loads per lane of 16 elements, so 16 rows and 4 heads per warp at 8
    and 4 bits, no prefetch; and 16-byte loads at 4 bits, 32 rows and 2 heads) and the
    block read, with no register spills; full precision and 8 bits also store the step's
    new K/V rows (``FW``), with and without rotating them and the queries (``ROPE``)."""
    header, body = source.decode_source("cuda", merge_inline=True)
    inputs = [*DECODE_INPUTS[:7], "counters:int32_t", *DECODE_INPUTS[7:]]
    inputs += ["new_keys:T", "new_values:T", "rope_freqs:float"]
    code = "#include <cuda_fp16.h>\n#include <cuda_bf16.h>\n#include <cstdint>\n" + header
    scalar = ["int cold_base"]  # CUDA's first cold row is a scalar argument
    extra = ", bool FW, int ROPE, bool ROPE_TRAD"
    code += kernel_function(
        "decode", body, inputs, DECODE_OUTPUTS, "", scalar, "__global__ ", extra
    )
    shapes = {(0, None): (16, 4), (4, None): (16, 4), (8, None): (16, 4), (4, 16): (32, 2)}
    for (bits, lane_bytes), want in shapes.items():
        batch = random_paged_batch([64], 32, 8, 128, 128, 16, mx.float16, kv_bits=bits or None)
        plan = cuda_plan(batch.queries, batch.view, lane_bytes=lane_bytes)
        rows = rows_per_step(128, 128, 2, COLD_SLOTS if bits else 16, plan.cold_elems)
        assert (rows, plan.heads_per_block) == want
        stores = ((False, False), (True, False), (True, True))  # (FW, ROPE)
        for fw, rope in stores if bits in (0, 8) else stores[:1]:
            code += instantiation(
                "decode", "__half", rows, not bits, bits, 8, inputs, DECODE_OUTPUTS, scalar,
                qualifier="__global__ ", hg=plan.heads_per_block, ce=plan.cold_elems or 16, fw=fw,
                rope=rope,
            )  # fmt: skip
    read_header, read_body = source.block_read_source("cuda")
    code += read_header[read_header.index("template <int H") :]
    code += read_function(read_body, qualifier="__global__ ")
    path = tmp_path / "cuda_build.cu"
    path.write_text(code)
    cmd = ["nvcc", "-arch=sm_90", "-c", str(path), "-o", str(tmp_path / "k.o"), "-Xptxas", "-v"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    spills = re.findall(r"(\d+) bytes spill stores", done.stderr)
    assert len(spills) == 9 and set(spills) == {"0"}, done.stderr[-3000:]  # 8 decodes, 1 read


# ---- kernels reading the cold tier -------------------------------------------------


@pytest.mark.parametrize("bits", [4, 8])
def test_the_reference_reads_cold_blocks_as_their_dequantized_values(bits):
    batch = random_paged_batch([100, 33, 7], 8, 2, 128, 128, 16, kv_bits=bits, sinks=True)
    cold = batch.view.cold
    # 4 of 7 blocks, 2 of 3, as layer 1 of a stack of three
    assert cold is not None and cold.blob.shape[:2] == (3, 5 + 1) and cold.layer == 1
    got = reference_paged_decode(batch.queries, batch.view, 0.1, batch.sinks)
    # dense_decode reads the dequantized K/V; the hot copies of cold blocks hold 6e4.
    assert max_diff(got, dense_decode(batch, 0.1)) < 1e-5


def test_plan_declines_cold_tiers_the_kernels_cannot_read():
    batch = random_paged_batch([40, 20], 4, 2, 64, 64, 16, kv_bits=4)
    view, q = batch.view, batch.queries
    assert plan_decode(q, view).reason is None
    bad_bits = view._replace(cold=view.cold._replace(bits=3))
    assert "cold tier" in plan_decode(q, bad_bits).reason
    bad_dtype = view._replace(
        cold=view.cold._replace(layout=view.cold.layout._replace(dtype=mx.float16))
    )
    assert "cold blocks" in plan_decode(q, bad_dtype).reason
    bad_heads = view._replace(cold=view.cold._replace(layout=view.cold.layout._replace(v_heads=1)))
    assert "cold blocks" in plan_decode(q, bad_heads).reason
    short = view._replace(cold=view.cold._replace(blob=view.cold.blob[..., :-4]))
    assert "cold records" in plan_decode(q, short).reason
    # The view's layer must lie in the stack: the kernels do not check their reads.
    for layer in (-1, 3):
        bad_layer = view._replace(cold=view.cold._replace(layer=layer))
        assert "cold layer" in plan_decode(q, bad_layer).reason
    one_layer = view._replace(cold=view.cold._replace(blob=view.cold.blob[1]))
    assert "cold records" in plan_decode(q, one_layer).reason
    # A lane loads 8 or 16 bytes of a cold row: 16 or 32 elements at 4 bits.
    assert plan_decode(q, view, 64, cold_lane_bytes=8).cold_elems == 16
    assert plan_decode(q, view, 64, cold_lane_bytes=16).cold_elems == 32
    with pytest.raises(ValueError, match="8 or 16 bytes"):
        plan_decode(q, view, 64, cold_lane_bytes=12)


def test_kernel_tuning_overrides_are_checked():
    """A block of 16 warps does not launch on an H100 (too many registers); it is refused
    before anything is built, as is a cold lane load that is not 8 or 16 bytes."""
    batch = random_paged_batch([40, 20], 4, 2, 64, 64, 16, kv_bits=4)
    with pytest.raises(ValueError, match="num_warps"):
        paged_decode_cuda(batch.queries, batch.view, 0.125, None, num_warps=16)
    with pytest.raises(ValueError, match="8 or 16 bytes"):
        paged_decode_cuda(batch.queries, batch.view, 0.125, None, lane_bytes=4)


@pytest.fixture
def recording_reference(monkeypatch):
    """The reference as the only KERNELS entry, recording whether each view had cold blocks."""
    seen = []

    def reference(queries, view, scale, sinks):
        seen.append(view.cold is not None)
        return reference_paged_decode(queries, view, scale, sinks)

    monkeypatch.setattr(routing, "KERNELS", [reference])
    set_attention_path("auto")
    yield seen
    set_attention_path("auto")


@pytest.mark.parametrize("bits", [4, 8])
def test_caches_hand_kernels_their_cold_blocks(recording_reference, bits):
    """Decode through a kernel that reads the cold tier gives the logits of the gather
    path, which dequantizes the same blocks."""
    model = tiny_model("llama", head_dim=64)
    mx.random.seed(0)
    prompt = mx.random.randint(0, VOCAB, (1, 120))
    steps = mx.random.randint(0, VOCAB, (1, 6))
    outs = {}
    for path in ("gather", "auto"):
        set_attention_path(path)
        cache = make_paged_cache(model, block_size=8, kv_bits=bits, hot_tokens=16)
        model(prompt, cache=cache)
        outs[path] = mx.concatenate([model(steps[:, i : i + 1], cache=cache) for i in range(6)])
    assert recording_reference.count(True) == 6 * len(cache)  # every layer, every step
    assert max_diff(outs["gather"], outs["auto"]) < 1e-4


def test_the_engines_decode_batches_hand_kernels_their_cold_blocks(recording_reference):
    model = tiny_model("llama", head_dim=64)
    prompts = [list(range(1 + s, 90 + 7 * s)) for s in range(3)]
    results = {}
    for path in ("gather", "auto"):
        set_attention_path(path)
        engine = PagedEngine(model, block_size=8, kv_bits=8, hot_tokens=16, max_batch_size=3)
        results[path] = engine.generate(prompts, max_tokens=8)
    assert any(recording_reference)
    assert results["gather"] == results["auto"]


@cuda_only
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("lane_bytes", [8, 16])
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize(
    "config",
    [
        ([100, 33, 7], 8, 2, 128, 128, 16, None, True, None),
        ([90, 45, 12], 4, 1, 64, 64, 8, 20, False, [8, 2, 0]),
        ([70, 20], 6, 2, 128, 64, 16, None, True, None),
    ],
    ids=lambda c: f"L{c[0]}-d{c[3]}",
)
def test_cuda_kernel_reads_cold_blocks_like_the_reference(config, dtype, splits, lane_bytes, bits):
    lengths, hq, hkv, dk, dv, bs, window, sinks, first = config
    batch = random_paged_batch(
        lengths, hq, hkv, dk, dv, bs, dtype, window, sinks, first, kv_bits=bits
    )
    scale = dk**-0.5
    with mx.stream(mx.cpu):
        want = reference_paged_decode(batch.queries, batch.view, scale, batch.sinks)
        want = want.astype(mx.float32)
    got = paged_decode_cuda(
        batch.queries, batch.view, scale, batch.sinks, splits, lane_bytes=lane_bytes
    )
    tol = {mx.float32: 1e-4, mx.float16: 4e-3, mx.bfloat16: 3e-2}[dtype]
    assert max_diff(got.astype(mx.float32), want) <= tol


@cuda_only
@pytest.mark.parametrize("bits", [None, 8])
def test_cuda_kernel_reads_whole_pools_through_views_of_their_first_row(monkeypatch, bits):
    from mlx_paged.attention.kernels import cuda
    from mlx_paged.attention.kernels.plan import LaunchCache

    monkeypatch.setattr(cuda, "NARROW_BYTES", 0)  # every pool and cold array as a view
    monkeypatch.setattr(cuda, "_launches", LaunchCache())
    batch = random_paged_batch([100, 33, 7], 8, 2, 128, 128, 16, mx.float16, kv_bits=bits)
    with mx.stream(mx.cpu):
        want = reference_paged_decode(batch.queries, batch.view, 128**-0.5, None)
    got = paged_decode_cuda(batch.queries, batch.view, 128**-0.5, None)
    assert max_diff(got.astype(mx.float32), want.astype(mx.float32)) <= 4e-3


@cuda_only
@pytest.mark.parametrize("bits", [None, 8])
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("narrow", [False, True])
def test_cuda_kernel_stores_the_new_rows_it_reads(monkeypatch, bits, splits, narrow):
    """With ``FW`` each sequence's last row comes as the new rows, its slot garbage: the
    output is the reference's, and afterwards the pools are exactly the original ones (the
    rows stored, nothing else touched), with pools whole or as views of their first row."""
    from mlx_paged.attention.kernels import cuda
    from mlx_paged.attention.kernels.dispatch import _last_rows_given
    from mlx_paged.attention.kernels.plan import LaunchCache

    monkeypatch.setattr(cuda, "NARROW_BYTES", 0 if narrow else 1 << 62)
    monkeypatch.setattr(cuda, "_launches", LaunchCache())
    batch = random_paged_batch([100, 33, 7, 16], 8, 2, 128, 128, 16, mx.float16, kv_bits=bits)
    given, stored = _last_rows_given(batch.view)
    assert not mx.array_equal(given.keys, batch.view.keys).item()
    with mx.stream(mx.cpu):
        want = reference_paged_decode(batch.queries, batch.view, 128**-0.5, None)
    got = paged_decode_cuda(batch.queries, given, 128**-0.5, None, splits)
    assert max_diff(got.astype(mx.float32), want.astype(mx.float32)) <= 4e-3
    assert stored() == 0
    assert mx.array_equal(given.keys, batch.view.keys).item()
    assert mx.array_equal(given.values, batch.view.values).item()


def migrate_then_reuse_a_block() -> tuple[mx.array, mx.array, mx.array, int]:
    """A pool of five blocks: a sequence of 80 tokens moves four blocks into an 8-bit cold
    tier, and a new sequence's first decode step, of rows of 100, takes one of their hot ids
    back through the paged attention path. Returns the first sequence's K as written, as
    read back from both tiers afterwards, the step's output, and which of its blocks the
    new sequence took."""
    from mlx_paged.attention import paged_attention
    from mlx_paged.cache import DecodeBatch, StepPagedKVCache
    from mlx_paged.storage import KVPool, KVQuant

    pool = KVPool(1, 16, 5, None, KVQuant(8, 64, 16))
    pool.defer_reads = True
    first = pool.new_table()
    kv = mx.random.normal((1, 2, 80, 64), key=mx.random.key(3)).astype(mx.float16)
    pool.reserve(first, 0, 80)
    pool.write_prefill(first, 0, kv, kv)
    mx.eval(pool.keys[0], pool.values[0])
    hot = list(first.blocks)
    assert pool.maybe_migrate([first]) == 4
    second = pool.new_table()
    pool.reserve(second, 0, 1)
    reused = hot.index(second.blocks[0])
    rows = mx.full((1, 2, 1, 64), 100.0, dtype=mx.float16)
    cache = StepPagedKVCache(pool, DecodeBatch(pool, [second], None), 0)
    keys, values = cache.update_and_fetch(rows, rows)
    out = paged_attention(mx.ones((1, 4, 1, 64), mx.float16), keys, values, cache, 0.125, None)
    mx.eval(out)
    got, _ = pool.read_tiered(0, pool.tier_plan([first.blocks]))
    return kv, got, out, reused


@cuda_only
def test_a_block_just_moved_to_the_cold_tier_keeps_its_rows_when_a_kernel_reuses_it():
    """A migration's hot blocks go back to the pool at once, and a decode kernel stores a
    step's K/V into one of them in place, past MLX's copy-on-write: the cold copy still
    holds the rows the block had (the quantization was dispatched first)."""
    set_attention_path("auto")
    before = path_counts["cuda_paged_decode"]
    kv, got, out, reused = migrate_then_reuse_a_block()
    assert path_counts["cuda_paged_decode"] == before + 1  # the storing kernel took the step
    assert mx.allclose(out, mx.full(out.shape, 100.0, dtype=out.dtype)).item()
    span = slice(reused * 16, reused * 16 + 16)
    assert max_diff(got[:, :, span].astype(mx.float32), kv[:, :, span].astype(mx.float32)) < 0.1


@cuda_only
@pytest.mark.parametrize("bits", [4, 8])
def test_the_engine_through_the_cold_kernel_matches_the_gather_path(bits):
    """Decode batches that move blocks into the cold tier as they go (all-cold steps, steps
    holding the hot tail, blocks of 8 under steps of 32-128 rows) give the tokens of the
    portable path, which dequantizes the same blocks, on the same GPU. In float32: in
    float16 and bfloat16 the portable path rounds the dequantized values to the pool's dtype
    and the kernel does not, so greedy tokens part after a while (float16 at 8 bits: one of
    four prompts at token 22 of 24 on the H100)."""
    model = tiny_model("llama", head_dim=64)
    prompts = [[(7 * i + s) % VOCAB for i in range(130 + 23 * s)] for s in range(4)]
    results = {}
    for path in ("gather", "auto"):
        set_attention_path(path)
        before = path_counts["cuda_paged_decode"]
        engine = PagedEngine(model, block_size=8, kv_bits=bits, hot_tokens=16, max_batch_size=4)
        results[path] = engine.generate(prompts, max_tokens=24)
        assert engine.stats().migrations > 0
        used = path_counts["cuda_paged_decode"] > before
        assert used == (path == "auto")
    set_attention_path("auto")
    assert results["gather"] == results["auto"]
