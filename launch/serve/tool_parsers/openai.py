"""gpt-oss's harmony format (`openai`): messages `<|channel|>CHANNEL ...<|message|>BODY` ending
with `<|end|>`, `<|call|>` or `<|return|>` (the last two are stop tokens, so the text may just
end), each after `<|start|>assistant` but the first. A message whose header names a recipient
`to=functions.NAME` (`<|channel|>commentary to=functions.get_weather <|constrain|>json`) is a
call with its body as the arguments; the `final` channel is the content; the analysis channel
(the reasoning) is not part of the answer. The markers are special tokens, kept in the text."""
from __future__ import annotations

import re

from launch.serve.tool_parsers.base import ParsedOutput, PartialCall, PartialOutput, ToolCall, ToolParser, held_back

MESSAGE = "<|message|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>")
RECIPIENT = re.compile(r"to=functions\.([^\s<]+)")
CHANNEL = re.compile(r"<\|channel\|>\s*(\w+)")


def _messages(text: str, partial: bool) -> list[tuple[str, str]]:
    """(header, body) of each message; `partial`: the last body held back where it could be the
    start of an end marker."""
    out, pos = [], 0
    while True:
        m = text.find(MESSAGE, pos)
        if m < 0:
            return out
        body_start = m + len(MESSAGE)
        ends = [(text.find(e, body_start), e) for e in ENDS]
        found = [(i, e) for i, e in ends if i >= 0]
        if not found:
            body = text[body_start:]
            if partial:
                body = body[:len(body) - max(held_back(body, e) for e in ENDS)]
            out.append((text[pos:m], body))
            return out
        end, marker = min(found)
        out.append((text[pos:m], text[body_start:end]))
        pos = end + len(marker)


class HarmonyParser(ToolParser):
    keeps_special_tokens = True

    def _read(self, text: str, partial: bool) -> tuple[str, list[tuple[str, str]]]:
        content, calls = "", []
        for header, body in _messages(text, partial):
            recipient = RECIPIENT.search(header)
            channel = CHANNEL.search(header)
            if recipient:
                calls.append((recipient.group(1), body))
            elif channel and channel.group(1) == "final":
                content += body
        return content, calls

    def parse(self, text: str) -> ParsedOutput:
        if MESSAGE not in text:
            return ParsedOutput(text or None, [])
        content, calls = self._read(text, partial=False)
        return ParsedOutput(content or None, [ToolCall(n, a) for n, a in calls])

    def parse_prefix(self, text: str) -> PartialOutput:
        if MESSAGE not in text:
            return PartialOutput("", [])  # a header being written, or plain text: the end decides
        content, calls = self._read(text, partial=True)
        return PartialOutput(content, [PartialCall(n, a) for n, a in calls])
