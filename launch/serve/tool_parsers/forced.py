"""The output of a forced tool choice, which structured outputs keep to a JSON schema
(`launch.serve.tool_calls`): a named function's arguments object (the whole output is one call),
or, for "required", a JSON array of {"name": ..., "parameters": {...}}."""
from __future__ import annotations

from launch.serve.tool_parsers.base import ParsedOutput, PartialCall, PartialOutput, ToolCall, ToolParser
from launch.serve.tool_parsers.json_scan import calls_prefix, read_calls, skip_ws, value_end

ARGUMENTS = ("parameters",)


class NamedFunctionOutput(ToolParser):
    def __init__(self, name: str) -> None:
        self.name = name

    def parse(self, text: str) -> ParsedOutput:
        return ParsedOutput("", [ToolCall(self.name, text)])

    def parse_prefix(self, text: str) -> PartialOutput:
        return PartialOutput("", [PartialCall(self.name, text)])


class RequiredCallsOutput(ToolParser):
    def parse(self, text: str) -> ParsedOutput:
        i = skip_ws(text, 0)
        end = value_end(text, i) if i < len(text) and text[i] == "[" else None
        if end is None or text[end:].strip():
            return ParsedOutput(text, [])  # cut short (max_tokens): not a list of calls
        try:
            return ParsedOutput("", read_calls(text[:end - 1], i + 1, ",", ARGUMENTS))
        except ValueError:
            return ParsedOutput(text, [])

    def parse_prefix(self, text: str) -> PartialOutput:
        i = skip_ws(text, 0)
        if i >= len(text) or text[i] != "[":
            return PartialOutput("", [])
        return PartialOutput("", calls_prefix(text, skip_ws(text, i + 1), ",", ARGUMENTS))
