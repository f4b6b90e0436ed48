"""The server's parts without a model: request bodies checked field by field, text handed out as it comes (split
characters and stop strings held back), server-sent events and response objects, the metrics' exposition text read
back by Prometheus' own parser."""

from __future__ import annotations

import json

import pytest
from prometheus_client.parser import text_string_to_metric_families

from mtp_jax.serve.detokenize import AnswerText, first_stop, held_back
from mtp_jax.serve.metrics import EngineSnapshot, Metrics
from mtp_jax.serve.protocol import ApiError, ChatRequest, CompletionRequest, parse, settings
from mtp_jax.serve.responses import DONE, Shape, sse
from tests.serve.fakes import ByteTokenizer


def body(**fields) -> bytes:
    return json.dumps(fields).encode()


@pytest.mark.parametrize(
    ("prompt", "parsed"),
    [("hi", "hi"), ([1, 2], [1, 2]), (["hi"], "hi"), ([[3, 4]], [3, 4])],
)
def test_a_prompt_is_text_or_token_ids_or_one_of_either_in_a_list(prompt, parsed):
    assert parse(CompletionRequest, body(prompt=prompt)).prompt == parsed


@pytest.mark.parametrize(
    ("raw", "param", "words"),
    [
        (b'{"prompt": "x",', None, "not valid JSON"),
        (b"[1, 2]", None, "must be a JSON object"),
        (b"\xff\xfe", None, "not valid JSON"),
        (b"[" * 100_000 + b"]" * 100_000, None, "nests too deep"),
        (body(prompt="x", best_of=2), "best_of", "unknown field"),
        (body(), "prompt", "missing field"),
        (body(prompt=5), "prompt", "a string or a list of token ids"),
        (body(prompt=["a", "b"]), "prompt", "one prompt a request"),
        (body(prompt=[1, True]), "prompt", "a string or a list of token ids"),
        (body(prompt="x", temperature="hot"), "temperature", "valid number"),
        (body(prompt="x", max_tokens=True), "max_tokens", "valid integer"),
        (body(prompt="x", max_tokens=2.5), "max_tokens", "valid integer"),
        (body(prompt="x", stop=3), "stop", "a string or a list of strings"),
        (body(prompt="x", stream="yes"), "stream", "valid boolean"),
        (body(prompt="x", stream_options={"include_usage": True, "x": 1}), "stream_options.x", "unknown field"),
    ],
)
def test_a_malformed_completion_body_is_a_400_naming_the_field(raw, param, words):
    with pytest.raises(ApiError) as caught:
        parse(CompletionRequest, raw)
    assert caught.value.status == 400
    assert caught.value.param == param
    assert words in caught.value.message
    error = caught.value.body()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("messages", "param"),
    [
        ([{"role": "wizard", "content": "x"}], "messages.0.role"),
        ([{"role": "user"}], "messages.0.content"),
        ([{"role": "user", "content": 3}], "messages.0.content"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": "u"}]}], "messages.0.content"),
        ("hello", "messages"),
    ],
)
def test_a_malformed_chat_body_is_a_400_naming_the_field(messages, param):
    with pytest.raises(ApiError) as caught:
        parse(ChatRequest, body(messages=messages))
    assert (caught.value.status, caught.value.param) == (400, param)


def test_chat_content_parts_are_joined():
    parts = [{"type": "text", "text": "Hello, "}, {"type": "text", "text": "world"}]
    assert parse(ChatRequest, body(messages=[{"role": "user", "content": parts}])).messages[0].content == "Hello, world"


def test_settings_default_as_openai_does():
    given = settings(parse(CompletionRequest, body(prompt="x")))
    assert (given.max_tokens, given.temperature, given.top_p, given.top_k, given.seed) == (None, 1.0, 1.0, 0, None)
    assert (given.stop, given.stream, given.include_usage) == ((), False, False)
    chat = body(messages=[], max_tokens=5, max_completion_tokens=7, stop="\n", stream=True, top_k=-1,
                stream_options={"include_usage": True})  # fmt: skip
    given = settings(parse(ChatRequest, chat))
    assert (given.max_tokens, given.stop, given.include_usage, given.top_k) == (7, ("\n",), True, 0)
    assert settings(parse(CompletionRequest, body(prompt="x", temperature=0))).temperature == 0.0


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -0.5}, "temperature"),
        ({"temperature": 2.5}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"seed": 2**63}, "seed"),
        ({"n": 2}, "n"),
        ({"presence_penalty": 0.5}, "presence_penalty"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"stop": ["a", ""]}, "stop"),
        ({"stop": "x" * 501}, "stop"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
    ],
)
def test_a_value_out_of_range_is_a_400_naming_it(fields, param):
    with pytest.raises(ApiError) as caught:
        settings(parse(CompletionRequest, body(prompt="x", **fields)))
    assert (caught.value.status, caught.value.param) == (400, param)


