"""The tool-call parsers on strings: each format read whole, and streamed in random-sized pieces
(the streamed content and arguments, joined, equal the whole reading; a call's first delta
carries its id, type and name, later ones only arguments); output a parser cannot read stays
content; the forced choices' outputs; vLLM's "required" schema."""
from __future__ import annotations

import json
import random

import pytest

from launch.serve.tool_parsers import PARSERS, ToolCall, ToolCallStream, tool_parser
from launch.serve.tool_parsers.forced import NamedFunctionOutput, RequiredCallsOutput

WEATHER = '{"city": "Paris", "days": [1, 2], "note": "a \\"quoted\\" } brace"}'

# (parser, text, expected content, expected calls)
CASES = [
    ("hermes", f'Let me look.\n<tool_call>\n{{"name": "get_weather", "arguments": {WEATHER}}}\n</tool_call>\n'
               '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>',
     "Let me look.\n", [ToolCall("get_weather", WEATHER), ToolCall("now", "{}")]),
    ("hermes", f'<tool_call>\n{{"arguments": {WEATHER}, "name": "get_weather"}}\n</tool_call>',
     None, [ToolCall("get_weather", WEATHER)]),
    ("hermes", f'<tool_call>\n{{"name": "get_weather", "arguments": {WEATHER}}}',  # stopped before the end tag
     None, [ToolCall("get_weather", WEATHER)]),
    ("hermes", "No tools needed: 2 < 3 and <tool is not a tag.", "No tools needed: 2 < 3 and <tool is not a tag.", []),
    ("llama3_json", f'{{"name": "get_weather", "parameters": {WEATHER}}}; {{"name": "now", "parameters": {{}}}}',
     None, [ToolCall("get_weather", WEATHER), ToolCall("now", "{}")]),
    ("llama4_json", f'<|python_tag|>{{"name": "get_weather", "arguments": {WEATHER}}}',
     None, [ToolCall("get_weather", WEATHER)]),
    ("llama3_json", "The weather is fine {today}.", "The weather is fine {today}.", []),
    ("pythonic", '[get_weather(city="Paris", days=[1, 2], note=\'a ") brace\'), now()]',
     None, [ToolCall("get_weather", json.dumps({"city": "Paris", "days": [1, 2], "note": 'a ") brace'})),
            ToolCall("now", "{}")]),
    ("llama4_pythonic", '<|python_start|>[f(x=None, y=True, z={"k": 1.5})]<|python_end|>',
     None, [ToolCall("f", '{"x": null, "y": true, "z": {"k": 1.5}}')]),
    ("pythonic", "[not a call]", "[not a call]", []),
    ("openai", "<|channel|>analysis<|message|>The user wants weather.<|end|><|start|>assistant<|channel|>commentary "
               f"to=functions.get_weather <|constrain|>json<|message|>{WEATHER}<|call|>",
     None, [ToolCall("get_weather", WEATHER)]),
    ("openai", "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>It is 4.",
     "It is 4.", []),
    ("openai", '<|start|>assistant to=functions.now<|channel|>commentary json<|message|>{}<|call|>',
     None, [ToolCall("now", "{}")]),
    ("functiongemma", "Sure.<start_function_call>call:get_weather{city:<escape>Paris, {FR}<escape>,days:3,"
                      "opts:{metric:true,tags:[<escape>a<escape>,2]}}<end_function_call>"
                      "<start_function_call>call:now{}<end_function_call>",
     "Sure.", [ToolCall("get_weather", json.dumps({"city": "Paris, {FR}", "days": 3,
                                                   "opts": {"metric": True, "tags": ["a", 2]}})),
               ToolCall("now", "{}")]),
    ("functiongemma", "<start_function_call>call:now{zone:<escape>UTC<escape>}",  # stopped before the end tag
     None, [ToolCall("now", '{"zone": "UTC"}')]),
    ("functiongemma", "No call <start here.", "No call <start here.", []),
]


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_whole_and_streamed_readings_agree(case):
    name, text, content, calls = case
    parser = tool_parser(name)
    whole = parser.parse(text)
    assert (whole.content, whole.calls) == (content, calls)
    for seed in range(5):
        rng = random.Random(seed)
        stream = ToolCallStream(parser)
        deltas, i = [], 0
        while i < len(text):
            k = rng.randint(1, 7)
            deltas.append(stream.feed(text[i:i + k], final=i + k >= len(text)))
            i += k
        assert "".join(d.content for d in deltas) == (content or "")
        pieces = [c for d in deltas for c in d.calls]
        for index, call in enumerate(calls):
            mine = [p for p in pieces if p.index == index]
            assert mine[0].id.startswith("chatcmpl-tool-") and mine[0].name == call.name
            assert all(p.id is None and p.name is None for p in mine[1:])
            assert "".join(p.arguments for p in mine) == call.arguments
            assert mine[0].body()["type"] == "function"
        assert {p.index for p in pieces} == set(range(len(calls)))


