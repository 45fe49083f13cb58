"""A migration's quantization: ``ColdStore.store_blocks`` offers every layer's due blocks to
the ``STORERS`` entries (the CUDA kernel, ``attention/kernels/cold_store.py``), and keeps
its MLX path where none takes them. The kernel's records must equal the MLX path's word
for word; that is checked on the GPU, and a stand-in entry drives the protocol here."""

from __future__ import annotations

import mlx.core as mx
import pytest
from test_kernels import cuda_only
from test_quant import BLOCK, HOT, tokens
from tiny_models import tiny_model

from mlx_paged import PagedEngine
from mlx_paged.attention.kernels import cold_store, dispatch
from mlx_paged.storage import STORERS, ColdLayout, ColdStore, KVQuant


def pools(layers: int, blocks: int, heads: tuple[int, int], dims: tuple[int, int], dtype, seed=0):
    """Every layer's K and V pool ``(blocks, BLOCK, heads, dim)``."""
    rand = mx.random.split(mx.random.key(seed), 2 * layers)
    out = ([], [])
    for i in range(2 * layers):
        shape = (blocks, BLOCK, heads[i % 2], dims[i % 2])
        out[i % 2].append(mx.random.normal(shape, key=rand[i]).astype(dtype))
    return out


def mlx_records(keys, values, at, to, slots, quant) -> mx.array:
    """The stack the MLX path makes: a fresh store, every layer's blocks ``at`` in ``to``."""
    store = ColdStore(len(keys), quant)
    store.store_layers(
        mx.stack([k[at] for k in keys]), mx.stack([v[at] for v in values]), to, slots
    )
    return store.blobs[0]


@pytest.mark.parametrize("bits, group", [(8, 32), (4, 64), (8, 128)])
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16])
def test_a_pools_layout_is_its_quantized_blocks_layout(bits, group, dtype):
    quant = KVQuant(bits, group)
    keys, values = pools(1, 2, (2, 3), (128, 256), dtype)
    want = ColdLayout.of(quant.quantize(keys[0]), quant.quantize(values[0]))
    assert ColdLayout.of_pool(keys[0], values[0], quant) == want


@pytest.fixture
def storer(monkeypatch):
    """A ``STORERS`` entry that writes the MLX path's records into the stack it is handed
    (or declines); it records its calls."""
    calls = {"take": True, "args": []}

    def entry(keys, values, at, to, records, layout, quant):
        calls["args"].append((len(keys), at.tolist(), to.tolist(), records.shape, layout))
        if not calls["take"]:
            return None
        k = mx.stack([x[at] for x in keys])
        v = mx.stack([x[at] for x in values])
        records[:, to] = layout.join(quant.quantize(k), quant.quantize(v))
        return records

    monkeypatch.setattr("mlx_paged.storage.cold.STORERS", [entry])
    return calls


@pytest.mark.parametrize("take", [True, False])
def test_every_layers_blocks_go_to_a_storer_in_one_call(storer, take):
    storer["take"] = take
    quant = KVQuant(8, 32)
    keys, values = pools(3, 6, (2, 2), (64, 64), mx.float32)
    at, to = mx.array([4, 1], dtype=mx.int32), mx.array([0, 3], dtype=mx.int32)
    store = ColdStore(3, quant)
    out = store.store_blocks(keys, values, at, to, 5)
    layout = ColdLayout.of_pool(keys[0], values[0], quant)
    assert storer["args"] == [(3, [4, 1], [0, 3], (3, 5, layout.words), layout)]
    assert store.where == [(0, 0), (0, 1), (0, 2)] and store.layouts == [layout]
    # What the store hands back to evaluate: the storer's array, or its own stack.
    assert len(out) == 1 and out[0] is store.blobs[0]
    assert mx.array_equal(store.blobs[0], mlx_records(keys, values, at, to, 5, quant))
    # A larger tier: the stack grows first, and the storer gets the grown one.
    more = store.store_blocks(keys, values, mx.array([2], dtype=mx.int32), mx.array([7]), 8)
    assert storer["args"][-1][3] == (3, 8, layout.words) and more[0] is store.blobs[0]
    assert mx.array_equal(store.blobs[0][:, :5], mlx_records(keys, values, at, to, 5, quant))


def test_layers_of_other_shapes_are_never_offered(storer):
    quant = KVQuant(8, 32)
    keys, values = pools(2, 4, (2, 2), (64, 64), mx.float32)
    wide_k, wide_v = pools(1, 4, (4, 4), (64, 64), mx.float32, seed=1)
    store = ColdStore(3, quant)
    store.store_blocks([*keys, wide_k[0]], [*values, wide_v[0]], mx.array([1]), mx.array([0]), 2)
    assert storer["args"] == [] and store.where == [(0, 0), (0, 1), (1, 0)]


