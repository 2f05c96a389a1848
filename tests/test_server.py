"""`distengine serve` as a user runs it: a subprocess on a free loopback port, a tiny random hybrid
model with a local tokenizer and chat template, driven by the real `openai` client and by raw HTTP.
Completions and chat, streaming and not, equal `LLM.generate`; usage and prefix-cache counts;
every error case gets its status and OpenAI-shaped body and the server serves on; a client that
disconnects is aborted; 48 concurrent streams; `bench serve`; SIGTERM exits 0 after the request in
flight; at TP=2 a killed worker makes /health 503 within 5 s and ends the request in flight."""
from __future__ import annotations

import concurrent.futures
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("ray")

from tests.server_harness import KEY, ROOT, Server, build_served_model, free_port  # noqa: E402


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_served_model(str(tmp_path_factory.mktemp("served")))


@pytest.fixture(scope="module")
def server(model):
    s = Server(model)
    yield s
    assert s.stop() == 0


@pytest.fixture(scope="module")
def reference(model):
    from distengine import LLM, SamplingParams
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    with LLM(model, device="cpu", dtype="float32", max_model_len=256) as llm:
        comp = llm.generate("what is water", greedy, use_tqdm=False)[0].outputs[0].text
        chat = llm.chat([{"role": "user", "content": "who made oil"}], greedy, use_tqdm=False)[0].outputs[0].text
    return comp, chat


def test_completions_and_chat_equal_llm_generate(server, reference):
    comp, chat = reference
    c = server.client
    r = c.completions.create(model=c.models.list().data[0].id, prompt="what is water", max_tokens=8, temperature=0,
                             extra_body={"ignore_eos": True})
    assert r.choices[0].text == comp and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 8 and r.usage.prompt_tokens == 3 and r.usage.total_tokens == 11
    chunks = list(c.completions.create(model=server_model(c), prompt="what is water", max_tokens=8, temperature=0,
                                       stream=True, stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True}))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == comp
    assert chunks[-1].usage.completion_tokens == 8 and chunks[-1].choices == []
    msgs = [{"role": "user", "content": "who made oil"}]
    r = c.chat.completions.create(model=server_model(c), messages=msgs, max_tokens=8, temperature=0,
                                  extra_body={"ignore_eos": True}, logprobs=True, top_logprobs=2)
    assert r.choices[0].message.content == chat and r.choices[0].message.role == "assistant"
    assert len(r.choices[0].logprobs.content) == 8 and len(r.choices[0].logprobs.content[0].top_logprobs) == 2
    text = "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
        model=server_model(c), messages=msgs, max_tokens=8, temperature=0, stream=True, extra_body={"ignore_eos": True}))
    assert text == chat
    # Token-id prompts, several in one request, logprobs, vLLM's extras.
    r = c.completions.create(model=server_model(c), prompt=[[5, 6, 7], [8, 9]], max_tokens=3, temperature=0, logprobs=2,
                             extra_body={"ignore_eos": True, "top_k": 5, "min_tokens": 1, "stop_token_ids": [1]})
    assert [ch.index for ch in r.choices] == [0, 1] and len(r.choices[1].logprobs.tokens) == 3
    assert r.usage.prompt_tokens == 5


