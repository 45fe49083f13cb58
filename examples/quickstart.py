"""Generate with mlx-lm on a paged KV cache, and compare with the dense cache.

Runs anywhere MLX runs, with no download: the model is a small random-weight
llama, so the text is gibberish but identical on both caches.

    python examples/quickstart.py
"""

from __future__ import annotations

import mlx.core as mx
from mlx.utils import tree_map
from mlx_lm.generate import generate_step
from mlx_lm.models import llama
from mlx_lm.models.cache import make_prompt_cache

from mlx_paged import make_paged_cache


def main() -> None:
    args = llama.ModelArgs(
        model_type="llama",
        hidden_size=256,
        num_hidden_layers=4,
        intermediate_size=512,
        num_attention_heads=8,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        vocab_size=1000,
    )
    mx.random.seed(0)
    model = llama.Model(args)
    # Random init gives near-uniform logits; larger weights give varied tokens.
    model.update(tree_map(lambda p: p * 3.0, model.parameters()))
    prompt = mx.random.randint(0, args.vocab_size, (100,), key=mx.random.key(1))

    def tokens(cache: list) -> list[int]:
        steps = generate_step(prompt, model, prompt_cache=cache, max_tokens=20)
        return [tok for tok, _ in steps]

    paged_cache = make_paged_cache(model, block_size=16)
    paged = tokens(paged_cache)
    dense = tokens(make_prompt_cache(model))
    print("paged tokens:", paged)
    print("same as dense:", paged == dense)
    print(paged_cache[0].stats())


if __name__ == "__main__":
    main()
