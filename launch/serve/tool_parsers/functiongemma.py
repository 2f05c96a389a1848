"""FunctionGemma's format (`functiongemma`: google/functiongemma-270m-it, a Gemma 3 model tuned
for calls; the other Gemma 3 checkpoints publish no call format of their own): content, then
calls `<start_function_call>call:NAME{key:<escape>text<escape>,count:3}<end_function_call>`.
String values sit between `<escape>` tokens (so they may hold any character); other values are
bare literals (numbers, true, false, null), nested `{...}` objects or `[...]` lists. A call the
model did not close (it stopped) still counts. The markers are special tokens, kept in the text.
Streamed, a call's name is sent once written, its arguments once its braces close."""
from __future__ import annotations

import json
import re

from launch.serve.tool_parsers.base import ParsedOutput, PartialCall, PartialOutput, ToolCall, ToolParser, held_back

START, END, ESCAPE = "<start_function_call>", "<end_function_call>", "<escape>"
HEAD = re.compile(r"call:([\w.-]+)\{")
KEY = re.compile(r"\s*([\w-]+)\s*:")


class Incomplete(Exception):
    """The text ends inside the value."""


def _value(s: str, i: int):
    """(value, index after it) of the value at s[i]; ValueError if it is not one."""
    if i >= len(s):
        raise Incomplete
    if s.startswith(ESCAPE, i):
        end = s.find(ESCAPE, i + len(ESCAPE))
        if end < 0:
            raise Incomplete
        return s[i + len(ESCAPE):end], end + len(ESCAPE)
    if ESCAPE.startswith(s[i:]):
        raise Incomplete
    if s[i] == "{":
        return _object(s, i + 1)
    if s[i] == "[":
        items, j = [], i + 1
        while True:
            j = _skip(s, j)
            if s[j] == "]":
                return items, j + 1
            item, j = _value(s, j)
            items.append(item)
    j = i
    while j < len(s) and s[j] not in ",}]":
        j += 1
    if j >= len(s):
        raise Incomplete
    return json.loads(s[i:j].strip()), j  # a number, true, false or null


def _skip(s: str, i: int) -> int:
    while i < len(s) and (s[i].isspace() or s[i] == ","):
        i += 1
    if i >= len(s):
        raise Incomplete
    return i


def _object(s: str, i: int) -> tuple[dict, int]:
    """The members after an object's `{` at s[i - 1], and the index after its `}`."""
    out = {}
    while True:
        i = _skip(s, i)
        if s[i] == "}":
            return out, i + 1
        m = KEY.match(s, i)
        if m is None:
            if re.fullmatch(r"\s*[\w-]*", s[i:]):
                raise Incomplete
            raise ValueError("not a key")
        out[m.group(1)], i = _value(s, m.end())


def _call(body: str) -> tuple[str | None, dict | None, int | None]:
    """(name, arguments, end) of the call starting at body[0]: the name None until written, the
    arguments None until the call closes; ValueError if it is not a call."""
    m = HEAD.match(body)
    if m is None:
        if "call:".startswith(body[:5]) and re.fullmatch(r"(call:)?[\w.-]*", body) or not body:
            return None, None, None
        raise ValueError("not a call")
    try:
        args, end = _object(body, m.end())
    except Incomplete:
        return m.group(1), None, None
    return m.group(1), args, end


class FunctionGemmaParser(ToolParser):
    keeps_special_tokens = True

    def parse(self, text: str) -> ParsedOutput:
        first = text.find(START)
        if first < 0:
            return ParsedOutput(text, [])
        calls = []
        try:
            for block in text[first:].split(START)[1:]:
                name, args, end = _call(block)
                if args is None or block[end:].strip() not in ("", END):
                    raise ValueError("not a whole call")
                calls.append(ToolCall(name, json.dumps(args, ensure_ascii=False)))
        except (ValueError, Incomplete, RecursionError):
            return ParsedOutput(text, [])
        return ParsedOutput(text[:first] or None, calls)

    def parse_prefix(self, text: str) -> PartialOutput:
        first = text.find(START)
        if first < 0:
            return PartialOutput(text[:len(text) - held_back(text, START)], [])
        calls = []
        for block in text[first:].split(START)[1:]:
            try:
                name, args, _ = _call(block)
            except (ValueError, RecursionError):
                break
            if name is None:
                break
            calls.append(PartialCall(name, "" if args is None else json.dumps(args, ensure_ascii=False)))
            if args is None:
                break
        return PartialOutput(text[:first], calls)