@pytest.mark.parametrize("name,text", [
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {"a": }\n</tool_call>'),
    ("hermes", '<tool_call>\n["f"]\n</tool_call>'),
    ("hermes", '<tool_call>\n{"arguments": {}}\n</tool_call>'),
    ("llama3_json", '{"name": "f", "parameters": {"a": 1}} and more'),
    ("llama3_json", '{"name": 3, "parameters": {}}'),
    ("pythonic", "[f(1, 2)]"),
    ("pythonic", "[f(x=open('a'))]"),
    ("pythonic", "[f(x=1)"),
    ("functiongemma", "<start_function_call>call:f{x:<escape>open}<end_function_call>"),
    ("functiongemma", "<start_function_call>f{x:1}<end_function_call>"),
    ("functiongemma", "<start_function_call>call:f{x:1} and more"),
])
def test_malformed_output_stays_content(name, text):
    out = tool_parser(name).parse(text)
    assert out.content == text and out.calls == []


def test_partial_markers_are_held_back_then_released():
    stream = ToolCallStream(tool_parser("hermes"))
    assert stream.feed("It is <tool").content == "It is "
    assert stream.feed("s> today", final=True).content == "<tools> today"
    stream = ToolCallStream(tool_parser("pythonic"))
    assert stream.feed("[f(a=1), g(b=").calls[0].arguments == '{"a": 1}'


def test_parallel_tool_calls_false_keeps_the_first_call():
    text = '<tool_call>{"name": "f", "arguments": {}}</tool_call><tool_call>{"name": "g", "arguments": {}}</tool_call>'
    stream = ToolCallStream(tool_parser("hermes"), max_calls=1)
    pieces = (text[:30], text[30:70], text[70:])
    got = [c for i, piece in enumerate(pieces) for c in stream.feed(piece, final=i == 2).calls]
    assert {c.index for c in got} == {0} and got[0].name == "f"


def test_forced_outputs():
    named = NamedFunctionOutput("get_weather")
    assert named.parse(WEATHER).calls == [ToolCall("get_weather", WEATHER)]
    stream = ToolCallStream(named)
    parts = [stream.feed(WEATHER[:5]), stream.feed(WEATHER[5:], final=True)]
    assert parts[0].calls[0].name == "get_weather" and "".join(c.arguments for p in parts for c in p.calls) == WEATHER
    required = RequiredCallsOutput()
    text = f'[{{"name": "get_weather", "parameters": {WEATHER}}}, {{"name": "now", "parameters": {{}}}}]'
    assert required.parse(text).calls == [ToolCall("get_weather", WEATHER), ToolCall("now", "{}")]
    assert required.parse(text[:-3]).calls == []  # cut short: no calls, the text as content
    stream = ToolCallStream(required)
    deltas = [stream.feed(text[i:i + 4], final=i + 4 >= len(text)) for i in range(0, len(text), 4)]
    calls = [c for d in deltas for c in d.calls]
    assert "".join(c.arguments for c in calls if c.index == 1) == "{}"
    assert "".join(c.arguments for c in calls if c.index == 0) == WEATHER


