"""A migration's quantization as one CUDA kernel: pool blocks straight into cold records.

``ColdStore.store_blocks`` quantizes the blocks that fall behind the hot tail with MLX
ops: a gather of the blocks from each layer's pool, ``mx.quantize`` of K and of V, the
records joined from the parts, and a scatter into the stack. That is about fifty
arrays a migration for a 16-layer model, temporaries the size of the moved blocks
several times over, and a new stack array each time (BENCHMARKS.md, runs 558-578).

This kernel reads every layer's due blocks from the pools and writes their records
into the stack in place, in one launch: one thread per quantization group, with
``mx.quantize``'s affine arithmetic (MLX's CUDA ``affine_quantize``) step for step.
MLX's graph sees no write to the stack; the launch is evaluated before the next
decode step is built, and evaluations run in order on the stream, as the decode
kernel's own K/V stores do (``cuda.py``). Before a variant (dtypes, shapes, bits and
group size) is trusted, ``store_self_check`` (run by ``dispatch.cuda_cold_store``)
compares its records with the MLX path's, word for word, on random blocks; where it
differs the MLX path stays. Measured on an H200 (BENCHMARKS.md, runs 579-583): a
migration's build and dispatch 0.4-0.9 ms against 0.9-5.9 ms, and no temporary memory
against 66-303 MB.

CUDA only. On Metal and on the CPU the MLX path quantizes.
"""

from __future__ import annotations

from functools import cache

import mlx.core as mx

from ...storage import ColdLayout, KVQuant
from .cubin import CudaKernel
from .cuda import NARROW_BYTES
from .plan import FLOAT_TYPES

THREADS = 256  # threads per block (one quantization group each)

_BODY = """
  // k{l}, v{l}: layer l's pool, [blocks, BS, HK|HV, DK|DV] in T; at, to: [n] int32 pool
  // blocks and cold slots; cold: [L, slots, CREC] uint32 records (storage/cold.py).
  constexpr int KG = DK / QGS, VG = DV / QGS, KW = DK * QBITS / 32, VW = DV * QBITS / 32;
  constexpr int GW = QGS * QBITS / 32, PER = 32 / QBITS;
  constexpr int NKP = BS * HK * KW, NVP = BS * HV * VW, NKS = BS * HK * KG, NVS = BS * HV * VG;
  constexpr int PER_BLOCK = NKS + NVS;
  constexpr float NBINS = (1 << QBITS) - 1;
  const int n = at_shape[0], slots = cold_shape[1];
  const long gid = (long)blockIdx.x * blockDim.x + threadIdx.x;
  if (gid == 0) done[0] = 0;
  if (gid >= (long)L * n * PER_BLOCK) return;
  const int layer = gid / ((long)n * PER_BLOCK);
  const int blk = (gid / PER_BLOCK) % n;
  int r = gid % PER_BLOCK;
  const bool isv = r >= NKS;
  if (isv) r -= NKS;
  const int H = isv ? HV : HK, G = isv ? VG : KG, D = isv ? DV : DK, W = isv ? VW : KW;
  const int row = r / (H * G), h = (r / G) % H, g = r % G;
  const T* pools[2 * L] = {POOLS};
  const T* src = pools[2 * layer + isv] + (((long)at[blk] * BS + row) * H + h) * D + g * QGS;
  unsigned int* rec = const_cast<unsigned int*>(cold) + ((long)layer * slots + to[blk]) * CREC;

  // mx.quantize's affine group, as MLX's CUDA affine_quantize computes it.
  float w_min = 3.402823466e+38f, w_max = 0.f;
  for (int i = 0; i < QGS; ++i) {
    const float x = static_cast<float>(src[i]);
    w_min = fminf(w_min, x);
    w_max = fmaxf(w_max, x);
  }
  float scale = fmaxf((w_max - w_min) / NBINS, 1e-7f);
  const bool side = fabsf(w_min) > fabsf(w_max);
  scale = side ? scale : -scale;
  const float edge = side ? w_min : w_max;
  const float q0 = roundf(edge / scale);
  const bool at_zero = q0 == 0.0f;
  scale = at_zero ? scale : edge / q0;
  const float bias = at_zero ? 0.f : edge;

  unsigned int* words = rec + (isv ? NKP : 0) + ((long)row * H + h) * W + g * GW;
  for (int w = 0; w < GW; ++w) {
    unsigned int out = 0u;
    for (int j = 0; j < PER; ++j) {
      const float x = static_cast<float>(src[w * PER + j]);
      const unsigned char q = fminf(roundf((x - bias) / scale), NBINS);
      out |= (unsigned int)q << (QBITS * j);
    }
    words[w] = out;
  }
  T* scales = reinterpret_cast<T*>(rec + NKP + NVP) + (isv ? 2 * NKS : 0);
  const int at_group = (row * H + h) * G + g;
  scales[at_group] = static_cast<T>(scale);
  scales[(isv ? NVS : NKS) + at_group] = static_cast<T>(bias);
"""


