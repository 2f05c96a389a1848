"""Hermes' format (Qwen2.5, Qwen3, Qwen3.5 and others): content, then one or more
`<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>` blocks. The content is the text
before the first block; a block the model did not close (it stopped) still counts."""
from __future__ import annotations

from launch.serve.tool_parsers.base import ParsedOutput, PartialOutput, ToolParser, held_back
from launch.serve.tool_parsers.json_scan import call_prefix, read_call, skip_ws

START, END = "<tool_call>", "</tool_call>"
ARGUMENTS = ("arguments",)


class HermesParser(ToolParser):
    def parse(self, text: str) -> ParsedOutput:
        first = text.find(START)
        if first < 0:
            return ParsedOutput(text, [])
        calls, pos = [], first
        try:
            while pos >= 0:
                body_start = pos + len(START)
                end = text.find(END, body_start)
                calls.append(read_call(text[body_start:end if end >= 0 else len(text)].strip(), ARGUMENTS))
                pos = text.find(START, end) if end >= 0 else -1
        except ValueError:
            return ParsedOutput(text, [])
        return ParsedOutput(text[:first] or None, calls)

    def parse_prefix(self, text: str) -> PartialOutput:
        first = text.find(START)
        if first < 0:
            return PartialOutput(text[:len(text) - held_back(text, START)], [])
        calls, pos = [], first
        while text.startswith(START, pos):
            body_start = pos + len(START)
            end = text.find(END, body_start)
            body = text[body_start:end] if end >= 0 else text[body_start:len(text) - held_back(text, END)]
            j = skip_ws(body, 0)
            if j >= len(body) or body[j] != "{":
                break
            call, _ = call_prefix(body, j, ARGUMENTS)
            calls.append(call)
            if end < 0:
                break
            pos = skip_ws(text, end + len(END))
        return PartialOutput(text[:first], calls)
