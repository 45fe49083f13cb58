"""Where mlx_paged keeps files between runs (converted models, compiled kernels)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """``$MLX_PAGED_CACHE``, else ``$XDG_CACHE_HOME/mlx_paged``, else ``~/.cache/mlx_paged``."""
    if os.environ.get("MLX_PAGED_CACHE"):
        return Path(os.environ["MLX_PAGED_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache")
    return Path(base) / "mlx_paged"