def test_required_schema_is_vllms():
    from launch.serve.tool_calls import forced_schema
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                          "properties": {"a": {"type": "integer"}}}}},
             {"type": "function", "function": {"name": "g"}}]
    schema = forced_schema("required", tools, parallel=True)
    assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    options = schema["items"]["anyOf"]
    assert [o["properties"]["name"]["enum"] for o in options] == [["f"], ["g"]]
    assert options[1]["properties"]["parameters"] == {"type": "object", "properties": {}}
    assert forced_schema("required", tools, parallel=False)["maxItems"] == 1
    assert forced_schema({"type": "function", "function": {"name": "f"}}, tools, True) == \
        tools[0]["function"]["parameters"]
    assert forced_schema("auto", tools, True) is None and forced_schema("none", tools, True) is None
    place = {"type": "object", "properties": {"city": {"type": "string"}}}
    with_defs = [{"type": "function", "function": {"name": n, "parameters": {
        "type": "object", "properties": {"at": {"$ref": "#/$defs/place"}}, "$defs": {"place": place}}}}
        for n in ("h", "k")]
    assert forced_schema("required", with_defs, True)["$defs"] == {"place": place}  # where the refs point
    other = {**with_defs[1], "function": {**with_defs[1]["function"], "parameters": {
        "type": "object", "properties": {"at": {"$ref": "#/$defs/place"}}, "$defs": {"place": {"type": "string"}}}}}
    with pytest.raises(ValueError, match="tools: two tools define \\$defs 'place' differently"):
        forced_schema("required", [with_defs[0], other], True)


def test_unknown_parser_is_refused_by_name():
    with pytest.raises(ValueError, match=r"--tool-call-parser 'nope' is not a known parser; choose one of"):
        tool_parser("nope")
    assert {"hermes", "llama3_json", "llama4_json", "pythonic", "openai", "functiongemma"} <= set(PARSERS)


def test_a_requests_reading_of_its_choices():
    """"auto" without a call answers content; the finish reason is "tool_calls" for "auto" with a
    call and for "required" that stopped, the engine's for a named function (vLLM's rules)."""
    from launch.serve.tool_calls import AUTO_NEEDS_FLAGS, tool_output
    tools = [{"type": "function", "function": {"name": "f"}}]
    auto = tool_output("auto", tools, True, tool_parser("hermes"))
    assert auto.message("just text") == {"role": "assistant", "content": "just text", "tool_calls": []}
    assert auto.finish_reason("length", False) == "length"
    harmony = tool_output("auto", tools, True, tool_parser("openai"))
    text = "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>It is 4."
    assert harmony.message(text) == {"role": "assistant", "content": "It is 4.", "tool_calls": []}
    message = auto.message('<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>')
    assert message["content"] is None and message["tool_calls"][0]["function"] == \
        {"name": "f", "arguments": '{"a": 1}'}
    assert auto.finish_reason("stop", True) == "tool_calls"
    named = tool_output({"type": "function", "function": {"name": "f"}}, tools, True, None)
    message = named.message('{"a": 1}')
    assert message["content"] == "" and message["tool_calls"] and named.finish_reason("stop", True) == "stop"
    required = tool_output("required", tools, True, None)
    assert required.message('[{"name": "f", "parameters": {}}]')["tool_calls"]
    assert required.finish_reason("stop", True) == "tool_calls" and required.finish_reason("length", True) == "length"
    assert tool_output("none", tools, True, None) is None and tool_output("auto", None, True, None) is None
    with pytest.raises(ValueError, match=AUTO_NEEDS_FLAGS):
        tool_output("auto", tools, True, None)
