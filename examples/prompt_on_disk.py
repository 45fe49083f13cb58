"""Keep a prompt's K/V on disk with ``make_paged_cache``, and reuse it in the next process.

Run it twice with the same directory: the first run computes the prompt and
saves its blocks; the second loads them and computes only the prompt's last
tokens. Both print the same tokens as mlx-lm's own cache. The model is a small
random-weight llama (no download), so the text is gibberish.

    python examples/prompt_on_disk.py --dir /tmp/kv    # loaded 0 tokens
    python examples/prompt_on_disk.py --dir /tmp/kv    # loaded 288 tokens

With ``--hybrid`` the model is a small Qwen3.5-shaped hybrid, whose recurrent
layers' state must be saved where a load ends: the first run computes the
prompt up to its last block boundary, saves the blocks and the state there, and
then runs the rest.
"""

from __future__ import annotations

import argparse
import time

import mlx.core as mx
from mlx.utils import tree_map
from mlx_lm.generate import generate_step
from mlx_lm.models import llama, qwen3_5
from mlx_lm.models.cache import make_prompt_cache

from mlx_paged import load_prefix, make_paged_cache, save_prefix


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", required=True, help="the directory the prompt's blocks go to")
    ap.add_argument("--tokens", type=int, default=300, help="the prompt's length")
    ap.add_argument("--max-tokens", type=int, default=10)
    ap.add_argument("--hybrid", action="store_true", help="a Qwen3.5-shaped hybrid model")
    args = ap.parse_args()
    shape = dict(hidden_size=256, num_hidden_layers=4, intermediate_size=512, vocab_size=1000)
    heads = dict(num_attention_heads=8, num_key_value_heads=2, rms_norm_eps=1e-5)
    mx.random.seed(0)
    if args.hybrid:  # three GatedDeltaNet layers to one of attention
        linear = dict(linear_num_value_heads=4, linear_num_key_heads=2, linear_conv_kernel_dim=4)
        linear.update(linear_key_head_dim=32, linear_value_head_dim=32, full_attention_interval=4)
        model = qwen3_5.Model(
            qwen3_5.ModelArgs.from_dict(dict(model_type="qwen3_5", **shape, **heads, **linear))
        )
    else:
        model = llama.Model(llama.ModelArgs(model_type="llama", **shape, **heads))
    model.update(tree_map(lambda p: p * 3.0, model.parameters()))  # varied tokens
    prompt = mx.random.randint(0, shape["vocab_size"], (args.tokens,), key=mx.random.key(1))
    prompt = prompt.tolist()

    def generate(tokens: list[int], cache: list) -> list[int]:
        steps = generate_step(
            mx.array(tokens), model, prompt_cache=cache, max_tokens=args.max_tokens
        )
        return [tok for tok, _ in steps]

    cache = make_paged_cache(model, block_size=16, kv_disk_dir=args.dir, kv_disk_bytes=10**9)
    start = time.perf_counter()
    n = load_prefix(cache, prompt)
    if args.hybrid:  # run the prompt to its last block boundary and save there, state and all
        end = (len(prompt) - 1) // 16 * 16
        if n < end:
            model(mx.array(prompt[n:end])[None], cache=cache)
            mx.eval([c.state for c in cache])
        saved = save_prefix(cache, prompt[:end])
        out = generate(prompt[end:], cache)
    else:
        out = generate(prompt[n:], cache)
        saved = save_prefix(cache, prompt)
    print(f"loaded {n} tokens from disk; first {args.max_tokens} tokens in "
          f"{time.perf_counter() - start:.3f} s")  # fmt: skip
    print("tokens:", out)
    print("same as dense:", out == generate(prompt, make_prompt_cache(model)))
    print(f"saved: a load can take the first {saved} tokens")


if __name__ == "__main__":
    main()
