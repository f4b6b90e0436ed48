"""The HTTP layer over an echo engine (tests/serve/fakes.py: its answer to a prompt is the prompt itself, then EOS):
the responses' shapes, streamed and whole, stop strings, every client error as a 4xx OpenAI error object, the API
key, the body limit, draining and a failed engine as 503 / 500, a cancelled job's slot freed."""

from __future__ import annotations

import asyncio
import json
import time

import jax
import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from mtp_jax.serve.app import Served, create_app
from mtp_jax.serve.inputs import Limits
from mtp_jax.serve.metrics import Metrics
from mtp_jax.serve.worker import Job, Worker
from tests.serve.fakes import VOCAB, ByteTokenizer, EchoEngine

MAX_LEN = 128


def serve(engine: EchoEngine | None = None, **options) -> tuple[TestClient, Served, EchoEngine]:
    engine = engine or EchoEngine(max_len=MAX_LEN)
    tokenizer, metrics = ByteTokenizer(), Metrics("echo")
    worker = Worker(engine, tokenizer, metrics)
    worker.start()
    served = Served(worker, tokenizer, "echo", Limits(engine.max_len, VOCAB, 1024), metrics)
    return TestClient(create_app(served, **options)), served, engine


@pytest.fixture
def server():
    client, served, engine = serve()
    with client:
        yield client, served, engine


def events(response) -> list:
    """The data of a server-sent event stream: JSON objects, and "[DONE]"."""
    text = response.text
    assert text.endswith("\n\n")
    data = []
    for block in text.split("\n\n")[:-1]:
        assert block.startswith("data: "), block
        payload = block.removeprefix("data: ")
        data.append(payload if payload == "[DONE]" else json.loads(payload))
    return data


def test_a_completion_is_the_echo_with_usage_and_finish_reason(server):
    client, _, engine = server
    r = client.post("/v1/completions", json={"model": "echo", "prompt": "hello", "max_tokens": 10, "temperature": 0,
                                             "seed": 5, "top_k": 3, "top_p": 0.5})  # fmt: skip
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["object"] == "text_completion" and out["model"] == "echo" and out["id"].startswith("cmpl-")
    assert out["choices"] == [{"index": 0, "text": "hello", "logprobs": None, "finish_reason": "stop"}]
    assert out["usage"] == {"prompt_tokens": 5, "completion_tokens": 6, "total_tokens": 11}  # EOS counted
    request = engine.submitted[-1]
    assert (tuple(request.prompt_ids), request.max_tokens) == (tuple(b"hello"), 10)
    assert (request.temperature, request.seed, request.top_k, request.top_p) == (0.0, 5, 3, 0.5)
    r = client.post("/v1/completions", json={"prompt": [104, 105, 106], "max_tokens": 2})
    assert r.json()["choices"][0]["text"] == "hi" and r.json()["choices"][0]["finish_reason"] == "length"
    assert engine.submitted[-1].temperature == 1.0  # OpenAI's default


def test_without_a_seed_each_request_draws_its_own(server):
    client, _, engine = server
    for _ in range(3):
        client.post("/v1/completions", json={"prompt": "a", "max_tokens": 1})
    assert len({r.seed for r in engine.submitted}) == 3


def test_a_chat_completion_goes_through_the_chat_template(server):
    client, _, engine = server
    messages = [{"role": "developer", "content": "brief"}, {"role": "user", "content": "hi"}]
    r = client.post("/v1/chat/completions", json={"messages": messages, "max_completion_tokens": 40})
    assert r.status_code == 200, r.text
    out = r.json()
    template = "<system>brief<user>hi<assistant>"
    assert out["object"] == "chat.completion" and out["id"].startswith("chatcmpl-")
    assert out["choices"][0]["message"] == {"role": "assistant", "content": template}
    assert out["usage"]["prompt_tokens"] == len(template) and tuple(engine.submitted[-1].prompt_ids) == tuple(
        template.encode()
    )
    assert engine.submitted[-1].max_tokens == 40
    client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
    assert engine.submitted[-1].max_tokens == MAX_LEN - len(b"<user>x<assistant>")  # no budget: the rest of a slot