def test_stop_string_found_by_the_front_end_ends_the_request_in_the_engine(server, model):
    """Stop strings are the front end's (it detokenizes); the engine, in its own process, hears
    of the match, frees the request's blocks, and the text is `LLM.generate`'s with the same stop."""
    from distengine import LLM, SamplingParams
    long = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    with LLM(model, device="cpu", dtype="float32", max_model_len=256) as llm:
        full = llm.generate("what is water", long, use_tqdm=False)[0].outputs[0].text
        stop = full.strip()[len(full.strip()) // 3:][:2]
        expected = llm.generate("what is water", SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True,
                                                                stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert expected.finish_reason == "stop" and len(expected.token_ids) < 40, (full, stop)
    c = server.client
    for stream in (False, True):
        r = c.completions.create(model=server_model(c), prompt="what is water", max_tokens=40, temperature=0,
                                 stop=[stop], stream=stream, extra_body={"ignore_eos": True})
        chunks = list(r) if stream else [r]
        assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == expected.text
        assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "stop"
    server.wait_idle()


def test_a_stop_string_stops_the_engine_too(model):
    """The engine stops computing a request once the front end finds its stop string (it does
    not run on to max_tokens): counted in the engine's steps (the loop in a thread, to see them)."""
    import asyncio

    from distengine import SamplingParams
    from distengine.async_llm import AsyncLLM
    engine = AsyncLLM(model, device="cpu", dtype="float32", max_model_len=256, engine_process=False)

    async def run(sp: SamplingParams, rid: str) -> tuple[list[int], str]:
        ids, text = [], ""
        async for out in engine.generate("what is water", sp, rid):
            ids += out.outputs[0].token_ids
            text += out.outputs[0].text
        return ids, text

    log: list = []
    try:
        _, full = asyncio.run(run(SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True), "full"))
        stop = full.strip()[len(full.strip()) // 4:][:2]
        engine.engine.core.step_log = log
        stopping = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True, stop=[stop])
        ids, text = asyncio.run(run(stopping, "stop"))
        deadline = time.monotonic() + 10  # the step in flight when the stop string was found ends first
        while not engine.engine.call("is_idle").result(timeout=10):
            assert time.monotonic() < deadline, "the engine is not idle"
            time.sleep(0.05)
    finally:
        engine.shutdown()
    assert stop in full and len(ids) < 40 and full.startswith(text) and stop not in text
    assert len(log) <= len(ids) + 2, (len(log), len(ids))  # one step per token, and what was in flight


def server_model(client) -> str:
    return client.models.list().data[0].id


def test_logit_bias_and_allowed_token_ids_are_honoured(server):
    """OpenAI's logit_bias (string keys) at temperature 0 makes its token the output; vLLM's
    allowed_token_ids keeps a sampled completion on its tokens."""
    c = server.client

    def text(ids):
        return server.post("/detokenize", {"tokens": ids}).json()["prompt"]
    r = c.completions.create(model=server_model(c), prompt=[5, 6, 7], max_tokens=4, temperature=0,
                             logit_bias={"42": 100}, extra_body={"ignore_eos": True})
    assert r.choices[0].text == text([42] * 4)
    r = c.completions.create(model=server_model(c), prompt=[5, 6, 7], max_tokens=5, temperature=1.0, seed=1,
                             logprobs=0, extra_body={"ignore_eos": True, "allowed_token_ids": [40, 41]})
    assert len(r.choices[0].logprobs.tokens) == 5
    assert {t.strip() for t in r.choices[0].logprobs.tokens} <= {text([40]), text([41])}  # (a word tokenizer)


def test_n_best_of_and_beam_search(server):
    """n choices per prompt (prompt i's j-th is choice i * n + j), whole and streamed, each the
    completion of its own seed; best_of ranks more than it returns; vLLM's use_beam_search gives
    the n best beams."""
    c = server.client
    r = c.completions.create(model=server_model(c), prompt=[[5, 6, 7, 8, 9, 10], [8, 9]], max_tokens=4, n=3,
                             temperature=1.0, seed=11, extra_body={"ignore_eos": True})
    assert [ch.index for ch in r.choices] == list(range(6)) and r.usage.completion_tokens == 24
    assert r.usage.prompt_tokens == 8
    alone = c.completions.create(model=server_model(c), prompt=[8, 9], max_tokens=4, temperature=1.0, seed=12,
                                 extra_body={"ignore_eos": True})
    assert r.choices[4].text == alone.choices[0].text  # prompt 1, completion 1: seed 11 + 1
    chunks = list(c.completions.create(model=server_model(c), prompt=[5, 6, 7, 8, 9, 10], max_tokens=4, n=3,
                                       temperature=1.0, seed=11, stream=True, extra_body={"ignore_eos": True}))
    texts = {i: "".join(ch.choices[0].text for ch in chunks if ch.choices and ch.choices[0].index == i)
             for i in range(3)}
    assert [texts[i] for i in range(3)] == [ch.text for ch in r.choices[:3]]
    assert sum(1 for ch in chunks if ch.choices and ch.choices[0].finish_reason == "length") == 3
    r = c.completions.create(model=server_model(c), prompt=[5, 6, 7], max_tokens=3, n=1, temperature=1.0, seed=2,
                             extra_body={"ignore_eos": True, "best_of": 3})
    assert len(r.choices) == 1 and r.choices[0].finish_reason == "length"
    msgs = [{"role": "user", "content": "who made oil"}]
    r = c.chat.completions.create(model=server_model(c), messages=msgs, max_tokens=3, n=2,
                                  extra_body={"use_beam_search": True, "ignore_eos": True})
    assert [ch.index for ch in r.choices] == [0, 1] and r.choices[0].message.content != r.choices[1].message.content
    assert r.usage.completion_tokens == 6


def test_tokens_as_ids_and_chat_template_kwargs(server):
    """vLLM's return_tokens_as_token_ids spells every logprobs token "token_id:ID" (the ids the
    completion's text encodes); chat_template_kwargs reach the template as variables."""
    import re
    c = server.client
    r = c.completions.create(model=server_model(c), prompt=[5, 6, 7], max_tokens=4, temperature=0, logprobs=2,
                             extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    lp = r.choices[0].logprobs
    ids = [int(re.fullmatch(r"token_id:(\d+)", t)[1]) for t in lp.tokens]
    assert server.post("/detokenize", {"tokens": ids}).json()["prompt"] == r.choices[0].text
    assert all(re.fullmatch(r"token_id:\d+", k) for d in lp.top_logprobs for k in d)
    echoed = server.post("/v1/completions", {"prompt": "what is water", "max_tokens": 2, "echo": True, "logprobs": 0,
                                             "return_tokens_as_token_ids": True}).json()["choices"][0]
    assert echoed["text"].startswith("what is water") and echoed["logprobs"]["tokens"][0].startswith("token_id:")
    msgs = [{"role": "user", "content": "who made oil"}]
    plain = c.chat.completions.create(model=server_model(c), messages=msgs, max_tokens=1)
    more = c.chat.completions.create(model=server_model(c), messages=msgs, max_tokens=1,
                                     extra_body={"chat_template_kwargs": {"greeting": "water"}})
    assert more.usage.prompt_tokens == plain.usage.prompt_tokens + 1
    bad = server.post("/v1/chat/completions", {"messages": msgs, "chat_template_kwargs": {"tokenize": True}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "chat_template_kwargs"


def test_echo_and_prompt_logprobs(server):
    """echo puts the prompt before the completion, and with logprobs its tokens' logprobs before
    the completion's (none for the first), the same as vLLM's prompt_logprobs gives them."""
    c = server.client
    r = server.post("/v1/completions", {"prompt": "what is water", "max_tokens": 2, "temperature": 0, "echo": True,
                                        "logprobs": 1, "prompt_logprobs": 2, "ignore_eos": True}).json()
    ch = r["choices"][0]
    plain = c.completions.create(model=server_model(c), prompt="what is water", max_tokens=2, temperature=0,
                                 extra_body={"ignore_eos": True})
    assert ch["text"].startswith("what is water")
    assert ch["text"][len("what is water"):].strip() == plain.choices[0].text.strip()
    lp, prompt = ch["logprobs"], ch["prompt_logprobs"]
    assert len(lp["tokens"]) == 3 + 2 and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert "".join(lp["tokens"]) == ch["text"] and lp["text_offset"][3] == len("what is water")
    ids = server.post("/tokenize", {"prompt": "what is water"}).json()["tokens"]
    assert prompt[0] is None and len(prompt) == 3
    for i in (1, 2):
        entry = prompt[i][str(ids[i])]
        assert entry["logprob"] == pytest.approx(lp["token_logprobs"][i]) and entry["rank"] >= 1
        assert len(prompt[i]) >= 2 and entry["decoded_token"].strip() == lp["tokens"][i].strip()
    bad = server.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "echo": True})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "echo"


def test_cached_tokens_on_a_repeated_prefix(server):
    system = " ".join(["you are a helpful assistant ."] * 8)
    first = server.client.completions.create(model=server_model(server.client), prompt=system + " what is water",
                                             max_tokens=2, temperature=0)
    second = server.client.completions.create(model=server_model(server.client), prompt=system + " who made oil",
                                              max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens >= 32
    assert server.metric("prefix_cache_hits_total") >= 32


def test_other_endpoints(server):
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/version").json()["version"]
    models = httpx.get(server.url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}).json()
    assert models["data"][0]["max_model_len"] == 256
    tok = server.post("/tokenize", {"prompt": "what is water"}).json()
    assert tok["count"] == 3 and tok["max_model_len"] == 256
    assert server.post("/detokenize", {"tokens": tok["tokens"]}).json()["prompt"] == "what is water"
    chat_tok = server.post("/tokenize", {"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat_tok["count"] > 0
    metrics = httpx.get(server.url + "/metrics").text
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prefix_cache_queries_total",
                 "prefix_cache_hits_total", "num_preemptions_total", "prompt_tokens_total",
                 "generation_tokens_total", "time_to_first_token_seconds_bucket", "inter_token_latency_seconds_bucket",
                 "e2e_request_latency_seconds_bucket"):
        assert f"distengine:{name}" in metrics, name


ERRORS = [  # (what, path, body, raw body?, key, status, message part, param)
    ("malformed JSON", "/v1/completions", '{"prompt": "x", ', True, KEY, 400, "not valid JSON", None),
    ("a field of the wrong type", "/v1/completions", {"prompt": "x", "temperature": "hot"}, False, KEY, 400,
     "temperature", "temperature"),
    ("max_tokens of the wrong type", "/v1/completions", {"prompt": "x", "max_tokens": "many"}, False, KEY, 400,
     "max_tokens", "max_tokens"),
    ("temperature out of range", "/v1/completions", {"prompt": "x", "temperature": -1}, False, KEY, 400,
     "temperature must be non-negative", "temperature"),
    ("top_p out of range", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_p": 2},
     False, KEY, 400, "top_p", "top_p"),
    ("a token id past the vocabulary", "/v1/completions", {"prompt": [1, 2, 99999]}, False, KEY, 400,
     "99999 is not a token id", "prompt"),
    ("a negative token id", "/v1/completions", {"prompt": [-1]}, False, KEY, 400, "-1", "prompt"),
    ("a string token id", "/v1/completions", {"prompt": [1, "2"]}, False, KEY, 400, "prompt", "prompt"),
    ("a bad stop token id", "/v1/completions", {"prompt": "x", "stop_token_ids": [99999]}, False, KEY, 400,
     "stop_token_ids", "stop_token_ids"),
    ("prompt + max_tokens past max_model_len", "/v1/completions", {"prompt": "x", "max_tokens": 1000}, False, KEY, 400,
     "maximum context length is 256 tokens; the request asks for 1001", "max_tokens"),
    ("n past the limit", "/v1/completions", {"prompt": "x", "n": 200}, False, KEY, 400, "n must be at most 128", "n"),
    ("no messages", "/v1/chat/completions", {"messages": []}, False, KEY, 400, "messages", "messages"),
    ("an unknown model", "/v1/completions", {"prompt": "x", "model": "nope"}, False, KEY, 404, "does not exist", "model"),
    ("a chat template that refuses the messages", "/v1/chat/completions",
     {"messages": [{"role": "robot", "content": "x"}]}, False, KEY, 400, "chat template refused them: no robots here",
     "messages"),
    ("an image in a chat message", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": [{"type": "text", "text": "what is this"},
                                                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}]}]},
     False, KEY, 400, "content[1] is a 'image_url' part: images, audio and video are not supported", "messages"),
    ("a content part of no known type", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": [{"type": "refusal", "refusal": "x"}]}]}, False, KEY, 400,
     "must be a {'type': 'text', 'text': str} part", "messages"),
    ("no prompt in the list", "/v1/completions", {"prompt": []}, False, KEY, 400, "must not be empty", "prompt"),
    ("the second prompt empty", "/v1/completions", {"prompt": ["x", ""]}, False, KEY, 400, "prompts[1]", "prompt"),
    ("a prompt that cannot be tokenized", "/v1/completions", '{"prompt": "\\ud800"}', True, KEY, 400,
     "not valid text", "prompt"),
    ("logprobs past 20", "/v1/completions", {"prompt": "x", "logprobs": 21}, False, KEY, 400,
     "logprobs must be in [0, 20]", "logprobs"),
    ("a repetition penalty float32 cannot hold", "/v1/completions", {"prompt": "x", "repetition_penalty": 1e-300},
     False, KEY, 400, "repetition_penalty must be in [1e-30, 1e30]", "repetition_penalty"),
    ("a seed past 64 bits", "/v1/completions", {"prompt": "x", "seed": 2 ** 64}, False, KEY, 400, "seed", "seed"),
    ("best_of 0", "/v1/completions", {"prompt": "x", "best_of": 0}, False, KEY, 400, "best_of must be at least n=1", "best_of"),
    ("top_logprobs without logprobs", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, False, KEY, 400, "needs logprobs: true",
     "top_logprobs"),
    ("stream_options without stream", "/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}},
     False, KEY, 400, "needs stream: true", "stream_options"),
    ("max_completion_tokens 0", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0}, False, KEY, 400, "max_tokens",
     "max_tokens"),
    ("tools without the server's auto tool choice", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {"name": "f"}}]},
     False, KEY, 400, '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set',
     "tool_choice"),
    ("an unknown route", "/v1/nothing", {}, False, KEY, 404, "Not Found", None),
    ("a route without POST", "/v1/models", {}, False, KEY, 405, "Method Not Allowed", None),
    ("no API key", "/v1/completions", {"prompt": "x"}, False, None, 401, "API key", None),
    ("a wrong API key", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}, False, "nope", 401,
     "API key", None),
]


