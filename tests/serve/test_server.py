"""`python -m mtp_jax.serve` as a user runs it: the default model in a child process, driven by OpenAI's own client.
Greedy answers, whole and streamed, completions and chats, one at a time and 16 at once, equal `generate_text`'s for
the same prompt and settings; what a client sends wrong gets its 4xx status and an error object; a client gone
mid-stream has its request cancelled; SIGTERM lets the running request finish and the process ends with status 0."""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

import mtp_jax
from tests.support.commands import ROOT

pytestmark = pytest.mark.slow

KEY = "test-key"
MODEL = "SmolLM2-135M-Instruct"
NUM_DRAFT = 2
MAX_TOKENS = 20
MAX_LEN = 512
START_TIMEOUT = 600
CHAT_PROMPTS = [  # chat-templated, 33 to 48 tokens: one prompt-width bucket, the warm-up's (few programs compiled)
    "Name three colours.",
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Count from one to ten.",
    "Why is the sky blue?",
    "Give me a word that rhymes with cat.",
    "What do bees make?",
    "Say hello in Spanish.",
    "How many legs does a spider have?",
    "Name a large animal.",
    "What is two plus two?",
    "Suggest a name for a dog.",
    "What colour is grass?",
    "Describe the moon in one sentence.",
    "What is water made of?",
    "Name a fruit that is yellow.",
]
COMPLETION_PROMPTS = [  # without a template: long enough to share the chat prompts' bucket
    "The capital of France is Paris. The capital of Germany is Berlin. The capital of Italy is Rome. The capital of "
    "Portugal is Lisbon. The capital of Spain is",
    "Once upon a time, in a small village at the edge of a great forest, there lived an old woodcutter and his "
    "daughter. One cold winter morning,",
]
COUNTING = ", ".join(str(i) for i in range(1, 14)) + ","  # a prompt whose answer goes on and on (and in that bucket)


class Server:
    def __init__(self, process: subprocess.Popen, log: str, url: str):
        self.process, self.log, self.url = process, log, url
        self.host, self.port = re.match(r"http://([^:]+):(\d+)", url).groups()

    def client(self, **options) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=KEY, max_retries=0, timeout=300, **options)

    def request(self, method: str, path: str, body: bytes | None = None, headers: dict | None = None):
        """(status, parsed JSON body or text) of one raw request."""
        connection = http.client.HTTPConnection(self.host, int(self.port), timeout=300)
        try:
            connection.request(method, path, body=body, headers=headers or {})
            response = connection.getresponse()
            text = response.read().decode()
        finally:
            connection.close()
        is_json = response.getheader("content-type", "").startswith("application/json")
        return response.status, json.loads(text) if is_json else text

    def stderr(self) -> str:
        with open(self.log) as f:
            return f.read()


@pytest.fixture(scope="module")
def server(tmp_path_factory, smollm2_path):
    log = str(tmp_path_factory.mktemp("serve") / "stderr.log")
    env = {name: value for name, value in os.environ.items() if name != "JAX_DISABLE_MOST_OPTIMIZATIONS"}
    command = [sys.executable, "-m", "mtp_jax.serve", "--port", "0", "--slots", "4", "--max-len", str(MAX_LEN),
               "--num-draft", str(NUM_DRAFT), "--api-key", KEY, "--max-body-bytes", "100000"]  # fmt: skip
    with open(log, "w") as err:
        process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=err)
    try:
        yield Server(process, log, wait_until_ready(process, log))
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(30)


def wait_until_ready(process: subprocess.Popen, log: str) -> str:
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        with open(log) as f:
            found = re.search(r"mtp_jax\.serve: ready on (http://\S+)", f.read())
        if found:
            return found.group(1)
        if process.poll() is not None:
            with open(log) as f:
                pytest.fail(f"the server exited with {process.returncode}:\n{f.read()[-3000:]}")
        time.sleep(0.2)
    pytest.fail("the server was not ready in time")


@pytest.fixture(scope="module")
def default_model(optimized_compiles):
    """The default model and its tokenizer in this process, as `mtp_jax.load()` gives them."""
    return mtp_jax.load()


