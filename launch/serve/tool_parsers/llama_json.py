"""Llama 3.x's and Llama 4's JSON format (`llama3_json`, `llama4_json`): the whole output is one
or more `{"name": ..., "parameters": {...}}` objects separated by `;` (vLLM also reads
"arguments"), possibly after `<|python_tag|>`; any other output is content."""
from __future__ import annotations

from launch.serve.tool_parsers.base import ParsedOutput, PartialOutput, ToolParser
from launch.serve.tool_parsers.json_scan import WHITESPACE, calls_prefix, read_calls, skip_ws

TAG = "<|python_tag|>"
ARGUMENTS = ("parameters", "arguments")


def _start(text: str) -> int | None:
    """Where the calls begin (after whitespace and the tag), or None while that is not known."""
    i = skip_ws(text, 0)
    if text.startswith(TAG, i):
        i = skip_ws(text, i + len(TAG))
    elif TAG.startswith(text[i:]):
        return None
    return i


class LlamaJsonParser(ToolParser):
    def parse(self, text: str) -> ParsedOutput:
        i = _start(text)
        if i is None or i >= len(text) or text[i] != "{":
            return ParsedOutput(text, [])
        try:
            return ParsedOutput(None, read_calls(text, i, ";", ARGUMENTS))
        except ValueError:
            return ParsedOutput(text, [])

    def parse_prefix(self, text: str) -> PartialOutput:
        i = _start(text)
        if i is None or i >= len(text):
            return PartialOutput("", [])
        if text[i] != "{":
            return PartialOutput(text, [])
        return PartialOutput("", calls_prefix(text, i, ";" + WHITESPACE, ARGUMENTS))