def test_a_streamed_completion_adds_up_to_the_whole_one(server):
    client, _, _ = server
    prompt = "a longer prompt, streamed in pieces"
    whole = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 50}).json()
    r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 50, "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    data = events(r)
    assert data[-1] == "[DONE]"
    chunks = data[:-1]
    assert len(chunks) > 2 and all(c["object"] == "text_completion" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1 and "usage" not in chunks[0]
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"] == prompt
    assert [c["choices"][0]["finish_reason"] for c in chunks][-2:] == [None, "stop"]


def test_a_streamed_chat_opens_the_message_and_ends_with_usage_when_asked(server):
    client, _, _ = server
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "stream me"}],
                    "max_tokens": 9, "stream": True, "stream_options": {"include_usage": True}})  # fmt: skip
    data = events(r)
    assert data[-1] == "[DONE]"
    chunks = data[:-1]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    content = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[:-1])
    assert content == "<user>str"  # the echo's first 9 tokens
    assert chunks[-2]["choices"][0]["finish_reason"] == "length" and chunks[-2]["usage"] is None
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == {"prompt_tokens": 26, "completion_tokens": 9,
                                                                    "total_tokens": 35}  # fmt: skip


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_string_ends_the_answer_and_cancels_the_request(server, stream):
    client, _, engine = server
    r = client.post("/v1/completions", json={"prompt": "one two three four", "max_tokens": 30, "stop": ["hre", "x"],
                                             "stream": stream})  # fmt: skip
    if stream:
        chunks = events(r)[:-1]
        text = "".join(c["choices"][0]["text"] for c in chunks)
        reason = chunks[-1]["choices"][0]["finish_reason"]
    else:
        text, reason = r.json()["choices"][0]["text"], r.json()["choices"][0]["finish_reason"]
    assert (text, reason) == ("one two t", "stop")
    assert engine.cancelled == [len(engine.submitted) - 1]  # the echo went on: cancelled in the engine


@pytest.mark.parametrize(
    ("path", "content", "status", "param", "code"),
    [
        ("/v1/completions", b'{"prompt": "x"', 400, None, None),
        ("/v1/completions", b'{"prompt": "x", "logit_bias": {}}', 400, "logit_bias", None),
        ("/v1/completions", b'{"prompt": "x", "max_tokens": "5"}', 400, "max_tokens", None),
        ("/v1/completions", b'{"prompt": "x", "model": "gpt-5"}', 404, "model", "model_not_found"),
        ("/v1/completions", b'{"prompt": "' + b"y" * 125 + b'", "max_tokens": 5}', 400, "max_tokens", None),
        ("/v1/completions", b'{"prompt": ""}', 400, "prompt", None),
        ("/v1/completions", b'{"prompt": [1, 999]}', 400, "prompt", None),
        ("/v1/chat/completions", b'{"messages": []}', 400, "messages", None),
        ("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "z" * 130}]}).encode(), 400,
         "messages", None),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "n": 3}', 400, "n", None),
        ("/v1/nothing", b"{}", 404, None, None),
    ],
)  # fmt: skip
def test_what_the_client_sent_wrong_is_a_4xx_error_object(server, path, content, status, param, code):
    client, _, engine = server
    r = client.post(path, content=content, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["message"] and (error["param"], error["code"]) == (param, code)
    assert error["type"] == "invalid_request_error"
    assert not engine.submitted


def test_other_routes_and_methods(server):
    client, _, _ = server
    assert client.get("/health").json() == {"status": "ok"}
    models = client.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["echo"] and models["data"][0]["max_model_len"] == MAX_LEN
    assert client.get("/v1/models/echo").json()["id"] == "echo"
    assert client.get("/v1/models/other").json()["error"]["code"] == "model_not_found"
    r = client.get("/v1/completions")
    assert r.status_code == 405 and "method not allowed" in r.json()["error"]["message"]
    assert client.get("/nowhere").status_code == 404 and client.get("/nowhere").json()["error"]["message"]


def test_a_body_past_the_limit_is_refused_whole_or_chunked():
    client, _, engine = serve(max_body_bytes=100)
    with client:
        big = json.dumps({"prompt": "x" * 200}).encode()
        r = client.post("/v1/completions", content=big, headers={"content-type": "application/json"})
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
        chunked = client.post("/v1/completions", content=iter([big[:60], big[60:]]))  # no Content-Length
        assert chunked.status_code == 413
        assert client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}).status_code == 200
        assert len(engine.submitted) == 1


