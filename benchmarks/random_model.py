"""Write an mlx-lm model directory with random weights in a real model's shape.

    python benchmarks/random_model.py SRC_DIR OUT_DIR [DTYPE]     # DTYPE: float16 (default)

Copies ``SRC_DIR``'s config (without its quantization) and tokenizer files, and
saves freshly initialised weights: a stand-in for benchmarks on machines the
real weights cannot reach. Greedy decoding on random weights rarely meets EOS,
so every request generates its full ``max_tokens``.
"""

from __future__ import annotations

import importlib
import json
import shutil
import sys
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def main() -> None:
    src, out = Path(sys.argv[1]), Path(sys.argv[2])
    dtype = getattr(mx, sys.argv[3] if len(sys.argv) > 3 else "float16")
    config = json.loads((src / "config.json").read_text())
    for key in ("quantization", "quantization_config"):
        config.pop(key, None)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for name in TOKENIZER_FILES:
        if (src / name).exists():
            shutil.copy(src / name, out / name)
    module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    model = module.Model(module.ModelArgs.from_dict(config))
    weights = {k: v.astype(dtype) for k, v in tree_flatten(model.parameters())}
    mx.save_safetensors(str(out / "model.safetensors"), weights)
    print(f"{out}: {sum(v.size for v in weights.values()) / 1e6:.1f}M parameters, {dtype}")


if __name__ == "__main__":
    main()