@pytest.mark.parametrize("case", ERRORS, ids=[c[0] for c in ERRORS])
def test_errors_have_their_status_and_body_and_the_server_serves_on(server, reference, case):
    what, path, body, raw, key, status, message, param = case
    r = server.post(path, body, key=key, raw=raw)
    assert r.status_code == status, (what, r.text)
    err = r.json()["error"]
    assert message in err["message"] and err["code"] == status and err["type"] and err["param"] == param, err
    ok = server.client.completions.create(model=server_model(server.client), prompt="what is water", max_tokens=8,
                                          temperature=0, extra_body={"ignore_eos": True})
    assert ok.choices[0].text == reference[0]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_logprob_tokens_spell_the_text(server, stream):
    """Each token's string as it reads in the text (a sentencepiece token keeps its leading space),
    so the tokens join to the text and text_offset points into it, across stream chunks too."""
    body = {"prompt": "what is water", "max_tokens": 8, "temperature": 0, "logprobs": 1, "ignore_eos": True,
            "stream": stream}
    r = server.post("/v1/completions", body, key=KEY)
    assert r.status_code == 200, r.text
    if stream:
        parts = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        choices = [p["choices"][0] for p in parts if p["choices"]]
        text = "".join(c["text"] for c in choices)
        tokens = [t for c in choices for t in c["logprobs"]["tokens"]]
        offsets = [o for c in choices for o in c["logprobs"]["text_offset"]]
    else:
        choice = r.json()["choices"][0]
        text, tokens, offsets = choice["text"], choice["logprobs"]["tokens"], choice["logprobs"]["text_offset"]
    assert len(tokens) == 8 and "".join(tokens) == text and " " in text
    assert [text[o:o + len(t)] for o, t in zip(offsets, tokens)] == tokens


