"""A JSON scanner for text still being written: where a value ends (None while it has not), and
the members of an object as far as they are written, so that a call's name is known once its
string closes and its arguments can be sent as they grow. Whether the text is valid JSON is left
to `json.loads` once a value is complete."""
from __future__ import annotations

import json

from launch.serve.tool_parsers.base import PartialCall, ToolCall

WHITESPACE = " \t\r\n"


def skip_ws(s: str, i: int, more: str = "") -> int:
    while i < len(s) and (s[i] in WHITESPACE or s[i] in more):
        i += 1
    return i


def string_end(s: str, i: int) -> int | None:
    """The index after the string opening at s[i]."""
    j = i + 1
    while j < len(s):
        if s[j] == "\\":
            j += 2
            continue
        if s[j] == '"':
            return j + 1
        j += 1
    return None


def value_end(s: str, i: int) -> int | None:
    """The index after the JSON value starting at s[i] (no leading whitespace)."""
    if s[i] == '"':
        return string_end(s, i)
    if s[i] in "{[":
        depth, j = 0, i
        while j < len(s):
            c = s[j]
            if c == '"':
                end = string_end(s, j)
                if end is None:
                    return None
                j = end
                continue
            if c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        return None
    j = i  # a number, true, false or null: it ends where a delimiter comes
    while j < len(s) and s[j] not in ",}]" + WHITESPACE:
        j += 1
    return j if j < len(s) else None


def object_members(s: str, i: int) -> tuple[list[tuple[str, int, int | None]], int | None]:
    """([(key, value start, value end or None)], the object's end or None) of the object at s[i],
    as far as it is written (or readable)."""
    members: list[tuple[str, int, int | None]] = []
    j = skip_ws(s, i + 1)
    while j < len(s):
        if s[j] == "}":
            return members, j + 1
        if s[j] == ",":
            j = skip_ws(s, j + 1)
            continue
        key_end = string_end(s, j) if s[j] == '"' else None
        if key_end is None:
            break
        try:
            key = json.loads(s[j:key_end])
        except ValueError:
            break
        j = skip_ws(s, key_end)
        if j >= len(s) or s[j] != ":":
            break
        start = skip_ws(s, j + 1)
        if start >= len(s):
            break
        end = value_end(s, start)
        members.append((key, start, end))
        if end is None:
            break
        j = skip_ws(s, end)
    return members, None


def call_prefix(s: str, i: int, argument_keys: tuple[str, ...]) -> tuple[PartialCall, int | None]:
    """The call {"name": ..., ARGUMENT_KEY: {...}} at s[i] as far as it is written, and its end."""
    members, end = object_members(s, i)
    name, arguments = None, ""
    for key, start, stop in members:
        if key == "name" and stop is not None and s[start] == '"':
            try:
                name = json.loads(s[start:stop])
            except ValueError:
                return PartialCall(None, ""), None
        elif key in argument_keys and s[start] == "{":
            arguments = s[start:stop if stop is not None else len(s)]
    return PartialCall(name, arguments), end


def read_call(s: str, argument_keys: tuple[str, ...]) -> ToolCall:
    """The call in the complete object `s`; ValueError if it is not one."""
    value = json.loads(s)
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        raise ValueError("not a call")
    members, _ = object_members(s, skip_ws(s, 0))
    for key, start, stop in members:
        if key in argument_keys:
            if s[start] != "{":
                raise ValueError("arguments are not an object")
            return ToolCall(value["name"], s[start:stop])
    return ToolCall(value["name"], "{}")


def calls_prefix(s: str, i: int, separators: str, argument_keys: tuple[str, ...]) -> list[PartialCall]:
    """The calls written one after another from s[i], between `separators` and whitespace."""
    out = []
    while i < len(s) and s[i] == "{":
        call, end = call_prefix(s, i, argument_keys)
        out.append(call)
        if end is None:
            break
        i = skip_ws(s, end, separators)
    return out


def read_calls(s: str, i: int, separators: str, argument_keys: tuple[str, ...]) -> list[ToolCall]:
    """Every call written one after another from s[i] to the end; ValueError if any text is not one."""
    out = []
    i = skip_ws(s, i, separators)
    while i < len(s):
        if s[i] != "{":
            raise ValueError("not a call")
        end = value_end(s, i)
        if end is None:
            raise ValueError("an unfinished call")
        out.append(read_call(s[i:end], argument_keys))
        i = skip_ws(s, end, separators)
    if not out:
        raise ValueError("no call")
    return out
