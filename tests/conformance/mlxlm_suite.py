"""Run mlx-lm's own test suite on mlx-lm's caches and on paged ones; list what paging breaks.

    python tests/conformance/mlxlm_suite.py [--files test_prompt_cache.py ...] [-k EXPR]

Fetches the sdist of the installed mlx-lm from the package registry (``pip
download``), and runs its tests twice with pytest: once as they are, and once
with ``make_prompt_cache(model, max_kv_size)`` returning ``make_paged_cache(model,
max_kv_size=max_kv_size)`` (every name
mlx-lm and the tests bound it to). Both runs use the embedded SmolLM2 wherever
a test loads a model from the hub, so nothing else is downloaded. It prints the
tests that pass on mlx-lm's caches and fail on paged ones, and exits 1 if there
are any. Models whose layout mlx_paged refuses (e.g. llama4's chunked
attention) keep mlx-lm's caches in the paged run; they are listed too.

Not part of ``python -m pytest``: it takes minutes and needs the registry.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tarfile
import tempfile
import xml.etree.ElementTree as ET
from importlib.metadata import version
from pathlib import Path

DEFAULT_FILES = ["test_prompt_cache.py", "test_generate.py", "test_models.py", "test_server.py"]

# Tests that fail paged by design, with the reason; listed apart, not counted as regressions.
EXPECTED = {
    "tests.test_prompt_cache.TestPromptCache.test_cache_to_quantized": (
        "to_quantized refuses (ValueError) until the quantized cold tier exists"
    ),
    "tests.test_server.TestServerKVCacheQuantization.test_completion_quantizes_the_cache": (
        "to_quantized refuses (ValueError) until the quantized cold tier exists"
    ),
}

# Written next to mlx-lm's tests as their conftest.py; MLX_PAGED_MODE picks the run.
CONFTEST = '''
import os
import sys

import mlx.core as mx
import mlx_lm
import mlx_lm.utils

from mlx_paged.embedded import load_model

mx.set_default_device(mx.cpu)
_load = mlx_lm.utils.load


def _local_load(path, *args, **kwargs):
    """Hub models are replaced by the embedded SmolLM2; local paths load as usual."""
    if os.path.exists(str(path)):
        return _load(path, *args, **kwargs)
    return load_model()


mlx_lm.utils.load = mlx_lm.load = _local_load

if os.environ.get("MLX_PAGED_MODE") == "paged":
    import mlx_lm.models.cache as cache_module

    from mlx_paged import make_paged_cache

    _original = cache_module.make_prompt_cache
    FALLBACKS = []
    PAGED = []

    def make_prompt_cache(model, max_kv_size=None):
        try:
            caches = make_paged_cache(model, max_kv_size=max_kv_size)
            PAGED.append(1)
            return caches
        except ValueError as e:  # a layout mlx_paged refuses: keep mlx-lm's caches
            FALLBACKS.append(str(e).split(":")[0])
            return _original(model, max_kv_size)

    def _rebind():
        this = sys.modules[__name__]
        for module in list(sys.modules.values()):
            if module is None or module is this:
                continue
            for name, value in list(vars(module).items()):
                if value is _original:
                    setattr(module, name, make_prompt_cache)

    _rebind()

    def pytest_collection_finish(session):
        _rebind()  # the test modules bound the name while being collected

    def pytest_sessionfinish(session):
        path = os.environ.get("MLX_PAGED_FALLBACKS")
        if path:
            with open(path, "w") as f:
                f.write("\\n".join([str(len(PAGED))] + sorted(set(FALLBACKS))))
'''


def fetch_tests(dest: Path) -> Path:
    """Download and unpack the installed mlx-lm's sdist; return its tests folder."""
    want = version("mlx-lm")
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
         "-d", str(dest), f"mlx-lm=={want}"],
        check=True,
    )  # fmt: skip
    (sdist,) = dest.glob("mlx_lm-*.tar.gz")
    with tarfile.open(sdist) as tar:
        tar.extractall(dest, filter="data")
    tests = dest / f"mlx_lm-{want}" / "tests"
    (tests / "conftest.py").write_text(CONFTEST)
    return tests


def run(tests: Path, files: list[str], mode: str, extra: list[str]) -> tuple[dict, list[str]]:
    """Run the files in ``mode`` ("dense" or "paged").

    Returns {test id: outcome} and, for the paged run, the number of paged cache
    lists made followed by the model types that kept mlx-lm's caches.
    """
    report = tests / f"{mode}.xml"
    fallbacks = tests / f"{mode}-fallbacks.txt"
    env = {"MLX_PAGED_MODE": mode, "MLX_PAGED_FALLBACKS": str(fallbacks)}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *files]
    cmd += [f"--junitxml={report}", *extra]
    print(f"[{mode}] {' '.join(cmd[1:])}", flush=True)
    subprocess.run(cmd, cwd=tests, env={**os.environ, **env}, check=False)
    outcomes = {}
    for case in ET.parse(report).iter("testcase"):
        test_id = f"{case.get('classname')}.{case.get('name')}"
        tags = {child.tag for child in case}
        outcomes[test_id] = (
            "failed"
            if tags & {"failure", "error"}
            else "skipped"
            if "skipped" in tags
            else "passed"
        )
    names = fallbacks.read_text().split() if fallbacks.exists() else []
    return outcomes, names


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", nargs="+", default=DEFAULT_FILES)
    parser.add_argument("-k", help="pytest -k expression, to run part of the suite")
    parser.add_argument("--keep", help="unpack the sdist here (default: a temporary folder)")
    args = parser.parse_args()
    extra = ["-k", args.k] if args.k else []
    with tempfile.TemporaryDirectory() as tmp:
        tests = fetch_tests(Path(args.keep or tmp))
        dense, _ = run(tests, args.files, "dense", extra)
        paged, (made, *fallbacks) = run(tests, args.files, "paged", extra)
    count = {
        m: sum(o == "passed" for o in r.values()) for m, r in (("dense", dense), ("paged", paged))
    }
    lost = sorted(t for t, o in dense.items() if o == "passed" and paged.get(t) != "passed")
    broken = [t for t in lost if t not in EXPECTED]
    print(f"mlx-lm {version('mlx-lm')}: {len(dense)} tests; passed dense {count['dense']}, "
          f"paged {count['paged']}; paged cache lists made: {made}")  # fmt: skip
    if fallbacks:
        print(f"kept mlx-lm's caches (layout mlx_paged refuses): {', '.join(fallbacks)}")
    for t in lost:
        if t in EXPECTED:
            print(f"expected to fail paged: {t} ({EXPECTED[t]})")
    print(f"pass dense, fail paged: {len(broken)}")
    for t in broken:
        print(f"  {t}")
    sys.exit(1 if broken else 0)


if __name__ == "__main__":
    main()