def test_a_store_stacked_out_of_order_is_never_offered(storer):
    quant = KVQuant(8, 32)
    keys, values = pools(2, 4, (2, 2), (64, 64), mx.float32)
    store, at = ColdStore(2, quant), mx.array([1])
    for layer in (1, 0):  # a disk load that met the layers in this order
        store.write(
            layer, quant.quantize(keys[layer][at]), quant.quantize(values[layer][at]), at, 4
        )
    store.store_blocks(keys, values, mx.array([2]), mx.array([3]), 4)
    assert storer["args"] == []
    assert mx.array_equal(
        store.read(0, mx.array([3]))[0], quant.dequantize(quant.quantize(keys[0][2:3]))
    )


def test_the_cuda_entry_declines_off_the_gpu():
    if mx.cuda.is_available() and mx.default_device() == mx.gpu:
        pytest.skip("runs where no CUDA GPU is the default device")
    keys, values = pools(2, 4, (2, 2), (64, 64), mx.float32)
    quant = KVQuant(8, 32)
    layout = ColdLayout.of_pool(keys[0], values[0], quant)
    records = mx.zeros((2, 4, layout.words), dtype=mx.uint32)
    at = mx.array([1], dtype=mx.int32)
    assert dispatch.cuda_cold_store(keys, values, at, at, records, layout, quant) is None


def test_store_reason_names_what_the_kernel_cannot_take():
    quant = KVQuant(8, 32)
    keys, values = pools(2, 4, (2, 2), (64, 64), mx.float32)
    layout = ColdLayout.of_pool(keys[0], values[0], quant)
    records = mx.zeros((2, 4, layout.words), dtype=mx.uint32)
    at, to = mx.array([1, 3], dtype=mx.int32), mx.array([0, 2], dtype=mx.int32)
    assert cold_store.store_reason(keys, values, at, to, records, layout) is None
    more = [*keys, keys[0]], [*values, values[0]]
    assert "3 layers" in cold_store.store_reason(*more, at, to, records, layout)
    assert "records" in cold_store.store_reason(keys, values, at, to, records[..., :-4], layout)
    half = [x.astype(mx.float16) for x in keys]
    assert "dtypes" in cold_store.store_reason(half, values, at, to, records, layout)
    none = mx.array([], dtype=mx.int32)
    assert "blocks" in cold_store.store_reason(keys, values, none, none, records, layout)
    assert "blocks" in cold_store.store_reason(keys, values, at, to[:1], records, layout)
    wide = at.astype(mx.int64)
    assert "int32" in cold_store.store_reason(keys, values, wide, to, records, layout)


@cuda_only
@pytest.mark.parametrize("bits, group", [(8, 32), (8, 64), (4, 32), (4, 128)])
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
@pytest.mark.parametrize("narrow", [False, True])
def test_the_cuda_kernel_writes_the_mlx_paths_records(monkeypatch, bits, group, dtype, narrow):
    """Word for word, into a stack that already holds other blocks, with K and V of other
    head counts and dims; ``narrow`` hands it views of the arrays' first rows."""
    if narrow:
        monkeypatch.setattr(cold_store, "NARROW_BYTES", 0)
    quant = KVQuant(bits, group)
    keys, values = pools(3, 9, (2, 4), (128, 256), dtype, seed=bits + group)
    keys[1][5, 2, 1, :group] = 0.25  # a constant group
    values[2][7, 0, 3, :group] = 0.0  # a zero one
    layout = ColdLayout.of_pool(keys[0], values[0], quant)
    at, to = mx.array([5, 0, 7, 2], dtype=mx.int32), mx.array([6, 1, 3, 0], dtype=mx.int32)
    want = mlx_records(keys, values, at, to, 8, quant)
    before = mlx_records(keys, values, mx.array([8]), mx.array([4]), 8, quant)
    got = mx.array(before)
    mx.eval(got)
    assert cold_store.store_reason(keys, values, at, to, got, layout) is None
    mx.eval(cold_store.cuda_store_cold(keys, values, at, to, got, layout, quant))
    assert mx.array_equal(got[:, to], want[:, to])
    assert mx.array_equal(got[:, 4], before[:, 4])  # the slot it was not given
    assert dispatch.cuda_cold_store(keys, values, at, to, got, layout, quant) is not None


@cuda_only
@pytest.mark.parametrize("compiled", [True, False])
def test_the_engines_tokens_with_the_kernel_are_the_mlx_paths(monkeypatch, compiled):
    """Four requests long enough to migrate several times, greedy: the same tokens and the
    same cold blocks with the migrations on the GPU as through MLX ops."""
    prompts = [tokens(40 + 7 * i, seed=i)[0].tolist() for i in range(4)]
    model, out = tiny_model("llama", head_dim=64), {}
    for entries in ([], [dispatch.cuda_cold_store]):
        monkeypatch.setattr("mlx_paged.storage.cold.STORERS", entries)
        engine = PagedEngine(
            model,
            block_size=BLOCK,
            kv_bits=8,
            hot_tokens=HOT,
            compile_decode=compiled,
        )
        out[len(entries)] = (engine.generate(prompts, max_tokens=48), engine.stats())
        engine.check_invariants()
    (plain, stats), (kernel, kstats) = out[0], out[1]
    assert kernel == plain and kstats.migrations == stats.migrations > 2
    assert kstats.cold_blocks == stats.cold_blocks
    assert STORERS == [dispatch.cuda_cold_store]  # registered at import
