"""``fuse_projections``: q/k/v and gate/up as one matmul each, with the same values."""

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten, tree_map
from mlx_lm.models.cache import make_prompt_cache
from tiny_models import CONFIGS, solo, tiny_model

from mlx_paged import PagedEngine, fuse_projections
from mlx_paged.engine.fusion import Part

PROMPT = [5, 17, 3, 99, 42, 8, 61, 23, 11, 70, 2, 33]


def size(model: nn.Module) -> int:
    return sum(p.size for _, p in tree_flatten(model.parameters()))


def logits(model: nn.Module, tokens: list[int]) -> mx.array:
    """Logits of a prompt, then of one more token, through mlx-lm's own caches."""
    cache = make_prompt_cache(model)
    first = model(mx.array(tokens)[None], cache=cache)
    return mx.concatenate([first, model(mx.array([[7]]), cache=cache)], axis=1)


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_fused_models_compute_the_same_logits_with_the_same_weights(family):
    model = tiny_model(family)
    before, params = logits(model, PROMPT), size(model)
    fuse_projections(model)
    after = logits(model, PROMPT)
    assert size(model) == params  # the parts hold no second copy
    assert mx.allclose(before, after, atol=1e-5, rtol=1e-5).item(), family


def test_a_llama_fuses_both_groups_of_every_layer():
    model = tiny_model("llama")
    qkv = [
        [layer.self_attn[n].weight for n in ("q_proj", "k_proj", "v_proj")]
        for layer in model.layers
    ]
    assert fuse_projections(model) == 2 * len(model.layers)
    for layer, weights in zip(model.layers, qkv, strict=True):
        attn, mlp = layer.self_attn, layer.mlp
        assert type(attn.fused_qkv) is nn.Linear and type(mlp.fused_gate_up) is nn.Linear
        assert mx.array_equal(attn.fused_qkv.weight, mx.concatenate(weights)).item()
        assert [attn.q_proj.i, attn.k_proj.i, attn.v_proj.i] == [0, 1, 2]
        assert all(isinstance(p, Part) for p in (attn.q_proj, mlp.gate_proj, mlp.up_proj))
        assert attn.q_proj.shared.layer is attn.fused_qkv
    assert fuse_projections(model) == 0  # nothing left to fuse


def test_quantized_layers_fuse_into_one_quantized_layer():
    model = tiny_model("llama", hidden_size=64, intermediate_size=128)
    nn.quantize(model, group_size=32, bits=4)
    before = logits(model, PROMPT)
    assert fuse_projections(model) == 2 * len(model.layers)
    fused = model.layers[0].self_attn.fused_qkv
    assert type(fused) is nn.QuantizedLinear and (fused.bits, fused.group_size) == (4, 32)
    assert mx.allclose(before, logits(model, PROMPT), atol=1e-5, rtol=1e-5).item()


def test_adapted_layers_stay_as_they_are_and_their_plain_siblings_fuse():
    from mlx_lm.tuner.utils import linear_to_lora_layers

    model = tiny_model("llama")
    config = {"rank": 4, "scale": 10.0, "dropout": 0.0, "keys": ["self_attn.q_proj"]}
    linear_to_lora_layers(model, len(model.layers), config)
    model.update(tree_map(lambda p: p + 0.01, model.trainable_parameters()))  # lora_b: not 0
    before = logits(model, PROMPT)
    assert fuse_projections(model) == len(model.layers)  # gate/up only: q_proj is a LoRA layer
    assert all("fused_qkv" not in layer.self_attn for layer in model.layers)
    assert mx.allclose(before, logits(model, PROMPT), atol=1e-5, rtol=1e-5).item()


class Projections(nn.Module):
    """Attention-like q/k/v and MLP-like gate/up projections of one embedding; ``crossed``:
    k_proj takes another input than its siblings; ``biased``: those with a bias."""

    def __init__(self, crossed: bool = False, biased: tuple[str, ...] = ()):
        super().__init__()
        self.crossed = crossed
        self.embed = nn.Embedding(16, 8)
        widths = {"q_proj": 8, "k_proj": 4, "v_proj": 4, "gate_proj": 8, "up_proj": 8}
        for name, width in widths.items():
            self[name] = nn.Linear(8, width, bias=name in biased)

    def __call__(self, tokens: mx.array) -> mx.array:
        x = self.embed(tokens)
        q, k, v = self.q_proj(x), self.k_proj(x * 2 if self.crossed else x), self.v_proj(x)
        return q.sum(-1) + k.sum(-1) + v.sum(-1) + (self.gate_proj(x) * self.up_proj(x)).sum(-1)


def test_only_groups_whose_members_take_one_input_are_fused():
    model = Projections(crossed=True)
    tokens = mx.array([[1, 2, 3]])
    before = model(tokens)
    q, k, v = model.q_proj, model.k_proj, model.v_proj
    assert fuse_projections(model) == 1  # gate/up only
    assert (model.q_proj, model.k_proj, model.v_proj) == (q, k, v)  # left as they were
    assert "fused_qkv" not in model and isinstance(model.gate_proj, Part)
    assert mx.allclose(before, model(tokens), atol=1e-6).item()


def test_biased_layers_fuse_with_their_biases_and_mixed_groups_do_not():
    model = Projections(biased=("q_proj", "gate_proj", "up_proj"))  # k and v without a bias
    tokens = mx.array([[1, 2, 3]])
    before = model(tokens)
    assert fuse_projections(model) == 1
    assert "fused_qkv" not in model and "bias" in model.fused_gate_up
    assert mx.allclose(before, model(tokens), atol=1e-6).item()


class NeedsCache(Projections):
    def __call__(self, tokens: mx.array, cache: list) -> mx.array:
        return super().__call__(tokens) + len(cache)


def test_a_model_whose_probe_forward_fails_is_left_as_it_is():
    model = NeedsCache()
    layers = [model[n] for n in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")]
    assert fuse_projections(model) == 0
    assert [model[n] for n in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")] == layers


def test_something_other_than_a_module_is_a_value_error():
    with pytest.raises(ValueError, match="takes an mlx.nn.Module, got dict"):
        fuse_projections({"q_proj": nn.Linear(2, 2)})


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_an_engine_on_a_fused_model_decodes_what_mlx_lm_does_unfused(family):
    prompts = [tuple(PROMPT), tuple(PROMPT[:5] + [90, 91, 92]), tuple(PROMPT[::-1])]
    model = tiny_model(family)
    assert fuse_projections(model) > 0
    engine = PagedEngine(model, max_batch_size=3)
    out = engine.generate([list(p) for p in prompts], max_tokens=10)
    assert out == [solo(family, p, 10) for p in prompts]
