"""Tiny random-weight models built from mlx-lm's ModelArgs, float32 for the CPU."""

from __future__ import annotations

import importlib
import json
import shutil
from functools import cache
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map

VOCAB = 128

_COMMON = dict(
    hidden_size=64,
    num_hidden_layers=4,
    intermediate_size=96,
    num_attention_heads=4,
    num_key_value_heads=2,
    rms_norm_eps=1e-5,
    vocab_size=VOCAB,
)

# Sliding windows are small so the prompts below cross them and drop blocks.
CONFIGS: dict[str, dict] = {
    "llama": dict(_COMMON, model_type="llama"),
    "qwen3": dict(
        _COMMON,
        model_type="qwen3",
        head_dim=16,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        rope_theta=10000.0,
    ),
    "qwen3_moe": dict(
        _COMMON,
        model_type="qwen3_moe",
        num_experts=4,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        moe_intermediate_size=32,
        head_dim=16,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        max_position_embeddings=512,
        norm_topk_prob=True,
    ),
    "ministral3": dict(
        _COMMON,
        model_type="ministral3",
        head_dim=16,
        sliding_window=20,
        layer_types=["sliding_attention", "full_attention"] * 2,
        rope_parameters={
            "rope_theta": 10000.0,
            "rope_type": "default",
            "llama_4_scaling_beta": 0.1,
            "original_max_position_embeddings": 512,
        },
    ),
    "gemma3_text": dict(
        _COMMON,
        model_type="gemma3_text",
        head_dim=16,
        query_pre_attn_scalar=16,
        sliding_window=24,
        sliding_window_pattern=2,
        max_position_embeddings=512,
    ),
    "gpt_oss": dict(
        _COMMON,
        model_type="gpt_oss",
        num_local_experts=4,
        num_experts_per_tok=2,
        head_dim=16,
        sliding_window=20,
        layer_types=["sliding_attention", "full_attention"] * 2,
    ),
    "deepseek_v3": dict(
        _COMMON,
        model_type="deepseek_v3",
        num_key_value_heads=4,
        moe_intermediate_size=32,
        n_shared_experts=1,
        n_routed_experts=4,
        num_experts_per_tok=2,
        kv_lora_rank=32,
        q_lora_rank=48,
        qk_rope_head_dim=8,
        v_head_dim=16,
        qk_nope_head_dim=16,
        first_k_dense_replace=1,
        topk_method="noaux_tc",
        n_group=1,
        topk_group=1,
    ),
    # Hybrid: short-convolution layers keep mlx-lm's ArraysCache, attention layers page.
    "lfm2": dict(
        _COMMON,
        model_type="lfm2",
        max_position_embeddings=512,
        norm_eps=1e-5,
        conv_bias=False,
        conv_L_cache=3,
        block_dim=64,
        block_multiple_of=16,
        block_ffn_dim_multiplier=1.0,
        block_auto_adjust_ff_dim=False,
        layer_types=["conv", "full_attention", "conv", "full_attention"],
    ),
    # Gated-delta layers (ArraysCache) alternate with gated attention (KVCache).
    # qwen3_5 wraps a text model; a config without text_config is taken as that.
    "qwen3_5": dict(
        _COMMON,
        model_type="qwen3_5",
        head_dim=16,
        max_position_embeddings=512,
        linear_num_value_heads=4,
        linear_num_key_heads=2,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        full_attention_interval=2,
        rope_parameters={"type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    ),
    "qwen3_next": dict(
        _COMMON,
        model_type="qwen3_next",
        head_dim=16,
        max_position_embeddings=512,
        linear_num_value_heads=4,
        linear_num_key_heads=2,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        full_attention_interval=2,
        num_experts=4,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        shared_expert_intermediate_size=32,
        mlp_only_layers=[],
        moe_intermediate_size=32,
        rope_theta=10000.0,
        partial_rotary_factor=0.5,
        norm_topk_prob=True,
    ),
    # Mamba2 layers (ArraysCache) and attention layers (KVCache). A small dt cap (here and
    # in nemotron_h, mamba2) keeps the SSM state alive past a 16-token chunk.
    "granitemoehybrid": dict(
        _COMMON,
        model_type="granitemoehybrid",
        max_position_embeddings=512,
        attention_bias=False,
        embedding_multiplier=1.0,
        attention_multiplier=0.25,
        logits_scaling=1.0,
        residual_multiplier=1.0,
        layer_types=["mamba", "attention", "mamba", "attention"],
        num_local_experts=4,
        num_experts_per_tok=2,
        shared_intermediate_size=32,
        mamba_n_heads=4,
        mamba_d_head=16,
        mamba_proj_bias=False,
        mamba_d_state=16,
        mamba_d_conv=4,
        mamba_n_groups=1,
        mamba_conv_bias=True,
        time_step_limit=(0.0, 0.1),
    ),
    # The MLP block ("-") has no cache, so the cache list is shorter than the layers.
    "nemotron_h": dict(
        _COMMON,
        model_type="nemotron_h",
        max_position_embeddings=512,
        attention_bias=False,
        head_dim=16,
        hybrid_override_pattern=["M", "*", "-", "M", "*"],
        mamba_num_heads=4,
        mamba_head_dim=16,
        mamba_proj_bias=False,
        ssm_state_size=16,
        conv_kernel=4,
        n_groups=2,
        mlp_bias=False,
        layer_norm_epsilon=1e-5,
        use_bias=False,
        use_conv_bias=True,
        time_step_limit=(0.0, 0.1),
    ),
    # Every layer runs Mamba2 and attention side by side: CacheList(ArraysCache, KVCache).
    "falcon_h1": dict(
        _COMMON,
        model_type="falcon_h1",
        head_dim=16,
        max_position_embeddings=512,
        rope_theta=10000.0,
        embedding_multiplier=1.0,
        lm_head_multiplier=1.0,
        mamba_d_conv=4,
        mamba_d_head=16,
        mamba_d_ssm=64,
        mamba_d_state=16,
        mamba_n_groups=1,
        mamba_n_heads=4,
        mamba_rms_norm=True,
    ),
    # Mamba layers at even indices, attention at odd ones (with MoE).
    "jamba": dict(
        _COMMON,
        model_type="jamba",
        max_position_embeddings=512,
        attn_layer_offset=1,
        attn_layer_period=2,
        expert_layer_offset=1,
        expert_layer_period=2,
        num_experts=4,
        num_experts_per_tok=2,
        mamba_d_conv=4,
        mamba_d_state=8,
        mamba_expand=2,
    ),
    # Pure recurrent: every layer keeps an ArraysCache.
    "mamba2": dict(
        _COMMON,
        model_type="mamba2",
        num_heads=8,  # x head_dim = hidden x expand (2), as transformers' config check wants
        head_dim=16,
        intermediate_size=128,
        state_size=16,
        layer_norm_epsilon=1e-5,
        conv_kernel=4,
        n_groups=1,
        use_bias=False,
        use_conv_bias=True,
        tie_word_embeddings=False,
        time_step_limit=(0.0, 0.1),
        time_step_rank="auto",
    ),
    "mamba": dict(
        _COMMON,
        model_type="mamba",
        intermediate_size=128,
        state_size=8,
        conv_kernel=4,
        use_bias=False,
        use_conv_bias=True,
        time_step_rank="auto",
    ),
    # Its zero-initialised parameters are filled at random (see tiny_model).
    "rwkv7": dict(
        _COMMON,
        model_type="rwkv7",
        intermediate_size=128,
        norm_eps=1e-5,
        head_dim=16,
        a_low_rank_dim=16,
        v_low_rank_dim=16,
        gate_low_rank_dim=16,
        decay_low_rank_dim=16,
    ),
}

#: More hybrids, built only where a test names them (their batched prefills): not in FAMILIES.
MORE_HYBRIDS: dict[str, dict] = {
    "lfm2_moe": dict(
        CONFIGS["lfm2"],
        model_type="lfm2_moe",
        moe_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        use_expert_bias=False,
        num_dense_layers=1,
    ),
    # Mamba layers alternate with sliding-window attention.
    "plamo2": dict(
        _COMMON,
        model_type="plamo2",
        hidden_size_per_head=16,
        max_position_embeddings=512,
        attention_window_size=512,
        mamba_d_state=8,
        mamba_d_conv=4,
        mamba_num_heads=4,
        mamba_step=2,
        mamba_chunk_size=16,
    ),
    # Kimi delta attention in every second layer, MLA attention in the others.
    "bailing_moe_v3": dict(
        _COMMON,
        model_type="bailing_moe_v3",
        moe_intermediate_size=32,
        moe_shared_expert_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        num_shared_experts=1,
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
        layer_group_size=2,
        head_dim=16,
        q_lora_rank=16,
        kv_lora_rank=16,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        rope_theta=10000.0,
        max_position_embeddings=512,
    ),
    # Kimi delta attention layers (1 and 3) and MLA full attention (2 and 4).
    "kimi_linear": dict(
        _COMMON,
        model_type="kimi_linear",
        num_key_value_heads=4,
        head_dim=16,
        rope_theta=10000.0,
        model_max_length=512,
        num_experts=4,
        num_experts_per_token=2,
        first_k_dense_replace=1,
        moe_intermediate_size=32,
        kv_lora_rank=16,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        linear_attn_config={
            "kda_layers": [1, 3],
            "full_attn_layers": [2, 4],
            "num_heads": 4,
            "head_dim": 16,
            "short_conv_kernel_size": 4,
        },
    ),
    # Short-convolution mixers (two conv states) between full and sliding-window attention.
    "gear": dict(
        _COMMON,
        model_type="gear",
        head_dim=16,
        layer_types=["conv_mixer", "full_attention", "conv_mixer", "sliding_attention"],
        sliding_window=24,
        max_position_embeddings=512,
    ),
}
# Linear attention (a gated recurrence) beside MLA, as bailing_moe_v3's layers are grouped.
MORE_HYBRIDS["bailing_hybrid"] = dict(
    MORE_HYBRIDS["bailing_moe_v3"],
    model_type="bailing_hybrid",
    group_norm_size=2,
    routed_scaling_factor=1.0,
)
# qwen3_5's layers with a mixture of experts in every MLP.
MORE_HYBRIDS["qwen3_5_moe"] = dict(
    CONFIGS["qwen3_5"],
    model_type="qwen3_5_moe",
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=32,
    decoder_sparse_step=1,
    norm_topk_prob=True,
    mlp_only_layers=[],
)
# Kimi delta attention and MLA, with kimi_k3's own activation and a query LoRA.
MORE_HYBRIDS["kimi_k3"] = dict(
    {k: v for k, v in MORE_HYBRIDS["kimi_linear"].items() if k not in ("head_dim", "rope_theta")},
    model_type="kimi_k3",
    activation_situ_beta=1.0,
    activation_situ_linear_beta=0.5,
    q_lora_rank=16,
)

#: Families with recurrent (ArraysCache) layers beside attention.
HYBRIDS = ["lfm2", "qwen3_5", "qwen3_next", "granitemoehybrid", "nemotron_h", "falcon_h1", "jamba"]
#: Families with recurrent layers only: nothing of theirs is paged outside PagedEngine.
RECURRENT_ONLY = ["mamba2", "mamba", "rwkv7"]
#: Families whose attention layers make_paged_cache pages (parity tests).
FAMILIES = [f for f in CONFIGS if f not in RECURRENT_ONLY]

# mlx-lm zero-inits rwkv7's token-shift mixes, k_k/k_a/r_k and g_norm, so its time mixing
# adds nothing and the cache never reaches the logits; these get random values instead.
_FILL_ZEROS = {"rwkv7"}


def tiny_model(family: str, seed: int = 0, **config: object) -> nn.Module:
    """A float32 random-weight model of ``family`` (a key of CONFIGS), ``config`` overriding."""
    module = importlib.import_module(f"mlx_lm.models.{family}")
    args = module.ModelArgs.from_dict({**(CONFIGS | MORE_HYBRIDS)[family], **config})
    mx.random.seed(seed)
    model = module.Model(args)
    # Random init gives tiny logits; scale weights so tokens differ clearly.
    model.update(tree_map(lambda p: p * 2.0, model.parameters()))
    if family in _FILL_ZEROS:
        model.update(
            tree_map(
                lambda p: p if mx.any(p).item() else mx.random.uniform(shape=p.shape),
                model.parameters(),
            )
        )
    mx.eval(model.parameters())
    return model


def save_tiny_model(family: str, path: Path, tokenizer_dir: Path, **config: object) -> Path:
    """Write ``tiny_model(family, **config)`` as an mlx-lm model directory (config, weights
    and the tokenizer files of ``tokenizer_dir``) that ``mlx_lm.load`` and the servers read."""
    model = tiny_model(family, **config)
    path.mkdir(parents=True, exist_ok=True)
    cfg = {**CONFIGS[family], **config}
    (path / "config.json").write_text(json.dumps(cfg))
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(model.parameters())))
    for f in tokenizer_dir.iterdir():
        if f.name.startswith(("tokenizer", "chat_template", "special_tokens")):
            shutil.copy(f, path / f.name)
    return path


@cache
def model_of(family: str) -> nn.Module:
    """``tiny_model(family)``, built once per test process."""
    return tiny_model(family)


@cache
def solo(family: str, prompt: tuple[int, ...], max_tokens: int) -> list[int]:
    """Greedy tokens of one request alone, on mlx-lm's own caches of ``model_of(family)``."""
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache

    model = model_of(family)
    steps = generate_step(
        mx.array(prompt), model, prompt_cache=make_prompt_cache(model), max_tokens=max_tokens
    )
    return [tok for tok, _ in steps]


def record_forwards(engine, monkeypatch) -> list[tuple[int, tuple[int, ...] | None]]:
    """``(n, counts)`` of every batched prefill forward ``engine`` runs from now on."""
    calls: list[tuple[int, tuple[int, ...] | None]] = []
    forward = engine.runner.forward

    def spy(reqs, n, logits=False, counts=None, wait=True):
        calls.append((n, counts))
        return forward(reqs, n, logits, counts, wait)

    monkeypatch.setattr(engine.runner, "forward", spy)
    return calls