def test_an_api_key_guards_the_api_but_not_health():
    client, _, _ = serve(api_key="sesame")
    with client:
        request = {"prompt": "x", "max_tokens": 1}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sesame"}):
            r = client.post("/v1/completions", json=request, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert client.get("/v1/models").status_code == 401
        good = {"Authorization": "Bearer sesame"}
        assert client.post("/v1/completions", json=request, headers=good).status_code == 200
        assert client.get("/health").status_code == 200 and client.get("/metrics").status_code == 200


def test_metrics_count_the_requests(server):
    client, _, _ = server
    client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 10})
    client.post("/v1/completions", json={"prompt": "abcdef", "max_tokens": 2})
    r = client.get("/metrics")
    assert r.headers["content-type"].startswith("text/plain")
    samples = {(s.name, s.labels.get("finished_reason")): s.value
               for f in text_string_to_metric_families(r.text) for s in f.samples}  # fmt: skip
    assert samples[("mtp_jax:request_success_total", "stop")] == 1
    assert samples[("mtp_jax:request_success_total", "length")] == 1
    assert samples[("mtp_jax:prompt_tokens_total", None)] == 9
    assert samples[("mtp_jax:generation_tokens_total", None)] == 4 + 2
    assert samples[("mtp_jax:num_requests_running", None)] == 0
    assert samples[("mtp_jax:spec_decode_num_accepted_tokens_total", None)] == 9  # the echo engine's stats


def test_a_draining_server_refuses_new_requests(server):
    client, served, _ = server
    served.draining = True
    assert client.post("/v1/completions", json={"prompt": "x"}).status_code == 503
    assert client.get("/health").status_code == 503


def test_a_failed_engine_is_a_500_then_503():
    client, _, engine = serve()
    with client:
        engine.fail = True
        r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 3})
        assert r.status_code == 500 and "fell over" in r.json()["error"]["message"]
        assert r.json()["error"]["type"] == "server_error"
        assert client.get("/health").status_code == 503
        assert client.post("/v1/completions", json={"prompt": "x", "max_tokens": 3}).status_code == 503


def test_every_64_bit_seed_has_its_own_stream():
    seeds = [0, 1, 2**32 - 1, 2**32, 2**40, -1, -(2**63), 2**63 - 1]
    requests = [Job((1,), 1, 1.0, 1.0, 0, seed, (), None, None).request() for seed in seeds]
    keys = {tuple(jax.random.key_data(r.key if r.key is not None else jax.random.key(r.seed)).tolist())
            for r in requests}  # fmt: skip
    assert len(keys) == len(seeds)
    assert requests[1].key is None and requests[1].seed == 1  # a 32-bit seed: the engine makes key(seed)


def test_a_cancelled_job_frees_its_slot_at_the_next_step():
    engine = EchoEngine(max_len=2000, per_step=1, echo_of=lambda ids: list(ids) * 500)
    slow_step = engine.step
    engine.step = lambda: (time.sleep(0.002), slow_step())[1]
    metrics = Metrics("echo")
    worker = Worker(engine, ByteTokenizer(), metrics)
    worker.start()
    loop = asyncio.new_event_loop()
    try:
        job = Job(tuple(b"ab"), 900, 0.0, 1.0, 0, 0, (), loop, asyncio.Queue())
        worker.submit(job)
        deadline = time.monotonic() + 10
        while worker.snapshot().result(10).running != 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        worker.cancel(job)
        while worker.snapshot().result(10).running != 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert worker.snapshot().result(10).running == 0 and engine.cancelled == [0] and job.over
        assert engine.rows == [None, None] and metrics.finished == {"stop": 0, "length": 0, "abort": 1}
    finally:
        worker.close()
        loop.close()
    assert not worker.alive
