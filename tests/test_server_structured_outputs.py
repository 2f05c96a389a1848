"""Structured outputs through `distengine serve` with the real `openai` client, on the tiny model
with a byte-level tokenizer: response_format (json_schema, json_object) on chat and completions,
vLLM's structured_outputs object and guided_* names, streaming, a request naming its library
(xgrammar or guidance) and grammars in each one's syntax; bad schemas (naming the library), two
forms in one request, an unknown backend and beam search are 400s naming the field, and the server
serves on."""
from __future__ import annotations

import json
import re

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from tests.server_harness import Server, build_byte_level_model  # noqa: E402
from tests.test_structured_outputs import GRAMMARS, SCHEMA, satisfies  # noqa: E402

MESSAGES = [{"role": "user", "content": "give me JSON"}]
# Greedy with a penalty: the random model does not loop on whitespace.
GREEDY = dict(temperature=0, max_tokens=150, frequency_penalty=1.0)
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server(build_byte_level_model(str(tmp_path_factory.mktemp("bytes"))))
    s.name = s.client.models.list().data[0].id
    yield s
    assert s.stop() == 0


def test_response_format_json_schema_on_chat_and_completions(server):
    c = server.client
    r = c.chat.completions.create(model=server.name, messages=MESSAGES, response_format=RESPONSE_FORMAT, **GREEDY)
    assert r.choices[0].finish_reason == "stop"
    satisfies(json.loads(r.choices[0].message.content, strict=False))
    r = c.completions.create(model=server.name, prompt="x", extra_body={"response_format": RESPONSE_FORMAT}, **GREEDY)
    assert r.choices[0].finish_reason == "stop"
    satisfies(json.loads(r.choices[0].text, strict=False))
    r = c.chat.completions.create(model=server.name, messages=MESSAGES, response_format={"type": "json_object"},
                                  temperature=0, max_tokens=150, extra_body={"repetition_penalty": 2.0})
    assert isinstance(json.loads(r.choices[0].message.content, strict=False), dict)


def test_structured_outputs_and_guided_names(server):
    c = server.client
    choices = ["yes", "no", "maybe so"]
    for extra in ({"structured_outputs": {"choice": choices}}, {"guided_choice": choices},
                  {"guided_choice": choices, "guided_decoding_backend": "xgrammar"},
                  {"guided_choice": choices, "guided_decoding_backend": "guidance"},
                  {"structured_outputs": {"choice": choices, "backend": "xgrammar"}},
                  {"structured_outputs": {"choice": choices, "backend": "auto"}}):
        r = c.completions.create(model=server.name, prompt="x", temperature=1.0, seed=3, max_tokens=20, extra_body=extra, n=2)
        assert all(ch.text in choices and ch.finish_reason == "stop" for ch in r.choices), (extra, r)
    r = c.chat.completions.create(model=server.name, messages=MESSAGES, temperature=1.0, seed=1, max_tokens=30,
                                  extra_body={"guided_regex": r"[a-z]{3}-\d{2,4}"})
    assert re.fullmatch(r"[a-z]{3}-\d{2,4}", r.choices[0].message.content)
    r = c.completions.create(model=server.name, prompt="x", **GREEDY, extra_body={"guided_json": SCHEMA})
    satisfies(json.loads(r.choices[0].text, strict=False))
    sums = r"\((?:[0-9]|[1-9][0-9])(?:\+(?:[0-9]|[1-9][0-9]))*\)"
    for extra in ({"guided_grammar": GRAMMARS["xgrammar"]},  # auto: EBNF, through xgrammar
                  {"structured_outputs": {"grammar": GRAMMARS["guidance"], "backend": "guidance"}},
                  {"guided_grammar": GRAMMARS["guidance"], "guided_decoding_backend": "guidance"}):
        r = c.completions.create(model=server.name, prompt="x", temperature=1.0, seed=5, max_tokens=40, extra_body=extra)
        assert re.fullmatch(sums, r.choices[0].text), (extra, r)


def test_streaming_with_a_schema(server):
    chunks = list(server.client.chat.completions.create(model=server.name, messages=MESSAGES, response_format=RESPONSE_FORMAT,
                                                        stream=True, **GREEDY))
    satisfies(json.loads("".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices), strict=False))
    assert chunks[-1].choices[0].finish_reason == "stop"


@pytest.mark.parametrize("extra,field", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "structured_outputs.json: llguidance cannot compile this JSON schema"),
    ({"guided_json": {"type": "nope"}, "guided_decoding_backend": "xgrammar"},
     "structured_outputs.json: xgrammar cannot compile this JSON schema"),
    ({"structured_outputs": {"grammar": "start: nothing", "backend": "guidance"}},
     "structured_outputs.grammar: llguidance cannot compile this grammar"),
    ({"guided_regex": "(ab"}, "structured_outputs.regex"),
    ({"structured_outputs": {"grammar": "root ::= nothing"}}, "structured_outputs.grammar"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "one structured-output form per request"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
     "one structured-output form per request"),
    ({"guided_choice": ["a"], "guided_decoding_backend": "outlines"}, "guided_decoding_backend"),
    ({"structured_outputs": {"regex": "a", "backend": "llguidance"}},
     "structured_outputs.backend: must be one of 'auto', 'xgrammar', 'guidance'"),
    ({"structured_outputs": {"regex": "a", "whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern"),
    ({"response_format": {"type": "structural_tag"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"guided_choice": ["a"], "ignore_eos": True}, "ignore_eos"),
    ({"guided_choice": ["a"], "use_beam_search": True}, "guided_choice"),
])
def test_bad_requests_are_400s_naming_the_field(server, extra, field):
    with pytest.raises(openai.BadRequestError, match=re.escape(field)):
        server.client.completions.create(model=server.name, prompt="x", max_tokens=5, extra_body=extra)
    r = server.client.completions.create(model=server.name, prompt="x", max_tokens=5, temperature=0,
                                         extra_body={"guided_choice": ["ok"]})
    assert r.choices[0].text == "ok"
    server.wait_idle()
