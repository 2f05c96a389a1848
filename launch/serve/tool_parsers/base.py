"""What every tool-call parser returns, and the stream that turns its readings of a growing text
into OpenAI's deltas (see the package's docstring)."""
from __future__ import annotations

import uuid
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text


@dataclass(frozen=True)
class ParsedOutput:
    content: str | None  # None: no text besides the calls
    calls: list[ToolCall]


@dataclass(frozen=True)
class PartialCall:
    name: str | None  # None until the whole name is written
    arguments: str    # as far as it is certain


@dataclass(frozen=True)
class PartialOutput:
    content: str
    calls: list[PartialCall]


class ToolParser:
    """One format. `keeps_special_tokens`: its markers are special tokens, which the text must
    keep (the request's skip_special_tokens is turned off)."""
    keeps_special_tokens = False

    def parse(self, text: str) -> ParsedOutput:
        raise NotImplementedError

    def parse_prefix(self, text: str) -> PartialOutput:
        raise NotImplementedError


def held_back(text: str, marker: str) -> int:
    """How many characters at the end of `text` could be the start of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


def new_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"  # vLLM's


@dataclass(frozen=True)
class ToolCallDelta:
    """A call's part in one chunk: the first carries its id and name, later ones only arguments."""
    index: int
    id: str | None
    name: str | None
    arguments: str

    def body(self) -> dict:
        out: dict = {"index": self.index}
        if self.id is not None:
            out.update(id=self.id, type="function")
        function = {"arguments": self.arguments}
        if self.name is not None:
            function["name"] = self.name
        out["function"] = function
        return out


@dataclass(frozen=True)
class StreamDelta:
    content: str
    calls: list[ToolCallDelta]


@dataclass
class _Sent:
    id: str
    name: str
    arguments: str = ""


@dataclass
class ToolCallStream:
    """One choice's stream: `feed` each new piece of text, `final=True` with the last one."""
    parser: ToolParser
    max_calls: int | None = None  # parallel_tool_calls: false keeps the first call only
    text: str = ""
    content: str = ""
    sent: list[_Sent] = field(default_factory=list)

    @property
    def called(self) -> bool:
        return bool(self.sent)

    def feed(self, piece: str, final: bool = False) -> StreamDelta:
        self.text += piece
        if final:
            whole = self.parser.parse(self.text)
            content, calls = whole.content or "", [PartialCall(c.name, c.arguments) for c in whole.calls]
        else:
            reading = self.parser.parse_prefix(self.text)
            content, calls = reading.content, reading.calls
        more = content[len(self.content):] if content.startswith(self.content) else ""
        self.content += more
        deltas = []
        for i, call in enumerate(calls[:self.max_calls]):
            if call.name is None:
                break
            first = i == len(self.sent)
            if first:
                self.sent.append(_Sent(new_call_id(), call.name))
            sent = self.sent[i]
            if call.name != sent.name:  # a malformed call the whole parse read otherwise
                break
            args = call.arguments[len(sent.arguments):] if call.arguments.startswith(sent.arguments) else ""
            sent.arguments += args
            if first or args:
                deltas.append(ToolCallDelta(i, sent.id if first else None, call.name if first else None, args))
        return StreamDelta(more, deltas)
