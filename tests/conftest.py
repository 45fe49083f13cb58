import sys
from pathlib import Path

import mlx.core as mx
import pytest

# Make tests/tiny_models.py importable as a plain module.
sys.path.insert(0, str(Path(__file__).parent))

# Before mlx-lm is imported: it makes its generation stream on the default device then.
mx.set_default_device(mx.cpu)


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: runs on the GPU (every other test runs on the CPU)")


@pytest.fixture(autouse=True)
def _device(request):
    """Run tests on the CPU, where float32 matmuls are exact, unless marked ``gpu``.

    On a CUDA machine the GPU would otherwise be the default device, and its TF32
    matmuls move float32 results past the parity tolerances.
    """
    before = mx.default_device()
    want = mx.gpu if request.node.get_closest_marker("gpu") else mx.cpu
    mx.set_default_device(want)
    yield
    mx.set_default_device(before)
