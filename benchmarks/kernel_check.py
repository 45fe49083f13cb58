"""GPU check: the fused paged decode kernel against the MLX reference (full precision,
and with 4- and 8-bit cold tiers), and the prefill block-read kernel against
``mx.take``, one line per config.

Run on a CUDA machine from the repo root: ``python benchmarks/kernel_check.py``.
Exits non-zero if any config exceeds its tolerance.
"""

from __future__ import annotations

import sys
from itertools import product

import mlx.core as mx

from mlx_paged.attention.kernels.cuda import paged_decode_cuda
from mlx_paged.attention.kernels.read import read_blocks
from mlx_paged.attention.kernels.reference import reference_paged_decode
from mlx_paged.attention.kernels.synthetic import dense_decode, random_paged_batch
from mlx_paged.storage import take_blocks

TOL = {mx.float32: 1e-4, mx.float16: 4e-3, mx.bfloat16: 3e-2}

# (lengths, n_heads, n_kv, dk, dv, block_size, window, sinks, first_blocks)
SHAPES = [
    ([37], 32, 8, 128, 128, 16, None, False, None),
    ([1, 16, 17, 300, 1025], 32, 8, 128, 128, 16, None, False, None),
    ([5000, 70, 2049], 32, 8, 128, 128, 16, None, True, None),
    ([100, 257, 33], 8, 8, 64, 64, 16, None, False, None),
    ([999, 31], 16, 2, 256, 256, 32, None, False, None),
    ([130, 77, 4000], 8, 1, 128, 64, 16, None, True, None),
    ([500, 1200, 45], 32, 8, 128, 128, 16, 128, False, [0, 60, 0]),
    ([700, 90], 64, 8, 64, 64, 8, 40, True, [40, 0]),
    ([3000], 4, 2, 256, 128, 16, 1000, True, [100]),
    ([64, 65, 63], 12, 4, 128, 128, 64, None, False, None),
]
DTYPES = [mx.float32, mx.float16, mx.bfloat16]


def main() -> int:
    failures, n = 0, 0
    for shape, dtype, bits in product(SHAPES, DTYPES, (None, 4, 8)):
        lengths, hq, hkv, dk, dv, bs, window, sinks, first = shape
        batch = random_paged_batch(
            lengths, hq, hkv, dk, dv, bs, dtype, window, sinks, first, seed=n, kv_bits=bits
        )
        scale = dk**-0.5
        # On the GPU float32 matmuls may use TF32: compute the spec on the CPU.
        with mx.stream(mx.cpu):
            ref = reference_paged_decode(batch.queries, batch.view, scale, batch.sinks)
            ref = ref.astype(mx.float32)
            mx.eval(ref)
        dense = dense_decode(batch, scale).astype(mx.float32)
        for splits in (1, None, 7):
            out = paged_decode_cuda(batch.queries, batch.view, scale, batch.sinks, splits)
            assert out is not None, f"kernel declined {shape}"
            diff = mx.abs(out.astype(mx.float32) - ref.astype(mx.float32)).max().item()
            dd = mx.abs(out.astype(mx.float32) - dense).max().item()
            ok = diff <= TOL[dtype] and not (diff != diff)
            failures += not ok
            n += 1
            print(
                f"{'ok  ' if ok else 'FAIL'} lengths={lengths} hq={hq} hkv={hkv} dk={dk} "
                f"dv={dv} bs={bs} window={window} sinks={sinks} first={first} "
                f"{str(dtype).split('.')[-1]} kv_bits={bits} splits={splits}: "
                f"max|kernel-ref|={diff:.3g} "
                f"max|kernel-sdpa|={dd:.3g}"
            )
    for check in (concurrent_launches, block_reads):
        ok, total = check()
        failures += total - ok
        n += total
    print(f"{n - failures}/{n} configs within tolerance")
    return 1 if failures else 0


def concurrent_launches(count: int = 24) -> tuple[int, int]:
    """Split launches evaluated together, which MLX may run as concurrent graph nodes.

    Each launch must keep its own split counters; returns (launches within tolerance, count).
    """
    batches = [
        random_paged_batch([3000, 1500, 700], 32, 8, 128, 128, 16, mx.float16, seed=100 + i)
        for i in range(count)
    ]
    scale = 128**-0.5
    outs = [
        paged_decode_cuda(b.queries, b.view, scale, None, 7 + i % 5) for i, b in enumerate(batches)
    ]
    mx.eval(outs)
    ok = 0
    for i, (b, out) in enumerate(zip(batches, outs, strict=True)):
        with mx.stream(mx.cpu):
            ref = reference_paged_decode(b.queries, b.view, scale, None).astype(mx.float32)
        diff = mx.abs(out.astype(mx.float32) - ref).max().item()
        good = diff <= TOL[mx.float16]
        ok += good
        print(f"{'ok  ' if good else 'FAIL'} concurrent launch {i} splits={7 + i % 5}: {diff:.3g}")
    return ok, count


def block_reads() -> tuple[int, int]:
    """The block-read kernel against ``mx.take``: a copy, so it must match exactly."""
    ok = total = 0
    for hk, dk, hv, dv in ((8, 64, 8, 64), (8, 128, 8, 128), (2, 256, 2, 256), (1, 192, 1, 128)):
        for bs in (8, 16, 32):
            for dtype in DTYPES:
                for batch, tokens in ((1, 1), (1, 4097), (3, 5 * bs + 3)):
                    nb = batch * tokens // bs + 5
                    keys = mx.random.normal((nb, bs, hk, dk)).astype(dtype)
                    values = mx.random.normal((nb, bs, hv, dv)).astype(dtype)
                    slots = mx.random.randint(0, nb * bs, (batch, tokens)).astype(mx.int32)
                    got = read_blocks("cuda", keys, values, slots)
                    want = take_blocks(keys, values, slots)
                    exact = all(mx.array_equal(g, w).item() for g, w in zip(got, want, strict=True))
                    ok += exact
                    total += 1
                    print(
                        f"{'ok  ' if exact else 'FAIL'} block read hk={hk} dk={dk} hv={hv} "
                        f"dv={dv} bs={bs} {str(dtype).split('.')[-1]} B={batch} T={tokens}: "
                        f"{'exact' if exact else 'differs'}"
                    )
    return ok, total


if __name__ == "__main__":
    sys.exit(main())