def pieces_of(tokens_per_piece: list[list[int]], stop=()) -> tuple[list[str], AnswerText]:
    answer = AnswerText(ByteTokenizer(), stop)
    pieces = [answer.add(tokens, finished=i == len(tokens_per_piece) - 1) for i, tokens in enumerate(tokens_per_piece)]
    return pieces, answer


def test_pieces_add_up_to_the_decoded_answer_and_hold_back_a_split_character():
    ids = list("a é b".encode())  # "é" is two bytes: 0xC3 0xA9
    split = ids.index(0xC3) + 1
    pieces, answer = pieces_of([ids[:split], ids[split:]])
    assert pieces == ["a ", "é b"]
    assert "".join(pieces) == answer.text == "a é b" and not answer.stopped


def test_a_stop_string_ends_the_answer_before_it_even_across_pieces():
    ids = list(b"one two. three")
    pieces, answer = pieces_of([ids[:6], ids[6:9], ids[9:]], stop=("wo.",))
    assert answer.stopped and answer.text == "one t"
    assert "".join(pieces) == "one t"
    assert pieces[0] == "one t"  # "w" might begin "wo.": held back
    assert answer.add(list(b"more"), finished=True) == ""  # after a stop nothing more is handed out


def test_a_tail_that_begins_a_stop_string_waits_and_is_released_when_it_does_not_complete_one():
    pieces, answer = pieces_of([list(b"ab\nE"), list(b"N"), list(b"x")], stop=("\nEND",))
    assert pieces == ["ab", "", "\nENx"]
    assert answer.text == "ab\nENx" and not answer.stopped


def test_the_first_of_several_stop_strings_wins():
    assert first_stop("abcdef", ("de", "bc")) == 1
    assert first_stop("abc", ("x",)) is None
    assert held_back("hello wo", ("world", "o w")) == "hello "


def test_server_sent_events_and_response_objects():
    assert sse({"a": "é"}) == 'data: {"a":"é"}\n\n' and DONE == "data: [DONE]\n\n"
    chat = Shape("m", chat=True, include_usage=True)
    opening, piece, end = chat.chunk(None), chat.chunk("Hi"), chat.chunk("", "stop")
    assert opening["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert piece["choices"][0]["delta"] == {"content": "Hi"} and piece["usage"] is None
    assert end["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}
    assert {c["id"] for c in (opening, piece, end)} == {chat.id} and chat.id.startswith("chatcmpl-")
    assert piece["object"] == "chat.completion.chunk"
    assert chat.usage_chunk(3, 4)["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
    whole = Shape("m", chat=False).whole("text", "length", 2, 5)
    assert whole["object"] == "text_completion" and whole["choices"][0]["text"] == "text"
    assert whole["usage"]["total_tokens"] == 7 and "usage" not in Shape("m", chat=False).chunk("x")


def test_metrics_read_back_by_prometheus_parser():
    metrics = Metrics('a "quoted" model')
    metrics.admitted(7)
    metrics.generated(1, first_token_seconds=0.3, interval=None)
    metrics.generated(4, first_token_seconds=None, interval=0.2)  # 4 tokens 0.05 s apart
    metrics.ended("stop", 1.2)
    metrics.ended("abort", 0.4)
    stats = {"drafted": 24, "accepted": 9, "reached": [12, 6], "accepted_at": [6, 3]}
    text = metrics.render(EngineSnapshot(running=2, waiting=1, stats=stats))
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name")))] = s.value
            assert s.labels["model_name"] == 'a "quoted" model'
    assert samples[("mtp_jax:num_requests_running", ())] == 2
    assert samples[("mtp_jax:num_requests_waiting", ())] == 1
    assert samples[("mtp_jax:request_success_total", (("finished_reason", "stop"),))] == 1
    assert samples[("mtp_jax:request_success_total", (("finished_reason", "abort"),))] == 1
    assert samples[("mtp_jax:prompt_tokens_total", ())] == 7
    assert samples[("mtp_jax:generation_tokens_total", ())] == 5
    assert samples[("mtp_jax:time_to_first_token_seconds_count", ())] == 1
    assert samples[("mtp_jax:time_to_first_token_seconds_bucket", (("le", "0.25"),))] == 0
    assert samples[("mtp_jax:time_to_first_token_seconds_bucket", (("le", "0.5"),))] == 1
    assert samples[("mtp_jax:inter_token_latency_seconds_count", ())] == 4
    assert samples[("mtp_jax:inter_token_latency_seconds_sum", ())] == pytest.approx(0.2)
    assert samples[("mtp_jax:inter_token_latency_seconds_bucket", (("le", "0.05"),))] == 4
    assert samples[("mtp_jax:inter_token_latency_seconds_bucket", (("le", "+Inf"),))] == 4
    assert samples[("mtp_jax:spec_decode_num_drafts_total", ())] == 12
    assert samples[("mtp_jax:spec_decode_num_draft_tokens_total", ())] == 24
    assert samples[("mtp_jax:spec_decode_num_accepted_tokens_total", ())] == 9
    assert samples[("mtp_jax:spec_decode_num_accepted_tokens_per_pos_total", (("position", "1"),))] == 3
