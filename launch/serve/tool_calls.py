"""A chat request's tools, as vLLM serves them: which output parser reads the choices, and the
JSON schema a forced choice is generated under.

`tool_choice` (with `tools`; "auto" when left out): "none" generates plain content (the tools
still reach the chat template); "auto" needs the server's `--enable-auto-tool-choice
--tool-call-parser NAME` and reads calls out of the text with that parser; "required" and a named
function are enforced by structured outputs: a named function's output is its parameters object
(one call), "required"'s a JSON array of {"name", "parameters"} with at least one item.
`finish_reason` is "tool_calls" when "auto" found a call or "required" stopped, as in vLLM (a
named function keeps the engine's). `parallel_tool_calls: false` keeps the first call only (and,
for "required", the schema allows one)."""
from __future__ import annotations

from dataclasses import dataclass

from launch.serve.tool_parsers import ParsedOutput, ToolCallStream, ToolParser
from launch.serve.tool_parsers.base import new_call_id
from launch.serve.tool_parsers.forced import NamedFunctionOutput, RequiredCallsOutput

AUTO_NEEDS_FLAGS = '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
EMPTY_PARAMETERS = {"type": "object", "properties": {}}


def required_schema(tools: list[dict], one: bool) -> dict:
    """vLLM's schema for "required": an array of calls, each one of the tools by name. The tools'
    `$defs` move to the root, where their `#/$defs/...` references point once the parameters
    are nested; ValueError names `tools` when two tools define one name differently."""
    options = [{"properties": {"name": {"type": "string", "enum": [t["function"]["name"]]},
                               "parameters": t["function"].get("parameters") or EMPTY_PARAMETERS},
                "required": ["name", "parameters"]} for t in tools]
    schema = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": options}}
    if one:
        schema["maxItems"] = 1
    defs: dict = {}
    for t in tools:
        for name, definition in ((t["function"].get("parameters") or {}).get("$defs") or {}).items():
            if defs.setdefault(name, definition) != definition:
                raise ValueError(f"tools: two tools define $defs {name!r} differently; tool_choice 'required' "
                                 "puts their definitions in one schema")
    if defs:
        schema["$defs"] = defs
    return schema


@dataclass(frozen=True)
class ToolOutput:
    """How a request's choices are read: `parser` over each choice's text; `auto`: "auto"'s
    (content unless a call is found); `required`: "required"'s; `max_calls`: 1 for
    parallel_tool_calls false."""
    parser: ToolParser
    auto: bool = False
    required: bool = False
    max_calls: int | None = None

    @property
    def forced(self) -> bool:
        """"required" or a named function: the output is kept to the tools' schema."""
        return not self.auto

    def message(self, text: str) -> dict:
        """The choice's message (its `tool_calls` empty when it called nothing)."""
        parsed: ParsedOutput = self.parser.parse(text)
        calls = parsed.calls[:self.max_calls]
        if self.auto and not calls:  # the parser's content: harmony's final channel, else the text
            return {"role": "assistant", "content": parsed.content or "", "tool_calls": []}
        body = [{"id": new_call_id(), "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in calls]
        return {"role": "assistant", "content": parsed.content, "tool_calls": body}

    def finish_reason(self, engine_reason: str | None, called: bool) -> str | None:
        if called and (self.auto or (self.required and engine_reason == "stop")):
            return "tool_calls"
        return engine_reason

    def stream(self) -> ToolCallStream:
        return ToolCallStream(self.parser, self.max_calls)


def tool_output(choice, tools: list[dict] | None, parallel: bool, auto_parser: ToolParser | None) -> ToolOutput | None:
    """The reading of a request with `tool_choice` `choice` (resolved: never None with tools),
    None for plain content. ValueError names the field."""
    if not tools or choice == "none":
        return None
    max_calls = None if parallel else 1
    if choice == "auto":
        if auto_parser is None:
            raise ValueError(f"tool_choice: {AUTO_NEEDS_FLAGS}")
        return ToolOutput(auto_parser, auto=True, max_calls=max_calls)
    if choice == "required":
        return ToolOutput(RequiredCallsOutput(), required=True, max_calls=max_calls)
    return ToolOutput(NamedFunctionOutput(choice["function"]["name"]))


def forced_schema(choice, tools: list[dict] | None, parallel: bool) -> dict | None:
    """The JSON schema a forced choice's output is generated under, None for the others."""
    if not tools or choice in ("none", "auto", None):
        return None
    if choice == "required":
        return required_schema(tools, one=not parallel)
    name = choice["function"]["name"]
    return next(t["function"].get("parameters") or EMPTY_PARAMETERS for t in tools if t["function"]["name"] == name)