@cache
def _kernel(layers: int) -> CudaKernel:
    """The kernel for a stack of ``layers`` layers (each layer's K and V pool an input)."""
    pools = [name for layer in range(layers) for name in (f"k{layer}", f"v{layer}")]
    return CudaKernel(
        f"cold_store_{layers}",
        [*pools, "at", "to", "cold"],
        ["done"],
        _BODY.replace("POOLS", ", ".join(pools)),
    )


def _narrow(x: mx.array) -> mx.array:
    """A pool or stack as the kernel takes it: itself, or from ``NARROW_BYTES`` (as the
    decode kernel) a view of its first row, the same pointer and a smaller input."""
    return x[:1] if x.nbytes >= NARROW_BYTES else x


def store_reason(
    keys: list[mx.array],
    values: list[mx.array],
    at: mx.array,
    to: mx.array,
    records: mx.array,
    layout: ColdLayout,
) -> str | None:
    """Why ``cuda_store_cold`` cannot take these arrays, or ``None`` if it can."""
    if at.ndim != 1 or at.size == 0 or to.shape != at.shape:
        return f"blocks {at.shape} to slots {to.shape}"
    if at.dtype != mx.int32 or to.dtype != mx.int32:
        return f"blocks {at.shape} {at.dtype} to slots {to.shape} {to.dtype}"
    pairs = zip(keys, values, strict=True)
    shapes = {(k.shape[1:], v.shape[1:], k.dtype, v.dtype) for k, v in pairs}
    if len(shapes) != 1 or len(keys) != records.shape[0]:
        return f"{len(keys)} layers of {len(shapes)} shapes for a stack of {records.shape[0]}"
    dtype = keys[0].dtype
    if dtype not in FLOAT_TYPES or values[0].dtype != dtype or layout.dtype != dtype:
        return f"pool dtypes {dtype} / {values[0].dtype}, scales {layout.dtype}"
    if records.dtype != mx.uint32 or records.shape[-1] != layout.words:
        return f"records {records.shape} {records.dtype}"
    return None


def cuda_store_cold(
    keys: list[mx.array],
    values: list[mx.array],
    at: mx.array,
    to: mx.array,
    records: mx.array,
    layout: ColdLayout,
    quant: KVQuant,
) -> mx.array:
    """Quantize pool blocks ``at`` of every layer into cold slots ``to`` of ``records``
    ``(layers, slots, words)`` in place; return the launch's output, which must be
    evaluated before anything reads the records. The caller checks ``store_reason``."""
    k, v = keys[0], values[0]
    template = [
        ("T", k.dtype),
        ("L", len(keys)),
        ("BS", k.shape[1]),
        ("HK", k.shape[2]),
        ("DK", k.shape[3]),
        ("HV", v.shape[2]),
        ("DV", v.shape[3]),
        ("QBITS", quant.bits),
        ("QGS", quant.group_size),
        ("CREC", layout.words),
    ]
    groups = len(keys) * at.shape[0] * layout.block_size
    groups *= layout.k_heads * layout.k_groups + layout.v_heads * layout.v_groups
    pools = [_narrow(x) for pair in zip(keys, values, strict=True) for x in pair]
    (done,) = _kernel(len(keys))(
        inputs=[*pools, at, to, _narrow(records)],
        template=template,
        grid=(-(-groups // THREADS) * THREADS, 1, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[(1,)],
        output_dtypes=[mx.int32],
    )
    return done


def store_self_check(keys: list[mx.array], values: list[mx.array], quant: KVQuant) -> bool:
    """Whether ``cuda_store_cold`` writes the MLX path's records word for word, for random
    blocks of pools shaped like these (every layer), among them a constant group, a zero
    one and a negative one. Raises whatever compiling or running the kernel raises."""
    n_layers, bs = len(keys), keys[0].shape[1]
    rand = mx.random.split(mx.random.key(13), 2 * n_layers)
    pools = [
        mx.random.normal((6, *x.shape[1:]), key=rand[i]).astype(x.dtype)
        for i, x in enumerate(x for pair in zip(keys, values, strict=True) for x in pair)
    ]
    gs = quant.group_size
    pools[0][4, 0, 0, :gs] = 0.5
    pools[0][4, bs - 1, 0, :gs] = 0.0
    pools[1][1, 0, 0, :gs] = -mx.abs(pools[1][1, 0, 0, :gs])
    at, to = mx.array([4, 1, 3], dtype=mx.int32), mx.array([2, 0, 5], dtype=mx.int32)
    layout = ColdLayout.of_pool(keys[0], values[0], quant)
    k = mx.stack([x[at] for x in pools[0::2]])
    v = mx.stack([x[at] for x in pools[1::2]])
    want = mx.zeros((n_layers, 7, layout.words), dtype=mx.uint32)
    want[:, to] = layout.join(quant.quantize(k), quant.quantize(v))
    got = mx.zeros_like(want)
    mx.eval(got, want)
    mx.eval(cuda_store_cold(pools[0::2], pools[1::2], at, to, got, layout, quant))
    return mx.array_equal(got, want).item()
