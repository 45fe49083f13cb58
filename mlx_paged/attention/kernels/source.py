"""Kernel sources: one backend-neutral body per kernel, built for CUDA or Metal by a prelude.

A body (``paged_decode.kernel``, ``block_read.kernel``) is written only in the
``PD_`` spellings that ``prelude_cuda.h`` and ``prelude_metal.h`` define (thread
and group indices, warp shuffles, barriers, shared memory, address spaces,
math) and in the C++ the two languages share. The CUDA build is what ``kernel_check`` and the GPU
tests run; the Metal build differs from it only by its prelude.

Files are cut into sections by ``// ---- name`` lines. A prelude has a
``header`` part (everything before its first mark), ``indices`` (statements
that name the thread's position: they go into the kernel body, where MLX looks
for Metal's position attributes) and, for CUDA, ``publish`` (the last split of
a sequence to finish merges them all in the same launch; Metal runs the merge
as a second launch instead).
"""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

from ...blocks import COLD

BACKENDS = ("cuda", "metal")
_MARK = re.compile(r"^// ---- (\w+)\n", re.MULTILINE)


@cache
def sections(name: str) -> dict[str, str]:
    """The sections of a kernel file in this package; the text before the first mark is
    ``"header"``."""
    text = (Path(__file__).parent / name).read_text()
    parts = _MARK.split(text)
    out = {"header": parts[0]}
    out.update(zip(parts[1::2], parts[2::2], strict=True))
    return out


def prelude(backend: str) -> dict[str, str]:
    """The sections of ``backend``'s prelude."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    return sections(f"prelude_{backend}.h")


def decode_source(backend: str, merge_inline: bool) -> tuple[str, str]:
    """``(header, body)`` of the paged decode kernel for ``backend``.

    With ``merge_inline`` (CUDA) the last split of each sequence merges the
    splits in the same launch; without it the launch ends once it wrote its
    partials, and ``merge_source`` merges them. The CUDA body also holds the
    ``write`` section: with ``FW`` a launch stores the step's new K/V rows itself.
    """
    pre, body = prelude(backend), sections("paged_decode.kernel")
    header = f"{pre['header']}#define PD_COLD {COLD}\n{body['header']}"
    source = pre["indices"] + body["decode"]
    if backend == "cuda":  # the launch may store the step's new K/V rows (FW)
        source += body["write"]
    source += body["attend"]
    if merge_inline:
        source += pre["publish"] + body["merge"]
    return header, source


def block_read_source(backend: str) -> tuple[str, str]:
    """``(header, body)`` of the prefill block-read kernel for ``backend``."""
    pre, body = prelude(backend), sections("block_read.kernel")
    return pre["header"] + body["header"], pre["indices"] + body["copy"]


def merge_source(backend: str) -> tuple[str, str]:
    """``(header, body)`` of the launch that merges a decode launch's split partials."""
    pre, body = prelude(backend), sections("paged_decode.kernel")
    return pre["header"], pre["indices"] + body["merge_kernel"] + body["merge"]


def prefill_source(split: bool = False) -> tuple[str, str]:
    """``(header, body)`` of the CUDA paged prefill kernel (``paged_prefill.kernel``: tensor
    core instructions, so CUDA alone): writing the output, or with ``split`` each key
    split's partial output and log-sum-exp."""
    pre, body = prelude("cuda"), sections("paged_prefill.kernel")
    return pre["header"] + body["header"], body["prefill"] + body["parts" if split else "out"]
