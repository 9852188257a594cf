"""The router's record of one relayed request: log-probabilities of a request migrated between upstreams reach the
client as one answer, with the completions API's text offsets as the workers counted them over the whole request
(a worker that takes a request over counts from the end of the tokens it was handed)."""

from __future__ import annotations

import json

from engine.router.migration import StreamRecord


def event(**choice) -> str:
    return "data: " + json.dumps({"id": "x", "created": 1, "model": "m", "choices": [{"index": 0, **choice}]})


def completion_chunk(text: str, value: float, offset: int) -> str:
    return event(text=text, logprobs={"tokens": [text], "token_logprobs": [value], "top_logprobs": [{text: value}],
                                      "text_offset": [offset]})


def test_completion_logprobs_of_two_upstreams_make_one_answer():
    record = StreamRecord("completions", {"model": "m", "prompt": "p", "logprobs": 1}, 0.0)
    record.take(completion_chunk("ab", -1.0, 0))
    # the first upstream died; the second was handed its tokens and counts on from their text
    record.take(completion_chunk("cde", -2.0, 2))
    record.take(completion_chunk("", -3.0, 5))
    answer = json.loads(record.answer())["choices"][0]
    assert answer["text"] == "abcde"
    assert answer["logprobs"] == {"tokens": ["ab", "cde", ""], "token_logprobs": [-1.0, -2.0, -3.0],
                                  "top_logprobs": [{"ab": -1.0}, {"cde": -2.0}, {"": -3.0}], "text_offset": [0, 2, 5]}


def test_a_streaming_client_s_logprobs_are_relayed_and_not_kept():
    """Only the answer of a client that asked for no stream reads the kept lists: a long streamed answer with 20
    alternatives a token held them all for nothing."""
    record = StreamRecord("completions", {"model": "m", "prompt": "p", "logprobs": 5, "stream": True}, 0.0)
    events = [record.take(completion_chunk("ab", -1.0, 0)), record.take(completion_chunk("cde", -2.0, 2))]
    assert [json.loads(e)["choices"][0]["logprobs"]["tokens"] for e in events] == [["ab"], ["cde"]]
    assert record.completion_logprobs.tokens == [] and record.completion_logprobs.top_logprobs == []
    chat = StreamRecord("chat/completions", {"model": "m", "messages": [], "logprobs": True, "stream": True}, 0.0)
    entry = {"token": "x", "logprob": -0.5, "bytes": [120], "top_logprobs": []}
    assert chat.take(event(delta={"content": "x"}, logprobs={"content": [entry]})) is not None
    assert chat.chat_logprobs == []


def test_a_chat_entry_without_text_is_relayed_and_kept():
    record = StreamRecord("chat/completions", {"model": "m", "messages": [], "logprobs": True}, 0.0)
    entry = {"token": "\ufffd", "logprob": -0.5, "bytes": [228], "top_logprobs": []}
    relayed = record.take(event(delta={"content": ""}, logprobs={"content": [entry]}))  # text held for the next byte
    assert relayed is not None
    record.take(event(delta={"content": "x"}, logprobs={"content": [{**entry, "token": "x", "bytes": [120]}]}))
    answer = json.loads(record.answer())["choices"][0]
    assert [e["bytes"] for e in answer["logprobs"]["content"]] == [[228], [120]]


def test_no_logprobs_asked_none_answered():
    record = StreamRecord("chat/completions", {"model": "m", "messages": []}, 0.0)
    record.take(event(delta={"content": "hi"}))
    assert json.loads(record.answer())["choices"][0].get("logprobs") is None
