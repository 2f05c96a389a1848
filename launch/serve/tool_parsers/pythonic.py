"""The pythonic format (`pythonic`, `llama4_pythonic`: Llama 3.2 and Llama 4 with their
templates): the whole output is a Python list of calls, `[get_weather(city="Paris"), now()]`,
possibly between `<|python_start|>` and `<|python_end|>`; read with `ast`, each argument a
literal, the arguments written as `json.dumps` writes them. Streamed, each call is sent once its
parenthesis closes. Any other output is content."""
from __future__ import annotations

import ast
import json

from launch.serve.tool_parsers.base import ParsedOutput, PartialCall, PartialOutput, ToolCall, ToolParser

START, END = "<|python_start|>", "<|python_end|>"


def _call(node: ast.AST) -> ToolCall:
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
        raise ValueError("not a call with keyword arguments")
    args = {}
    for kw in node.keywords:
        if kw.arg is None:
            raise ValueError("**kwargs")
        args[kw.arg] = ast.literal_eval(kw.value)
    return ToolCall(node.func.id, json.dumps(args, ensure_ascii=False))


def _unwrapped(text: str) -> str:
    s = text.strip()
    if s.startswith(START):
        s = s[len(START):]
        s = s[:-len(END)] if s.endswith(END) else s
    return s.strip()


class PythonicParser(ToolParser):
    def parse(self, text: str) -> ParsedOutput:
        s = _unwrapped(text)
        if not (s.startswith("[") and s.endswith("]")):
            return ParsedOutput(text, [])
        try:
            tree = ast.parse(s, mode="eval").body
            if not isinstance(tree, ast.List) or not tree.elts:
                raise ValueError("not a list of calls")
            return ParsedOutput(None, [_call(e) for e in tree.elts])
        except (SyntaxError, ValueError, TypeError, MemoryError, RecursionError):
            return ParsedOutput(text, [])

    def parse_prefix(self, text: str) -> PartialOutput:
        s = text.lstrip()
        if s.startswith(START):
            s = s[len(START):].lstrip()
        elif START.startswith(s):
            return PartialOutput("", [])
        if not s:
            return PartialOutput("", [])
        if s[0] != "[":
            return PartialOutput(text, [])
        return PartialOutput("", _complete_calls(s))


def _complete_calls(s: str) -> list[PartialCall]:
    """The calls of the list at s[0] whose parenthesis has closed."""
    calls, depth, quote, start, j = [], 0, None, 1, 0
    while j < len(s):
        c = s[j]
        if quote:
            if c == "\\":
                j += 1
            elif c == quote:
                quote = None
        elif c in "'\"":
            quote = c
        elif c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
            if depth == 1 and c == ")":
                try:
                    call = _call(ast.parse(s[start:j + 1].strip().lstrip(","), mode="eval").body)
                except (SyntaxError, ValueError, TypeError, MemoryError, RecursionError):
                    return calls
                calls.append(PartialCall(call.name, call.arguments))
                start = j + 1
            if depth <= 0:
                return calls
        j += 1
    return calls