def test_chat_without_the_generation_prompt(server):
    def prompt_tokens(**extra) -> int:
        r = server.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1,
                                                 **extra}, key=KEY)
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens"]
    assert prompt_tokens(add_generation_prompt=False) < prompt_tokens()


def test_a_client_that_disconnects_is_aborted(server):
    body = {"prompt": "what is water", "max_tokens": 200, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body,
                      headers={"Authorization": f"Bearer {KEY}"}, timeout=30) as r:
        lines = r.iter_lines()
        for _ in range(3):
            next(lines)
        assert server.metric("num_requests_running") == 1
    server.wait_idle(10)


def test_48_concurrent_streams(server):
    def one(i: int) -> str:
        chunks = server.client.completions.create(model=server_model(server.client), prompt=[5 + i % 50, 6, 7],
                                                  max_tokens=6 + i % 5, temperature=0.8, seed=i, stream=True,
                                                  extra_body={"ignore_eos": True})
        return "".join(c.choices[0].text for c in chunks if c.choices)

    with concurrent.futures.ThreadPoolExecutor(48) as pool:
        texts = list(pool.map(one, range(48)))
    assert len(texts) == 48 and all(texts)
    server.wait_idle(10)


def test_x_request_id_is_echoed_and_names_the_completion(server):
    """vLLM's X-Request-Id: back in the response's headers (a stream's, an error's), and the
    completion's id, behind OpenAI's prefix; the body's request_id when no header gives one."""
    raw = server.client.completions.with_raw_response.create(model=server_model(server.client), prompt="what is water",
                                                             max_tokens=2, extra_headers={"X-Request-Id": "job-7"})
    assert raw.headers["x-request-id"] == "job-7" and raw.parse().id == "cmpl-job-7"
    body = {"messages": [{"role": "user", "content": "who made oil"}], "max_tokens": 3, "stream": True,
            "ignore_eos": True}
    with server.http.stream("POST", server.url + "/v1/chat/completions", json=body,
                            headers={"Authorization": f"Bearer {KEY}", "X-Request-Id": "chat-8"}) as r:
        assert r.headers["x-request-id"] == "chat-8"
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert len(chunks) >= 2 and {c["id"] for c in chunks} == {"chatcmpl-chat-8"}
    r = server.post("/v1/completions", {"prompt": "x", "temperature": -1}, headers={"X-Request-Id": "bad-9"})
    assert r.status_code == 400 and r.headers["x-request-id"] == "bad-9"
    r = server.post("/v1/completions", {"prompt": "x", "max_tokens": 1, "request_id": "body-1"})
    assert r.json()["id"] == "cmpl-body-1" and "x-request-id" not in r.headers
    r = server.post("/v1/completions", {"prompt": "x", "max_tokens": 1, "request_id": "body-2"},
                    headers={"X-Request-Id": "head-2"})
    assert r.json()["id"] == "cmpl-head-2"


