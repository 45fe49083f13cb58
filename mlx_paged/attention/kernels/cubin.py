"""CUDA kernels compiled once per machine instead of once per process.

``mx.fast.cuda_kernel`` hands its source to NVRTC in every new process: MLX
keeps the PTX of its own kernels on disk, not of custom ones. On the H100 host
the first decode variant and the block read took 2.3 s and 1.6 s (self-checks
included), paid by the first request a fresh server sees. ``CudaKernel`` builds
the same body with NVRTC itself (through ctypes, on the library MLX already
loaded), keeps the cubin under ``$MLX_PAGED_KERNEL_CACHE`` (else
``<cache root>/cuda-kernels``) keyed by a hash of the source, the GPU
architecture and the NVRTC version, and launches it with
``mx.fast.precompiled_cuda_kernel``. With ``MLX_PAGED_KERNEL_CACHE=off``, where
NVRTC or the driver cannot be found, or where a build fails, it launches
through ``mx.fast.cuda_kernel`` as before; a folder it cannot write keeps the
cubins for this process only. Where nvFatbin is found, a launch hands MLX the cubin
inside a compressed fatbin instead (``fatbin.py``), kept beside it.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import tempfile
from collections.abc import Callable, Sequence
from functools import cache
from pathlib import Path

import mlx.core as mx

from ...paths import cache_root
from . import fatbin
from .libs import driver, open_library
from .plan import placeholder

logger = logging.getLogger("mlx_paged.kernels")

CTYPES = {
    mx.float16: "__half",
    mx.bfloat16: "__nv_bfloat16",
    mx.float32: "float",
    mx.int32: "int",
    mx.uint32: "unsigned int",
}
_PREAMBLE = "#include <cuda_fp16.h>\n#include <cuda_bf16.h>\n"
TemplateArg = tuple[str, "int | bool | mx.Dtype"]


# ---- the compiler and the GPU ------------------------------------------------


@cache
def _nvrtc() -> ctypes.CDLL | None:
    lib = open_library("libnvrtc.so", "nvrtc")
    if lib is not None:
        lib.nvrtcGetErrorString.restype = ctypes.c_char_p
    return lib


@cache
def architecture() -> str | None:
    """``"sm_90"`` for an H100: the compute capability of GPU 0, from the CUDA driver."""
    cuda = getattr(mx, "cuda", None)
    if cuda is None or not cuda.is_available():
        return None
    drv = driver()
    if drv is None:
        return None
    dev, major, minor = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
    if drv.cuInit(0) or drv.cuDeviceGet(ctypes.byref(dev), 0):
        return None
    # CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR / _MINOR
    if drv.cuDeviceGetAttribute(ctypes.byref(major), 75, dev) or drv.cuDeviceGetAttribute(
        ctypes.byref(minor), 76, dev
    ):
        return None
    return f"sm_{major.value}{minor.value}"


@cache
def _nvrtc_version() -> str:
    lib, major, minor = _nvrtc(), ctypes.c_int(), ctypes.c_int()
    lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
    return f"{major.value}.{minor.value}"


def cache_dir() -> Path | None:
    """Where cubins are kept, or ``None`` if ``MLX_PAGED_KERNEL_CACHE=off``."""
    env = os.environ.get("MLX_PAGED_KERNEL_CACHE")
    if env == "off":
        return None
    return Path(env).expanduser() if env else cache_root() / "cuda-kernels"


def available() -> bool:
    """Whether kernels can be compiled here and kept between processes.

    Asked on every launch a block read makes, so only the setting is read each time.
    """
    return os.environ.get("MLX_PAGED_KERNEL_CACHE") != "off" and _compiler_ready()


@cache
def _compiler_ready() -> bool:
    lib = _nvrtc()
    return lib is not None and hasattr(lib, "nvrtcGetCUBIN") and architecture() is not None


def _include_options() -> list[str]:
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            return [f"--include-path={os.environ[var]}/include"]
    return ["--include-path=/usr/local/cuda/include"] if Path("/usr/local/cuda").is_dir() else []


def _check(lib: ctypes.CDLL, result: int, what: str) -> None:
    if result:
        raise RuntimeError(f"{what} failed: {lib.nvrtcGetErrorString(result).decode()}")


def nvrtc_compile(source: str, name: str, options: Sequence[str]) -> bytes:
    """Compile ``source`` to a cubin with NVRTC; raise ``RuntimeError`` with the log on failure."""
    lib, prog = _nvrtc(), ctypes.c_void_p()
    _check(
        lib,
        lib.nvrtcCreateProgram(
            ctypes.byref(prog), source.encode(), f"{name}.cu".encode(), 0, None, None
        ),
        "nvrtcCreateProgram",
    )
    try:
        opts = (ctypes.c_char_p * len(options))(*(o.encode() for o in options))
        if lib.nvrtcCompileProgram(prog, len(options), opts):
            size = ctypes.c_size_t()
            lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value + 1)
            lib.nvrtcGetProgramLog(prog, log)
            raise RuntimeError(f"NVRTC could not compile {name}: {log.value.decode()}")
        size = ctypes.c_size_t()
        _check(lib, lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)), "nvrtcGetCUBINSize")
        out = ctypes.create_string_buffer(size.value)
        _check(lib, lib.nvrtcGetCUBIN(prog, out), "nvrtcGetCUBIN")
        return out.raw
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


# ---- the disk cache ------------------------------------------------------------

_cubins: dict[str, bytes] = {}


def cubin(source: str, name: str, compile_fn: Callable | None = None) -> bytes:
    """The cubin of ``source`` (an ``extern "C"`` kernel called ``name``): from this process,
    else from the cache folder, else compiled and written there (atomically)."""
    options = [f"--gpu-architecture={architecture()}", "--std=c++17", *_include_options()]
    key = hashlib.sha256("\0".join([source, *options, _nvrtc_version()]).encode()).hexdigest()
    return _kept(
        f"{name}-{key[:32]}.cubin", lambda: (compile_fn or nvrtc_compile)(source, name, options)
    )


def launch_image(data: bytes, name: str) -> bytes:
    """What a launch of the cubin ``data`` (kernel ``name``) hands MLX: its packed image
    (``fatbin.py``), kept in the cache folder beside it and checked to load in every
    process, else ``data`` itself."""
    if not fatbin.enabled():
        return data
    key = hashlib.sha256(data + fatbin.version().encode()).hexdigest()
    image = _kept(
        f"{name}-{key[:32]}.fatbin", lambda: fatbin.pack(data, architecture(), name) or b""
    )
    return image if image and fatbin.loads(image, name) else data


def _kept(file: str, make: Callable[[], bytes]) -> bytes:
    """The bytes kept as ``file``: from this process, else from the cache folder, else
    made and, unless empty, written there (atomically)."""
    if file in _cubins:
        return _cubins[file]
    folder = cache_dir()
    path = None if folder is None else folder / file
    data = b""
    if path is not None and path.is_file():
        try:
            data = path.read_bytes()
        except OSError:
            pass  # unreadable: make it again
    if not data:
        logger.info("mlx_paged: building %s (kept in %s).", file, folder)
        data = make()
        if path is not None and data:
            try:
                folder.mkdir(parents=True, exist_ok=True)
                with tempfile.NamedTemporaryFile(dir=folder, delete=False) as f:
                    f.write(data)
                os.replace(f.name, path)
            except OSError as e:  # a read-only home: keep it for this process only
                logger.info("mlx_paged: cannot keep compiled kernels in %s (%s).", folder, e)
    _cubins[file] = data
    return data


# ---- kernels ---------------------------------------------------------------------


def render(
    name: str,
    header: str,
    body: str,
    input_names: Sequence[str],
    input_dtypes: Sequence[mx.Dtype],
    input_ndims: Sequence[int],
    output_names: Sequence[str],
    output_dtypes: Sequence[mx.Dtype],
    template: Sequence[TemplateArg],
    absent: dict[str, str] | None = None,
    scalars: dict[str, bool] | None = None,
) -> tuple[str, list[int]]:
    """The whole CUDA source of one template set, and the indices of the inputs whose shapes
    are passed as trailing ``int`` arguments (those the body reads as ``<name>_shape[i]``).

    The signature and constants follow what ``mx.fast.cuda_kernel`` generates, so the
    same body builds either way. An input whose dtype is ``None`` is left out of the
    signature and declared a null pointer to ``absent[name]`` (a C type or a template
    type name): the body must not read it for this template set. Each of ``scalars``
    (name: whether passed) is an ``int`` argument after the shapes, or a constant 0.
    """
    ins = [(i, n, d) for i, (n, d) in enumerate(zip(input_names, input_dtypes, strict=True))]
    params = [f"const {CTYPES[d]}* {n}" for _, n, d in ins if d is not None]
    params += [f"{CTYPES[d]}* {n}" for n, d in zip(output_names, output_dtypes, strict=True)]
    shaped = [i for i, n, d in ins if d is not None and f"{n}_shape" in body]
    lines = []
    for i in shaped:
        n, dims = input_names[i], range(input_ndims[i])
        params += [f"int {n}_shape_{d}" for d in dims]
        lines.append(f"  const int {n}_shape[] = {{{', '.join(f'{n}_shape_{d}' for d in dims)}}};")
    for arg, value in template:
        if isinstance(value, mx.Dtype):
            lines.append(f"  using {arg} = {CTYPES[value]};")
        elif isinstance(value, bool):
            lines.append(f"  constexpr bool {arg} = {'true' if value else 'false'};")
        else:
            lines.append(f"  constexpr int {arg} = {value};")
    lines += [f"  const {absent[n]}* {n} = nullptr;" for _, n, d in ins if d is None]
    for n, passed in (scalars or {}).items():
        if passed:
            params.append(f"int {n}")
        else:
            lines.append(f"  constexpr int {n} = 0;")
    signature = ",\n    ".join(params)
    source = (
        f'{_PREAMBLE}{header}\nextern "C" __global__ void {name}(\n    {signature}) {{\n'
        + "\n".join(lines)
        + f"\n{body}\n}}\n"
    )
    return source, shaped


class CudaKernel:
    """One kernel body, called like an ``mx.fast.cuda_kernel`` object.

    Each template set is compiled once per machine (see the module docstring);
    without NVRTC it falls back to ``mx.fast.cuda_kernel``. Inputs named in
    ``absent`` (with their dtype, or the name of a dtype template argument) may be
    passed as ``None`` where the template set does not read them: the compiled
    kernel leaves them out, so a launch carries fewer arrays. The body reads each
    of ``scalar_names`` as an ``int``: an argument of the launch where it passes one
    (``scalars``), else 0; under ``mx.fast.cuda_kernel`` a template constant.
    """

    def __init__(
        self,
        name: str,
        input_names: Sequence[str],
        output_names: Sequence[str],
        source: str,
        header: str = "",
        absent: dict[str, mx.Dtype | str] | None = None,
        scalar_names: Sequence[str] = (),
    ):
        self.name, self.header, self.body = name, header, source
        self.input_names, self.output_names = list(input_names), list(output_names)
        self.absent = absent or {}
        self.scalar_names = list(scalar_names)
        self._fallback = None
        self._built: dict[tuple, tuple[str, bytes, list[int]]] = {}

    def __call__(
        self,
        *,
        inputs: Sequence[mx.array],
        template: Sequence[TemplateArg],
        grid: tuple[int, int, int],
        threadgroup: tuple[int, int, int],
        output_shapes: Sequence[Sequence[int]],
        output_dtypes: Sequence[mx.Dtype],
        scalars: dict[str, int] | None = None,
    ) -> list[mx.array]:
        shape = dict(grid=grid, threadgroup=threadgroup, output_shapes=output_shapes)
        shape["output_dtypes"] = output_dtypes
        scalars = scalars or {}
        built = None
        if self._fallback is None and available():
            built = self._build(inputs, template, output_dtypes, scalars)
        if built is None:
            types = dict(template)
            inputs = [
                placeholder(self._dtype(n, types)) if x is None else x
                for n, x in zip(self.input_names, inputs, strict=True)
            ]
            template = [*template, *((n, scalars.get(n, 0)) for n in self.scalar_names)]
            return self._mlx_kernel()(inputs=inputs, template=template, **shape)
        name, data, shaped = built
        values = [scalars[n] for n in self.scalar_names if n in scalars]
        return mx.fast.precompiled_cuda_kernel(
            name=name,
            compiled_source=data,
            inputs=[x for x in inputs if x is not None],
            scalars=[d for i in shaped for d in inputs[i].shape] + values,
            ensure_row_contiguous=True,
            **shape,
        )

    def build(
        self,
        inputs: Sequence[mx.array | None],
        template: Sequence[TemplateArg],
        output_dtypes: Sequence[mx.Dtype],
        scalars: Sequence[str] = (),
    ) -> bool:
        """Compile (or find on disk) the binary a launch with inputs of these dtypes and
        ranks, passing ``scalars`` (names), would use, without launching it; ``False``
        where binaries cannot be built here (MLX then compiles at the first launch)."""
        if self._fallback is not None or not available():
            return False
        return self._build(inputs, template, output_dtypes, scalars) is not None

    def _build(
        self,
        inputs: Sequence[mx.array | None],
        template: Sequence[TemplateArg],
        output_dtypes: Sequence[mx.Dtype],
        scalars: Sequence[str] = (),
    ) -> tuple[str, bytes, list[int]] | None:
        """``(name, cubin, shaped inputs)`` of this template set, or ``None`` if it cannot be
        built here (then MLX builds this body from now on)."""
        dtypes = [None if x is None else x.dtype for x in inputs]
        ndims = [0 if x is None else x.ndim for x in inputs]
        passed = {n: n in scalars for n in self.scalar_names}
        key = (tuple(template), *dtypes, *ndims, *output_dtypes)
        if any(passed.values()):  # (the key of a launch without scalars stays as it was)
            key += (tuple(n for n, p in passed.items() if p),)
        if key not in self._built:
            digest = hashlib.sha256(repr(key).encode()).hexdigest()[:16]
            name = f"mlx_paged_{self.name}_{digest}"
            source, shaped = render(
                name,
                self.header,
                self.body,
                self.input_names,
                dtypes,
                ndims,
                self.output_names,
                output_dtypes,
                template,
                {n: CTYPES.get(t, t) for n, t in self.absent.items()},
                passed,
            )
            try:
                self._built[key] = (name, launch_image(cubin(source, name), name), shaped)
            except (RuntimeError, OSError, AttributeError) as e:
                # Our build failed where MLX's may not: hand the body to MLX from now on.
                logger.warning("mlx_paged: %s; using mx.fast.cuda_kernel instead.", e)
                self._mlx_kernel()
                return None
        return self._built[key]

    def _mlx_kernel(self):
        """The ``mx.fast.cuda_kernel`` object for this body (MLX compiles it in each process)."""
        if self._fallback is None:
            self._fallback = mx.fast.cuda_kernel(
                self.name, self.input_names, self.output_names, self.body, header=self.header
            )
        return self._fallback

    def _dtype(self, name: str, template: dict) -> mx.Dtype:
        t = self.absent[name]
        return template[t] if isinstance(t, str) else t
