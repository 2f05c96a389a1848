"""Tool calling on `distengine serve`, driven by the real `openai` client: tools and tool
messages reach the chat template (as transformers passes them, an assistant's arguments as
objects); "auto" with `--tool-call-parser` answers with content when the model calls nothing;
the tool fields' mistakes are 400s naming the field. With structured outputs in the engine, a
named function and "required" return calls whose arguments parse and satisfy the tools'
parameters, streamed and not (on the byte-level model, which can spell JSON)."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("openai")
pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("ray")

from tests.server_harness import Server, build_served_model  # noqa: E402

# Prints the tools and every kind of message in the tiny model's words ("call" a call, "user ID :" a result).
TOOLS_TEMPLATE = (
    "{% for t in tools or [] %}system {{ t['function']['name'] }} . {% endfor %}"
    "{% for m in messages %}{% if m['role'] == 'tool' %}user {{ m['tool_call_id'] }} : {{ m['content'] }} . "
    "{% elif m['tool_calls'] is defined %}assistant call {% for c in m['tool_calls'] %}{{ c['function']['name'] }} "
    "{{ c['function']['arguments']['where'] }} {% endfor %}. "
    "{% else %}{{ m['role'] }} : {{ m['content'] }} . {% endif %}{% endfor %}"
    "{% if add_generation_prompt %}assistant :{% endif %}")
TOOLS = [{"type": "function", "function": {"name": "water", "description": "where water is",
                                           "parameters": {"type": "object", "properties": {"where": {"type": "string"}},
                                                          "required": ["where"]}}},
         {"type": "function", "function": {"name": "oil"}}]
ASK = [{"role": "user", "content": "who made oil"}]
CONVERSATION = ASK + [{"role": "assistant", "content": None,
                       "tool_calls": [{"id": "call", "type": "function",
                                       "function": {"name": "water", "arguments": '{"where": "day"}'}}]},
                      {"role": "tool", "tool_call_id": "call", "content": "long"}]


def _has_structured_outputs() -> bool:
    try:
        from distengine import StructuredOutputsParams  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tools")
    model = build_served_model(str(folder / "model"))
    template = folder / "tools.jinja"
    template.write_text(TOOLS_TEMPLATE)
    s = Server(model, "--chat-template", str(template), "--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    yield s
    assert s.stop() == 0


def test_tools_and_tool_messages_go_through_the_template(server):
    expected = "system water . system oil . user : who made oil . assistant call water day . user call : long . " \
               "assistant :"
    rendered = server.post("/tokenize", {"messages": CONVERSATION, "tools": TOOLS}).json()
    assert rendered["tokens"] == server.post("/tokenize", {"prompt": expected}).json()["tokens"]
    r = server.client.chat.completions.create(model=server.client.models.list().data[0].id,
                                              messages=CONVERSATION, tools=TOOLS, tool_choice="none", max_tokens=2)
    assert r.usage.prompt_tokens == rendered["count"] and r.choices[0].message.content


def test_auto_returns_content_when_the_model_calls_nothing(server):
    c = server.client
    name = c.models.list().data[0].id
    common = dict(model=name, messages=ASK, tools=TOOLS, max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    plain = c.chat.completions.create(tool_choice="none", **common)
    auto = c.chat.completions.create(**common)  # "auto": the default with tools
    text = plain.choices[0].message.content
    assert auto.choices[0].message.content == text and "<tool_call>" not in text
    assert not auto.choices[0].message.tool_calls and auto.choices[0].finish_reason == "length"
    chunks = list(c.chat.completions.create(stream=True, tool_choice="auto", **common))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == text
    assert not any(ch.choices[0].delta.tool_calls for ch in chunks)
    assert chunks[-1].choices[0].finish_reason == "length" and chunks[0].choices[0].delta.role == "assistant"


BAD = [  # (what, body fields, message part, param)
    ("a tool without its function", {"tools": [{"type": "function"}]}, "tools.0.function", "tools"),
    ("a tool of another type", {"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools.0.type", "tools"),
    ("a tool without a name", {"tools": [{"type": "function", "function": {"description": "x"}}]},
     "tools.0.function.name", "tools"),
    ("a tool_choice of no known kind", {"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "tool_choice"),
    ("a named function not among the tools",
     {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "fire"}}},
     "the function 'fire' is not among the tools ['water', 'oil']", "tool_choice"),
    ("tool_choice without tools", {"tool_choice": "auto"}, "`tools` must be set", "tool_choice"),
    ("an assistant call without its arguments",
     {"messages": ASK + [{"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "water"}}]}]},
     "messages.1.tool_calls.0.function.arguments", "messages"),
    ("tools with beam search", {"tools": TOOLS, "use_beam_search": True, "n": 2}, "tools do not apply to beam search",
     "tools"),
    ("two tools' $defs of one name under required",
     {"tools": [{"type": "function", "function": {"name": n, "parameters": {"type": "object",
                                                                            "$defs": {"d": {"type": t}}}}}
                for n, t in (("f", "string"), ("g", "integer"))], "tool_choice": "required"},
     "two tools define $defs 'd' differently", "tools"),
    ("OpenAI's older functions", {"functions": [{"name": "f"}]}, "functions is not supported", "functions"),
]


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_tool_field_mistakes_are_400s(server, case):
    what, fields, message, param = case
    r = server.post("/v1/chat/completions", {"messages": ASK, "max_tokens": 2, **fields})
    assert r.status_code == 400, (what, r.text)
    err = r.json()["error"]
    assert message in err["message"] and err["param"] == param, err


@pytest.mark.skipif(_has_structured_outputs(), reason="this build has structured outputs")
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "water"}}],
                         ids=["required", "named"])
def test_forced_choices_without_structured_outputs_are_refused_by_name(server, choice):
    r = server.post("/v1/chat/completions", {"messages": ASK, "tools": TOOLS, "tool_choice": choice})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
    assert "needs structured outputs" in r.json()["error"]["message"]


# ---- forced choices: they need structured outputs in the engine -------------------------------

needs_structured_outputs = pytest.mark.skipif(not _has_structured_outputs(),
                                              reason="needs distengine.StructuredOutputsParams (structured outputs)")
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                                           "days": {"type": "integer"}},
                                          "required": ["city", "days"], "additionalProperties": False}}}
NOW = {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}


def _satisfies(arguments: str, tool: dict) -> bool:
    """The arguments parse and have the parameters' required keys with their types (the schemas
    here use only string and integer properties)."""
    value = json.loads(arguments)
    schema = tool["function"]["parameters"]
    types = {"string": str, "integer": int}
    props = schema.get("properties", {})
    return isinstance(value, dict) and all(k in value for k in schema.get("required", [])) and \
        all(k in props and isinstance(v, types[props[k]["type"]]) and not isinstance(v, bool) for k, v in value.items())


@pytest.fixture(scope="module")
def byte_server(tmp_path_factory):
    if not _has_structured_outputs():
        pytest.skip("needs distengine.StructuredOutputsParams (structured outputs)")
    from tests.server_harness import build_byte_level_model
    folder = tmp_path_factory.mktemp("bytes")
    model = build_byte_level_model(str(folder / "model"), chat_template=TOOLS_TEMPLATE)
    s = Server(model, "--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    yield s
    assert s.stop() == 0


def _streamed_calls(stream) -> tuple[dict[int, dict], list]:
    chunks = list(stream)
    calls: dict[int, dict] = {}
    for ch in chunks:
        for d in ch.choices[0].delta.tool_calls or []:
            if d.id is not None:
                assert d.index not in calls and d.type == "function" and d.function.name
                calls[d.index] = {"id": d.id, "name": d.function.name, "arguments": ""}
            calls[d.index]["arguments"] += d.function.arguments or ""
    return calls, [ch.choices[0].finish_reason for ch in chunks if ch.choices[0].finish_reason]


@needs_structured_outputs
def test_a_named_function_is_called(byte_server):
    c = byte_server.client
    name = c.models.list().data[0].id
    common = dict(model=name, messages=ASK, tools=[WEATHER, NOW], max_tokens=200, seed=3, temperature=1.0,
                  tool_choice={"type": "function", "function": {"name": "get_weather"}})
    r = c.chat.completions.create(**common)
    calls = r.choices[0].message.tool_calls
    assert len(calls) == 1 and calls[0].function.name == "get_weather" and calls[0].id.startswith("chatcmpl-tool-")
    assert _satisfies(calls[0].function.arguments, WEATHER), calls[0].function.arguments
    assert not r.choices[0].message.content and r.choices[0].finish_reason == "stop"  # vLLM's, for a named one
    streamed, reasons = _streamed_calls(c.chat.completions.create(stream=True, **common))
    assert list(streamed) == [0] and streamed[0]["name"] == "get_weather"
    assert streamed[0]["arguments"] == calls[0].function.arguments and reasons == ["stop"]  # the same seed


@needs_structured_outputs
@pytest.mark.parametrize("parallel", [True, False], ids=["parallel", "one-call"])
def test_required_calls_a_tool(byte_server, parallel):
    c = byte_server.client
    name = c.models.list().data[0].id
    tools = [WEATHER, NOW]
    common = dict(model=name, messages=ASK, tools=tools, tool_choice="required", max_tokens=200, seed=9,
                  temperature=1.0, parallel_tool_calls=parallel)
    r = c.chat.completions.create(**common)
    calls = r.choices[0].message.tool_calls
    assert calls and r.choices[0].finish_reason == "tool_calls", r.choices[0]
    assert parallel or len(calls) == 1
    by_name = {t["function"]["name"]: t for t in tools}
    for call in calls:
        assert call.type == "function" and _satisfies(call.function.arguments, by_name[call.function.name])
    streamed, reasons = _streamed_calls(c.chat.completions.create(stream=True, **common))
    assert [(v["name"], v["arguments"]) for _, v in sorted(streamed.items())] == \
        [(x.function.name, x.function.arguments) for x in calls]
    assert reasons == ["tool_calls"]


@needs_structured_outputs
@pytest.mark.parametrize("fields", [{"response_format": {"type": "json_object"}},
                                    {"structured_outputs": {"regex": "[a-z]+"}}, {"guided_json": {"type": "object"}}],
                         ids=["response_format", "structured_outputs", "guided_json"])
def test_a_forced_choice_takes_no_schema_of_the_requests_own(server, fields):
    r = server.post("/v1/chat/completions", {"messages": ASK, "tools": TOOLS, "tool_choice": "required", **fields})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice", r.text
    assert "cannot be combined" in r.json()["error"]["message"]


@needs_structured_outputs
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "f"}}],
                         ids=["required", "named"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_forced_choice_over_parameters_that_do_not_compile_is_a_400_naming_tools(server, choice, stream):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}]
    r = server.post("/v1/chat/completions", {"messages": ASK, "tools": tools, "tool_choice": choice, "stream": stream})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.text
    assert r.json()["error"]["message"].startswith("tools: the schema of the forced tool choice"), r.text


@needs_structured_outputs
def test_auto_reads_a_call_the_model_writes(byte_server):
    """A hermes call the output is kept to (vLLM's structured_outputs regex) comes back as a call
    under "auto", with the text before it as content, streamed and not."""
    c = byte_server.client
    text = 'Now.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n</tool_call>'
    regex = text.replace(".", "\\.").replace("{", "\\{").replace("}", "\\}")
    common = dict(model=c.models.list().data[0].id, messages=ASK, tools=[WEATHER, NOW], max_tokens=120,
                  extra_body={"structured_outputs": {"regex": regex}})
    r = c.chat.completions.create(**common)
    message = r.choices[0].message
    assert message.content == "Now.\n" and r.choices[0].finish_reason == "tool_calls"
    assert [(t.function.name, json.loads(t.function.arguments)) for t in message.tool_calls] == \
        [("get_weather", {"city": "Oslo", "days": 2})]
    chunks = list(c.chat.completions.create(stream=True, **common))
    streamed, reasons = _streamed_calls(chunks)
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == "Now.\n"
    assert streamed[0]["arguments"] == message.tool_calls[0].function.arguments and reasons == ["tool_calls"]


def test_random_tool_bodies_never_5xx(server):
    """Tools, tool choices and tool messages of any shape are answered, never with a 5xx."""
    pytest.importorskip("hypothesis")
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st
    scalars = st.one_of(st.none(), st.booleans(), st.integers(-2 ** 70, 2 ** 70), st.text(max_size=6),
                        st.sampled_from(["function", "auto", "none", "required", "water", "{}", "\ud800"]))
    values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3) |
                          st.dictionaries(st.sampled_from(["type", "function", "name", "parameters", "arguments",
                                                           "id", "$defs", "properties", "x"]), inner, max_size=3),
                          max_leaves=8)
    tool = st.one_of(values, st.builds(lambda name, params: {"type": "function", "function": {
        "name": name, "parameters": params}}, st.sampled_from(["water", "oil", ""]), values))
    message = st.one_of(values, st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "tool"])},
                                                      optional={"content": values, "tool_calls": values,
                                                                "tool_call_id": values}))
    body = st.fixed_dictionaries({"messages": st.lists(message, min_size=1, max_size=3), "max_tokens": st.just(2)},
                                 optional={"tools": st.one_of(values, st.lists(tool, max_size=3)),
                                           "tool_choice": st.one_of(values, st.just({"type": "function",
                                                                                     "function": {"name": "water"}})),
                                           "parallel_tool_calls": values, "stream": st.booleans()})

    @settings(max_examples=40, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(body=body)
    def check(body):
        r = server.post("/v1/chat/completions", json.dumps(body), raw=True)
        assert r.status_code < 500, (body, r.status_code, r.text)
    check()
    assert server.post("/v1/chat/completions", {"messages": ASK, "max_tokens": 2}).status_code == 200