def test_two_requests_under_one_x_request_id_both_run(server):
    """A client may send the same id twice at once: both echo it and both run to the end (the
    engine knows each by an id of its own)."""
    auth = {"Authorization": f"Bearer {KEY}", "X-Request-Id": "twin"}
    body = {"prompt": "what is water", "max_tokens": 120, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    with server.http.stream("POST", server.url + "/v1/completions", json=body, headers=auth) as first:
        lines = first.iter_lines()
        next(lines)  # the first one is running
        assert server.metric("num_requests_running") == 1
        second = server.post("/v1/completions", {"prompt": "what is water", "max_tokens": 8, "temperature": 0,
                                                 "ignore_eos": True}, headers={"X-Request-Id": "twin"})
        rest = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    assert second.status_code == 200, second.text
    assert second.headers["x-request-id"] == "twin" and second.json()["id"] == "cmpl-twin"
    assert second.json()["usage"]["completion_tokens"] == 8
    assert first.headers["x-request-id"] == "twin" and rest[-1]["usage"]["completion_tokens"] == 120
    assert rest[-2]["choices"][0]["finish_reason"] == "length" and {c["id"] for c in rest} == {"cmpl-twin"}
    server.wait_idle()


def _samples(server) -> dict[str, float]:
    """Every sample of /metrics, by name and labels, as one scrape shows them."""
    lines = server.http.get(server.url + "/metrics").text.splitlines()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in lines if line and line[0] != "#"}


VLLM_METRICS = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prefix_cache_queries_total",
                "prefix_cache_hits_total", "num_preemptions_total", "prompt_tokens_total", "generation_tokens_total",
                "time_to_first_token_seconds_bucket", "inter_token_latency_seconds_bucket",
                "e2e_request_latency_seconds_bucket", "request_success_total")


def test_metrics_also_under_vllm_names(server):
    """Each metric again under vLLM's name, with its labels (model_name; finished_reason for
    request_success) and the same value."""
    name = server_model(server.client)
    success = f'vllm:request_success_total{{finished_reason="length",model_name="{name}"}}'
    before = _samples(server)
    server.client.completions.create(model=name, prompt="what is water", max_tokens=3, extra_body={"ignore_eos": True})
    server.wait_idle()
    after = _samples(server)
    for metric in VLLM_METRICS:
        assert any(k.startswith(f"vllm:{metric}{{") and f'model_name="{name}"' in k for k in after), metric
    ours = {k: v for k, v in after.items() if k.startswith("distengine:")}
    assert ours and all(after["vllm:" + k[len("distengine:"):]] == v for k, v in ours.items())
    assert len([k for k in after if k.startswith("vllm:")]) == len(ours)
    assert after[success] == before[success] + 1
    assert after[success.replace("vllm:", "distengine:")] == after[success]


