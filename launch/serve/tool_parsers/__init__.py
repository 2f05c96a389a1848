"""Tool-call parsers: the text a model generated, turned into content and tool calls, whole
(`ToolParser.parse`) or as it streams (`ToolCallStream`), for `--tool-call-parser NAME` with
`--enable-auto-tool-choice` (vLLM's names: hermes, llama3_json, llama4_json, pythonic,
llama4_pythonic, openai, functiongemma).

A parser reads one format (one module each). Streaming re-reads the text so far with
`ToolParser.parse_prefix`, which returns only what later text cannot change (content held back
while it could be the start of a marker; a call once its name is known, its arguments as far as
they are written); `ToolCallStream` sends what is new since the last delta. The last delta comes
from the whole parse, so that the streamed content and arguments, joined, equal it whenever the
output is well formed. Arguments are the JSON text as the model wrote it (JSON formats) or as
`json.dumps` writes the values (pythonic). Output a parser cannot read stays content."""
from __future__ import annotations

from launch.serve.tool_parsers.base import (ParsedOutput, PartialCall, PartialOutput, StreamDelta, ToolCall,
                                            ToolCallDelta, ToolCallStream, ToolParser)
from launch.serve.tool_parsers.functiongemma import FunctionGemmaParser
from launch.serve.tool_parsers.hermes import HermesParser
from launch.serve.tool_parsers.llama_json import LlamaJsonParser
from launch.serve.tool_parsers.openai import HarmonyParser
from launch.serve.tool_parsers.pythonic import PythonicParser

PARSERS: dict[str, type[ToolParser]] = {"hermes": HermesParser, "llama3_json": LlamaJsonParser,
                                        "llama4_json": LlamaJsonParser, "pythonic": PythonicParser,
                                        "llama4_pythonic": PythonicParser, "openai": HarmonyParser,
                                        "functiongemma": FunctionGemmaParser}


def tool_parser(name: str) -> ToolParser:
    """The parser `--tool-call-parser name` picks; ValueError names the flag and the choices."""
    if name not in PARSERS:
        raise ValueError(f"--tool-call-parser {name!r} is not a known parser; choose one of {sorted(PARSERS)}")
    return PARSERS[name]()


__all__ = ["PARSERS", "ParsedOutput", "PartialCall", "PartialOutput", "StreamDelta", "ToolCall", "ToolCallDelta",
           "ToolCallStream", "ToolParser", "tool_parser"]