@pytest.fixture(scope="module")
def reference(default_model):
    """generate_text's answer (a TextResult) to a prompt, greedy, with the server's drafts."""
    model, tokenizer = default_model
    answers = {}

    def answer(prompt: str, chat: bool, max_tokens: int = MAX_TOKENS):
        if (prompt, chat, max_tokens) not in answers:
            cfg = mtp_jax.DecodeConfig(num_draft=NUM_DRAFT, max_new_tokens=max_tokens)
            out = mtp_jax.generate_text(model, [prompt], cfg, tokenizer=tokenizer, chat=chat)
            answers[prompt, chat, max_tokens] = out.results[0]
        return answers[prompt, chat, max_tokens]

    return answer


def finish(result) -> str:
    return {"eos": "stop", "length": "length"}[result.finish_reason]


def chat_stream(client: openai.OpenAI, prompt: str, **options) -> tuple[str, str, list]:
    """(text, finish reason, chunks) of a streamed greedy chat completion."""
    messages = [{"role": "user", "content": prompt}]
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0,
                                                 stream=True, **options))  # fmt: skip
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    return text, reasons[-1] if reasons else None, chunks


def test_models_lists_the_default_model(server):
    assert [m.id for m in server.client().models.list().data] == [MODEL]
    status, health = server.request("GET", "/health")
    assert status == 200 and health == {"status": "ok"}


def test_greedy_completions_equal_generate_text(server, reference):
    client = server.client()
    for prompt in COMPLETION_PROMPTS:
        expected = reference(prompt, chat=False)
        out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
        assert out.choices[0].text == expected.text
        assert out.choices[0].finish_reason == finish(expected)
        assert out.usage.completion_tokens == expected.num_tokens
        streamed = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                                  stream=True))  # fmt: skip
        assert "".join(c.choices[0].text for c in streamed) == expected.text
        assert streamed[-1].choices[0].finish_reason == finish(expected)


def test_greedy_chats_equal_generate_text_whole_and_streamed(server, reference, default_model):
    _, tokenizer = default_model
    prompt_ids = tokenizer.apply_chat_template([{"role": "user", "content": CHAT_PROMPTS[0]}], tokenize=True)
    client = server.client()
    prompt = CHAT_PROMPTS[0]
    expected = reference(prompt, chat=True)
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                         max_tokens=MAX_TOKENS, temperature=0)  # fmt: skip
    assert out.choices[0].message.content == expected.text and out.choices[0].message.role == "assistant"
    assert out.choices[0].finish_reason == finish(expected)
    assert out.usage.prompt_tokens == len(prompt_ids) and out.usage.completion_tokens == expected.num_tokens
    text, reason, chunks = chat_stream(client, prompt, stream_options={"include_usage": True})
    assert (text, reason) == (expected.text, finish(expected))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == expected.num_tokens


def test_a_stop_string_cuts_the_answer(server, reference):
    expected = reference(CHAT_PROMPTS[0], chat=True).text
    stop = expected.split()[2]  # the third word: the answer ends before its first appearance
    out = server.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": CHAT_PROMPTS[0]}],
                                                  max_tokens=MAX_TOKENS, temperature=0, stop=[stop])  # fmt: skip
    assert out.choices[0].message.content == expected[: expected.index(stop)]
    assert out.choices[0].finish_reason == "stop"


def test_sixteen_concurrent_streams_each_equal_generate_text(server, reference):
    expected = [reference(prompt, chat=True) for prompt in CHAT_PROMPTS]
    with concurrent.futures.ThreadPoolExecutor(len(CHAT_PROMPTS)) as pool:
        got = list(pool.map(lambda prompt: chat_stream(server.client(), prompt)[:2], CHAT_PROMPTS))
    assert [text for text, _ in got] == [e.text for e in expected]
    assert [reason for _, reason in got] == [finish(e) for e in expected]
    assert metric(server, "mtp_jax:num_requests_running") == 0