def test_cors_preflight_is_answered(server):
    """vLLM's CORS defaults (any origin, method and header): a browser's preflight gets its 200,
    before any API key is asked for, and the answer names the origin allowed."""
    asked = {"Origin": "http://app.example", "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization, content-type"}
    r = server.http.options(server.url + "/v1/completions", headers=asked)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"
    assert "POST" in r.headers["access-control-allow-methods"]
    r = server.post("/v1/completions", {"prompt": "x", "max_tokens": 1}, headers={"Origin": "http://app.example"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"


def test_bench_serve_against_the_server(server, tmp_path):
    from launch.cli import main
    out = tmp_path / "serve.json"
    assert main(["bench", "serve", "--port", str(server.port), "--api-key", KEY, "--num-prompts", "12",
                 "--random-input-len", "10", "--random-output-len", "5", "--random-prefix-len", "32",
                 "--random-vocab-size", "100", "--request-rate", "50", "--max-concurrency", "6", "--ignore-eos",
                 "--no-progress", "--output-json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["completed"] == 12 and res["failed"] == 0 and res["total_output_tokens"] == 60
    assert res["ttft_ms"]["median"] > 0 and res["itl_ms"]["mean"] > 0 and res["output_throughput"] > 0


def test_bench_serve_records_refused_requests(server, tmp_path, capsys):
    """The load generator speaks plain HTTP: a refusal is counted as a failed request with the
    server's status and message, and no completed request means exit status 1."""
    from launch.cli import main
    out = tmp_path / "serve.json"
    assert main(["bench", "serve", "--port", str(server.port), "--api-key", "wrong", "--model",
                 server_model(server.client), "--num-prompts", "3", "--random-input-len", "4",
                 "--random-output-len", "2", "--no-progress", "--output-json", str(out)]) == 1
    res = json.loads(out.read_text())
    assert res["completed"] == 0 and res["failed"] == 3
    assert res["errors"] and all("HTTP 401" in e and "API key" in e for e in res["errors"])
    assert main(["bench", "serve", "--port", str(server.port), "--api-key", "wrong", "--num-prompts", "1",
                 "--no-progress"]) == 1
    assert "GET /v1/models: HTTP 401" in capsys.readouterr().err


def test_bench_serve_against_a_server_without_tokenizer(tmp_path):
    """Random-weight benchmarks serve a model without a tokenizer: token ids in, empty texts out.
    Each streamed chunk is a step of tokens all the same."""
    from launch.bench.common import build_random_model
    from launch.cli import main
    folder = str(tmp_path / "no-tokenizer")
    build_random_model(folder, "tiny", "cpu", weights=False)
    s = Server(folder, "--load-format", "dummy")
    try:
        out = tmp_path / "serve.json"
        assert main(["bench", "serve", "--port", str(s.port), "--api-key", KEY, "--num-prompts", "4",
                     "--random-input-len", "10", "--random-output-len", "6", "--random-vocab-size", "100",
                     "--ignore-eos", "--no-progress", "--output-json", str(out)]) == 0
        res = json.loads(out.read_text())
        assert res["completed"] == 4 and res["failed"] == 0 and res["total_output_tokens"] == 24, res
        assert res["itl_ms"]["mean"] > 0 and res["tpot_ms"]["mean"] > 0
    finally:
        assert s.stop() == 0


def test_sigterm_finishes_the_request_in_flight_and_exits_0(model):
    s = Server(model)
    body = {"prompt": "what is water", "max_tokens": 60, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", s.url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"},
                      timeout=60) as r:
        lines = r.iter_lines()
        next(lines)
        s.proc.send_signal(signal.SIGTERM)
        rest = [line for line in lines if line]
    assert rest[-1] == "data: [DONE]" and any('"finish_reason": "length"' in line for line in rest)
    assert s.proc.wait(timeout=60) == 0
    with pytest.raises(httpx.HTTPError):
        httpx.get(s.url + "/health", timeout=2)


def _descendants(pid: int, command: str) -> list[int]:
    """PIDs of the processes below `pid` whose command line starts with `command`."""
    children: dict[int, list[int]] = {}
    names: dict[int, str] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    parent = int(f.read().rsplit(")", 1)[1].split()[1])
                with open(f"/proc/{d}/cmdline", "rb") as f:
                    names[int(d)] = f.read().replace(b"\0", b" ").decode(errors="replace")
                children.setdefault(parent, []).append(int(d))
            except (OSError, ValueError, IndexError):
                pass
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        for c in children.get(p, []):
            if names.get(c, "").startswith(command):
                found.append(c)
            todo.append(c)
    return found


def test_tp2_killed_worker_makes_health_503_and_ends_the_request(model):
    s = Server(model, "-tp", "2")
    try:
        assert s.client.completions.create(model=server_model(s.client), prompt="what is water", max_tokens=3,
                                           temperature=0).choices[0].text
        workers = _descendants(s.proc.pid, "ray::Worker")
        assert len(workers) == 2, workers
        body = {"prompt": "what is water", "max_tokens": 200, "temperature": 0, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", s.url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"},
                          timeout=30) as r:
            lines = r.iter_lines()
            next(lines)
            os.kill(workers[1], signal.SIGKILL)
            t = time.monotonic()
            rest = [line for line in lines if line]  # ends, with an error event, instead of hanging
        assert any('"code": 503' in line for line in rest) and rest[-1] == "data: [DONE]"
        assert time.monotonic() - t < 5
        assert _health_until_exit(s) == 503  # then it exits, for a supervisor to restart it
        assert s.proc.wait(timeout=30) == 1
    finally:
        s.stop()


def _health_until_exit(s: Server) -> int | None:
    """/health's status until the server has exited: never 200 once its engine died."""
    status = None
    while s.proc.poll() is None:
        try:
            status = httpx.get(s.url + "/health", timeout=5).status_code
        except httpx.HTTPError:
            break
        assert status == 503, status
        time.sleep(0.05)
    return status if status is not None else 503


def _wait_gone(pid: int, timeout: float) -> None:
    """Until process `pid` has exited (gone, or a zombie its parent has not reaped yet)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return
        except OSError:
            return
        time.sleep(0.1)
    raise AssertionError(f"process {pid} still runs after {timeout} s")


def _engine_process(server: Server) -> int:
    found = _descendants(server.proc.pid, f"{sys.executable} -m distengine.core_client")
    assert len(found) == 1, found
    return found[0]


@pytest.mark.parametrize("sig,message", [(signal.SIGKILL, "the engine process exited"),
                                         (signal.SIGTERM, "the engine process was terminated")],
                         ids=["SIGKILL", "SIGTERM"])
def test_killed_engine_process_makes_health_503_and_ends_the_request(model, sig, message):
    """The engine loop runs in a process of its own: when it dies, the request in flight ends with
    a 503 event, /health turns 503, and the server exits with status 1 (for a supervisor to
    restart it)."""
    s = Server(model)
    try:
        body = {"prompt": "what is water", "max_tokens": 200, "temperature": 0, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", s.url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"},
                          timeout=30) as r:
            lines = r.iter_lines()
            next(lines)
            engine = _engine_process(s)
            os.kill(engine, sig)
            t = time.monotonic()
            rest = [line for line in lines if line]
        assert any('"code": 503' in line and message in line for line in rest), rest
        assert rest[-1] == "data: [DONE]"
        assert time.monotonic() - t < 5
        assert _health_until_exit(s) == 503
        assert s.proc.wait(timeout=30) == 1
        _wait_gone(engine, 30)  # a SIGTERM'd engine shuts down and exits by itself
    finally:
        s.stop()


def test_engine_process_ends_with_the_server(model):
    """A server killed outright leaves no engine process behind (it notices its front end is gone)."""
    s = Server(model)
    engine = _engine_process(s)
    s.proc.kill()
    s.proc.wait()
    _wait_gone(engine, 30)


def test_async_llm_refusals_in_either_engine_placement(model, monkeypatch):
    """The engine's own start-up error reaches the caller as itself; a request id in use is refused
    without touching the one running; a bad DISTENGINE_ENGINE_PROCESS is refused."""
    import asyncio

    from distengine import SamplingParams
    from distengine.async_llm import AsyncLLM, engine_process_default
    from distengine.kv_cache.sizing import KVCacheTooSmallError
    for in_process in (False, True):
        with pytest.raises(KVCacheTooSmallError, match="the KV cache holds 0 blocks"):
            AsyncLLM(model, device="cpu", dtype="float32", max_model_len=256, kv_cache_memory_bytes=1000,
                     engine_process=in_process)
    engine = AsyncLLM(model, device="cpu", dtype="float32", max_model_len=256)
    sp = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)

    async def twice() -> list[int]:
        first = engine.generate("the water is", sp, "same")
        got = [await first.__anext__()]
        with pytest.raises(ValueError, match="request id 'same' is already in use"):
            await engine.generate("oil", sp, "same").__anext__()
        async for out in first:
            got.append(out)
        return [t for o in got for t in o.outputs[0].token_ids]

    try:
        assert len(asyncio.run(twice())) == 20
        assert engine.engine.call("is_idle").result(timeout=10)
    finally:
        engine.shutdown()
    monkeypatch.setenv("DISTENGINE_ENGINE_PROCESS", "yes")
    with pytest.raises(ValueError, match="DISTENGINE_ENGINE_PROCESS must be 0 or 1, got 'yes'"):
        engine_process_default()


@pytest.mark.parametrize("engine_process", [True, False], ids=["engine-process", "engine-thread"])
def test_a_request_id_reused_at_once_gets_only_its_own_tokens(model, engine_process):
    """A request abandoned after a few tokens may still have tokens in a step in flight: the next
    request under the same id must not receive them (the engine knows each by an id of its own)."""
    import asyncio

    from distengine import SamplingParams
    from distengine.async_llm import AsyncLLM
    engine = AsyncLLM(model, device="cpu", dtype="float32", max_model_len=256, engine_process=engine_process)
    greedy = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)

    async def collect(prompt: str, rid: str, keep: int | None = None) -> tuple[list[int], set[str]]:
        ids, names = [], set()
        gen = engine.generate(prompt, greedy, rid)
        async for out in gen:
            ids += out.outputs[0].token_ids
            names.add(out.request_id)
            if keep is not None and len(ids) >= keep:
                await gen.aclose()  # abandoned: aborted at once
                break
        return ids, names

    async def run() -> tuple[list[int], list[tuple[list[int], set[str]]]]:
        reference, _ = await collect("people write with", "ref")
        again = []
        for _ in range(5):
            await collect("the water is", "same", keep=3)
            again.append(await collect("people write with", "same"))
        return reference, again

    try:
        reference, again = asyncio.run(run())
        assert engine.engine.call("is_idle").result(timeout=10)
    finally:
        engine.shutdown()
    assert len(reference) == 30 and all(ids == reference and names == {"same"} for ids, names in again)


@pytest.mark.parametrize("engine_process", [True, False], ids=["engine-process", "engine-thread"])
def test_a_front_end_that_fails_on_outputs_ends_the_engine(model, engine_process):
    """An error while handling a step's outputs ends every request with EngineDeadError (no hang)."""
    import asyncio

    from distengine import SamplingParams
    from distengine.async_llm import AsyncLLM
    from distengine.executor import EngineDeadError
    engine = AsyncLLM(model, device="cpu", dtype="float32", max_model_len=256, engine_process=engine_process)

    def broken(*args, **kwargs):
        raise RuntimeError("the detokenizer broke")

    async def one() -> None:
        async for _ in engine.generate("the water is", SamplingParams(max_tokens=5), "x"):
            pass

    engine.outputs.process = broken
    try:
        with pytest.raises(EngineDeadError, match="the detokenizer broke"):
            asyncio.run(asyncio.wait_for(one(), 60))
        assert not engine.is_running
        with pytest.raises(EngineDeadError):
            asyncio.run(one())
    finally:
        engine.shutdown()


def test_engine_process_messages_carry_errors_that_do_not_pickle():
    """An error the engine process sends (its start failed, a step failed) reaches the front end,
    as itself when it survives pickling, else as a RuntimeError with its text."""
    import pickle

    from distengine.core_client import _picklable
    from distengine.engine_messages import EngineDied, StartFailed

    class NeedsTwo(Exception):
        def __init__(self, a, b):
            super().__init__(f"{a} and {b}")

    msg = pickle.loads(_picklable(StartFailed(NeedsTwo(1, 2))))
    assert type(msg) is StartFailed and type(msg.error) is RuntimeError and str(msg.error) == "NeedsTwo: 1 and 2"
    msg = pickle.loads(_picklable(EngineDied(ValueError("max_model_len too large"))))
    assert type(msg.error) is ValueError and str(msg.error) == "max_model_len too large"


def test_stats_line_over_each_interval(caplog):
    """vLLM's periodic stats line: throughputs and hit rate over the interval, the state now;
    nothing for an idle interval; a bad interval is refused."""
    import dataclasses
    import logging

    from distengine.metrics import EngineMetrics, StatsLogger
    from distengine.scheduler import SchedulerStats
    metrics = EngineMetrics("m")
    busy = SchedulerStats(running=2, waiting=1, kv_usage=0.25, peak_kv_usage=0.25, prefix_cache_hit_rate=0.0,
                          preemptions=0, prefix_cache_queries=0, prefix_cache_hits=0)
    logger = StatsLogger(2.0)
    with caplog.at_level(logging.INFO, logger="distengine.stats"):
        logger.tick(100.0, metrics, busy)             # starts the first interval
        metrics.count_prompt(300)
        metrics.count_generated(40)
        busy = dataclasses.replace(busy, prefix_cache_queries=200, prefix_cache_hits=50)
        metrics.record_state(busy)
        logger.tick(101.0, metrics, busy)             # within the interval: nothing yet
        logger.tick(104.0, metrics, busy)
        logger.tick(107.0, metrics, dataclasses.replace(busy, running=0, waiting=0))  # idle interval: nothing
    lines = [r.getMessage() for r in caplog.records if r.name == "distengine.stats"]
    assert lines == ["avg prompt throughput: 75.0 tokens/s, avg generation throughput: 10.0 tokens/s, "
                     "running: 2 reqs, waiting: 1 reqs, KV cache usage: 25.0%, prefix cache hit rate: 25.0%"]
    with pytest.raises(ValueError, match="must be > 0"):
        StatsLogger(0)


def test_server_logs_stats_while_busy(model, monkeypatch):
    monkeypatch.setenv("DISTENGINE_LOG_STATS_INTERVAL", "0.2")  # the default, 10 s, is too slow for a test
    s = Server(model)
    try:
        out = s.client.completions.create(model=server_model(s.client), prompt="water is", max_tokens=40,
                                          temperature=0, extra_body={"ignore_eos": True})
        assert out.usage.completion_tokens == 40
    finally:
        assert s.stop() == 0
    text = s.proc.stdout.read()
    assert re.search(r"distengine: avg prompt throughput: [\d.]+ tokens/s, avg generation throughput: "
                     r"[\d.]+ tokens/s, running: \d+ reqs, waiting: \d+ reqs, KV cache usage: [\d.]+%", text), text


def test_bad_stats_interval_exits_2(model):
    env = {**os.environ, "DISTENGINE_LOG_STATS_INTERVAL": "soon"}
    proc = subprocess.run([sys.executable, "-m", "launch.cli", "serve", model, "--device", "cpu", "--port",
                           str(free_port())], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "DISTENGINE_LOG_STATS_INTERVAL must be a number of seconds > 0" in proc.stderr


@pytest.mark.parametrize("engine_process", [True, False], ids=["engine-process", "engine-thread"])
def test_async_llm_serves_two_event_loops_at_once(model, engine_process):
    """Each step's outputs go to every event loop with requests in it, in one hand-off per loop:
    two loops in two threads stream at the same time and get what one loop alone gets, with the
    engine loop in its own process or in a thread."""
    import asyncio
    import threading

    from distengine import SamplingParams
    from distengine.async_llm import AsyncLLM
    engine = AsyncLLM(model, device="cpu", dtype="float32", max_model_len=256, engine_process=engine_process)
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = ["the water is", "people write with"]

    async def collect(prompt: str, rid: str) -> tuple[list[int], str, int, int]:
        ids, text, deltas = [], "", 0
        async for out in engine.generate(prompt, sp, rid):
            ids += out.outputs[0].token_ids
            text += out.outputs[0].text
            deltas += 1
        return ids, text, deltas, len(out.prompt_token_ids)

    try:
        alone = [asyncio.run(collect(p, f"alone-{i}")) for i, p in enumerate(prompts)]
        together: dict[int, tuple] = {}
        threads = [threading.Thread(target=lambda i=i, p=p: together.__setitem__(i, asyncio.run(collect(p, f"t-{i}"))))
                   for i, p in enumerate(prompts)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        # The same tokens and text (how many deltas carried them may differ: a late reader gets them merged).
        assert [(r[0], r[1], r[3]) for r in (together[0], together[1])] == [(r[0], r[1], r[3]) for r in alone]
        assert all(len(ids) == 12 and deltas >= 2 for ids, _, deltas, _ in alone)
        assert engine.engine.call("is_idle").result(timeout=10)
        # The counters behind /metrics and the stats line: every prompt once, every token once.
        assert engine.metrics.totals()[:2] == (2 * sum(r[3] for r in alone), 4 * 12)
    finally:
        engine.shutdown()


def test_a_consumer_that_falls_behind_gets_merged_deltas(model):
    """What piled up while the consumer was away comes as one delta, the same tokens, text and
    logprobs as one by one."""
    import asyncio

    from distengine import SamplingParams
    from distengine.async_llm import AsyncLLM
    engine = AsyncLLM(model, device="cpu", dtype="float32", max_model_len=256)
    sp = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=2)

    async def consume(rid: str, wait_first: bool) -> list:
        outs = []
        gen = engine.generate("the water is", sp, rid)
        if wait_first:  # the engine finishes the request before anything is read
            first = asyncio.ensure_future(gen.__anext__())
            while rid not in engine._engine_ids:  # sent to the engine (is_idle before that is no news)
                await asyncio.sleep(0.01)
            while not engine.engine.call("is_idle").result(timeout=10):
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.2)
            outs.append(await first)
        async for out in gen:
            outs.append(out)
        return outs

    try:
        steady = asyncio.run(consume("steady", False))
        late = asyncio.run(consume("late", True))
    finally:
        engine.shutdown()
    assert len(steady) >= 5 and len(late) <= 2 and late[-1].finished
    assert len(late[-1].outputs[0].token_ids) >= 8  # all but what the pending read took at once

    def joined(outs):
        c = [o.outputs[0] for o in outs]
        return (sum((x.token_ids for x in c), []), "".join(x.text for x in c), sum((x.logprobs for x in c), []),
                c[-1].finish_reason)
    assert joined(late) == joined(steady) and len(joined(late)[0]) == 10 == len(joined(late)[2])
