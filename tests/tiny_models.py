"""Tiny random-weight models built from mlx-lm's ModelArgs, float32 for the CPU."""

from __future__ import annotations

import importlib

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map

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
}

FAMILIES = list(CONFIGS)


def tiny_model(family: str, seed: int = 0, **config: object) -> nn.Module:
    """A float32 random-weight model of ``family`` (a key of CONFIGS), ``config`` overriding."""
    module = importlib.import_module(f"mlx_lm.models.{family}")
    args = module.ModelArgs.from_dict({**CONFIGS[family], **config})
    mx.random.seed(seed)
    model = module.Model(args)
    # Random init gives tiny logits; scale weights so tokens differ clearly.
    model.update(tree_map(lambda p: p * 2.0, model.parameters()))
    mx.eval(model.parameters())
    return model