BAD_REQUESTS = [  # (path, body, headers, status, code)
    ("/v1/completions", b'{"model": "x", "prompt": ', {}, 400, None),
    ("/v1/completions", b'{"prompt": "hi", "frobnicate": 1}', {}, 400, None),
    ("/v1/completions", b'{"prompt": "hi", "temperature": "warm"}', {}, 400, None),
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": 600}', {}, 400, None),
    ("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "w " * 600}]}).encode(), {}, 400,
     None),
    ("/v1/completions", b'{"model": "gpt-4o", "prompt": "hi"}', {}, 404, "model_not_found"),
    ("/v1/completions", json.dumps({"prompt": "x" * 200_000}).encode(), {}, 413, "request_too_large"),
    ("/v1/no-such-route", b"{}", {}, 404, None),
    ("/v1/completions", b'{"prompt": "hi"}', {"Authorization": "Bearer wrong"}, 401, "invalid_api_key"),
    ("/v1/completions", b'{"prompt": "hi"}', {"Authorization": None}, 401, "invalid_api_key"),
]  # fmt: skip


@pytest.mark.parametrize(("path", "body", "headers", "status", "code"), BAD_REQUESTS)
def test_what_a_client_sends_wrong_gets_a_4xx_and_an_error_object(server, path, body, headers, status, code):
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}", **headers}
    got, answer = server.request("POST", path, body, {k: v for k, v in headers.items() if v is not None})
    assert got == status, answer
    assert isinstance(answer, dict) and answer["error"]["message"] and answer["error"]["code"] == code


def test_the_openai_client_sees_the_errors_it_expects(server):
    with pytest.raises(openai.NotFoundError):
        server.client().completions.create(model="gpt-4o", prompt="hi", max_tokens=2)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0).models.list()
    with pytest.raises(openai.BadRequestError, match="a slot holds 512"):
        server.client().completions.create(model=MODEL, prompt="hi", max_tokens=MAX_LEN)


def metric(server: Server, name: str, **labels) -> float:
    status, text = server.request("GET", "/metrics")
    assert status == 200
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    raise KeyError(name)


def leave_after(server: Server, body: dict, until) -> bytes:
    """Send `body` to /v1/completions on a raw connection, and close it once `until(received bytes)` holds."""
    data = json.dumps(body).encode()
    with socket.create_connection((server.host, int(server.port)), timeout=120) as sock:
        head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                f"Authorization: Bearer {KEY}\r\nContent-Length: {len(data)}\r\n\r\n")  # fmt: skip
        sock.sendall(head.encode() + data)
        received = b""
        while not until(received):
            sock.settimeout(0.2)
            try:
                chunk = sock.recv(65536)
            except TimeoutError:
                continue
            assert chunk, f"the server closed the connection: {received!r}"
            received += chunk
    return received


def wait_for_no_running_request(server: Server) -> None:
    deadline = time.monotonic() + 60
    while metric(server, "mtp_jax:num_requests_running") != 0 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert metric(server, "mtp_jax:num_requests_running") == 0


def test_a_client_gone_has_its_request_cancelled(server, reference):
    aborted = metric(server, "mtp_jax:request_success_total", finished_reason="abort")
    long = {"model": MODEL, "prompt": COUNTING, "max_tokens": 400, "temperature": 0}
    received = leave_after(server, {**long, "stream": True}, until=lambda received: b"data: " in received)
    assert received.startswith(b"HTTP/1.1 200")
    wait_for_no_running_request(server)
    assert metric(server, "mtp_jax:request_success_total", finished_reason="abort") == aborted + 1
    leave_after(server, long, until=lambda _: metric(server, "mtp_jax:num_requests_running") == 1)  # not streamed
    wait_for_no_running_request(server)
    assert metric(server, "mtp_jax:request_success_total", finished_reason="abort") == aborted + 2
    prompt = COMPLETION_PROMPTS[0]  # and the next request is served as before
    out = server.client().completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
    assert out.choices[0].text == reference(prompt, chat=False).text


def test_sigterm_lets_the_running_request_finish_and_exits_zero(server, reference):
    """Last: the server is gone after it."""
    expected = reference(CHAT_PROMPTS[1], chat=True)
    stream = server.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": CHAT_PROMPTS[1]}], max_tokens=MAX_TOKENS, temperature=0,
        stream=True,
    )  # fmt: skip
    chunks = [next(stream)]  # the request runs
    server.process.send_signal(signal.SIGTERM)
    chunks += list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected.text and chunks[-1].choices[0].finish_reason == finish(expected)
    assert server.process.wait(120) == 0, server.stderr()[-3000:]
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection((server.host, int(server.port)), timeout=10).close()
    assert "Traceback" not in server.stderr()
