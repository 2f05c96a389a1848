"""What the application takes besides the engine and the model's names (`ServerOptions`), and the
checks that turn `distengine serve`'s flags into it before the engine starts: a mistake in a
chat template, a generation config or a list of origins ends the command at once (status 2),
not after minutes of loading weights."""
from __future__ import annotations

from dataclasses import dataclass

from distengine.generation_config import SamplingDefaults

ANY = ("*",)


@dataclass(frozen=True)
class ServerOptions:
    api_key: str | None = None              # required on /v1, /tokenize and /detokenize when given
    chat_template: str | None = None        # in place of the tokenizer's (None: the tokenizer's)
    sampling_defaults: SamplingDefaults = SamplingDefaults()  # for the fields a request leaves out
    log_requests: bool = False              # one INFO line per request (vLLM's --enable-log-requests)
    max_log_len: int | None = None          # characters of prompt and prompt token ids in that line
    allowed_origins: tuple[str, ...] = ANY  # CORS, as vLLM's defaults: any origin, method and header
    allowed_methods: tuple[str, ...] = ANY
    allowed_headers: tuple[str, ...] = ANY
    allow_credentials: bool = False
    enable_auto_tool_choice: bool = False   # tool_choice "auto" (the default with tools) ...
    tool_call_parser: str | None = None     # ... read by this parser (launch.serve.tool_parsers)

    def __post_init__(self) -> None:
        from launch.serve.tool_parsers import tool_parser
        if self.max_log_len is not None and self.max_log_len < 0:
            raise ValueError(f"--max-log-len must be >= 0, got {self.max_log_len}")
        if self.tool_call_parser is not None:
            tool_parser(self.tool_call_parser)  # a name we do not know is refused here
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice requires --tool-call-parser")

    def auto_tool_parser(self):
        """The parser of tool_choice "auto", or None when the server does not enable it."""
        from launch.serve.tool_parsers import tool_parser
        return tool_parser(self.tool_call_parser) if self.enable_auto_tool_choice else None


# Characters a template has and a file name hardly ever does: vLLM's rule for "this was meant as
# the template itself, not a file".
TEMPLATE_CHARS = "{}\n"


def load_chat_template(value: str) -> str:
    """`--chat-template`: the text of the file `value` names, or `value` itself when it is a
    template; compiled here, as the tokenizer would compile it, so that a template with a mistake
    is refused before the engine starts. ValueError names the file or the template's line."""
    try:
        with open(value, encoding="utf-8") as f:
            text, where = f.read(), f" {value!r}"
    except UnicodeDecodeError:
        raise ValueError(f"--chat-template {value!r}: the file is not UTF-8 text") from None
    except (OSError, ValueError) as e:  # ValueError: a NUL in the name
        if not any(c in value for c in TEMPLATE_CHARS):
            reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
            raise ValueError(f"--chat-template {value!r}: cannot read the file ({reason})") from None
        text, where = value, ""
    import jinja2
    # transformers' own compiler (its sandbox, filters and tags), as apply_chat_template uses it.
    from transformers.utils.chat_template_utils import _compile_jinja_template
    try:
        _compile_jinja_template(text)
    except jinja2.TemplateError as e:
        line = f"line {e.lineno}: " if getattr(e, "lineno", None) else ""
        raise ValueError(f"--chat-template{where}: the template does not compile ({line}{e})") from None
    return text
