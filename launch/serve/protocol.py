"""The OpenAI-compatible API's wire format, both ways.

In: the request bodies (pydantic, as vLLM's server) and their translation to the engine's prompts
and `SamplingParams`. Fields OpenAI defines and vLLM's extras (top_k, min_p, repetition_penalty,
ignore_eos, min_tokens, stop_token_ids, logit_bias, allowed_token_ids, structured outputs, ...) are
read; a field OpenAI or vLLM defines that we do not implement is refused by name
(`NOT_IMPLEMENTED`), never ignored; other unknown fields are ignored, as vLLM does; a known field
of the wrong type is a 400 naming it. Token ids must be integers (no
strings, floats or bools); every string must be valid UTF-8 and every list is bounded
(`distengine.limits`).

Out: the engine's outputs as OpenAI's response bodies and server-sent-event chunks (choices,
logprobs, usage)."""
from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, field_validator

from distengine.beam_search import MAX_BEAM_WIDTH, BeamSearchParams
from distengine.generation_config import SamplingDefaults
from distengine.inputs import check_message_content
from distengine.limits import MAX_MESSAGES, MAX_PROMPTS_PER_REQUEST, MAX_TOKEN_IDS, MAX_TOOLS, bad_text
from distengine.sampling_params import SamplingParams
from launch.serve import structured_outputs

# ---- request bodies ----------------------------------------------------------------------------

# Fields beam search does not read, with the values that ask for nothing: anything else is refused
# with use_beam_search (its beams come from the top logprobs, with no stop rule but EOS).
BEAM_SEARCH_UNUSED = {"top_p": (None, 1.0), "top_k": (None, 0, -1), "min_p": (None, 0.0), "seed": (None,),
                      "presence_penalty": (None, 0.0), "frequency_penalty": (None, 0.0),
                      "repetition_penalty": (None, 1.0), "stop": (None, [], ""), "stop_token_ids": (None, []),
                      "min_tokens": (0,), "logit_bias": (None, {}), "allowed_token_ids": (None,),
                      "best_of": (None, 1), "logprobs": (None, False), "top_logprobs": (None, 0),
                      "bad_words": (None, []), "prompt_logprobs": (None,), "echo": (None, False),
                      "response_format": (None, {"type": "text"}), "structured_outputs": (None,),
                      "guided_json": (None,), "guided_regex": (None,), "guided_choice": (None,),
                      "guided_grammar": (None,)}


# Fields of OpenAI's or vLLM's API that we do not implement, with the values that ask for nothing
# (a client may send those): anything else is refused with the field named.
NOT_IMPLEMENTED = {"truncate_prompt_tokens": (None,),
                   "functions": (None, []), "function_call": (None, "none"),
                   "prediction": (None,), "audio": (None,), "modalities": (None, ["text"]),
                   "suffix": (None, ""),
                   "spaces_between_special_tokens": (None, True), "continue_final_message": (None, False)}


# The fields that ask for structured outputs of their own (a forced tool choice cannot take them too).
STRUCTURED_OUTPUT_FIELDS = ("structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar")


def _first_bad_text(value, path: str) -> str | None:
    """Where in a body's value a string lies that UTF-8 cannot carry, or None."""
    if isinstance(value, str):
        return path if bad_text(value) else None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        if isinstance(key, str) and bad_text(key):
            return f"{path}[{ascii(key)}]"
        found = _first_bad_text(item, f"{path}[{key!r}]" if not isinstance(key, str) else f"{path}.{key}")
        if found:
            return found
    return None


class Body(BaseModel):
    """A request body: unknown fields kept aside (to refuse the ones we know and lack), and no
    string UTF-8 cannot carry (a lone surrogate could be neither tokenized nor sent back)."""
    model_config = ConfigDict(extra="allow")

    @field_validator("*", mode="before")
    @classmethod
    def _valid_text(cls, value, info):
        bad = _first_bad_text(value, info.field_name)
        if bad:
            raise ValueError(f"{bad} is not valid text: UTF-8 cannot carry a lone surrogate")
        return value

    def not_implemented(self) -> list[tuple[str, str]]:
        """(field, why) for the fields we know and do not implement, sent with a value that asks
        for something."""
        extra = self.model_extra or {}
        return [(name, f"{name} is not supported") for name, off in NOT_IMPLEMENTED.items()
                if name in extra and extra[name] not in off]


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Sampling(Body):
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    best_of: int | None = Field(None, ge=0, lt=2 ** 63)  # vLLM's
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = Field(None, ge=-(2 ** 63), lt=2 ** 63)  # vLLM's range (a C long)
    user: str | None = None
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[StrictInt] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    request_id: str | None = None  # vLLM's: the response's id, unless the X-Request-Id header gives one
    logit_bias: dict[str, float] | None = None  # OpenAI's: token id (a JSON key, so a string) -> bias
    allowed_token_ids: list[StrictInt] | None = Field(None, max_length=MAX_TOKEN_IDS)
    bad_words: list[str] | None = None  # vLLM's
    prompt_logprobs: int | None = None  # vLLM's: each prompt token's logprob and the top k
    return_tokens_as_token_ids: bool = False  # vLLM's: logprobs name tokens "token_id:ID"
    use_beam_search: bool = False  # vLLM's: n beams
    length_penalty: float = 1.0    # (beam search's)
    # Structured outputs (`launch.serve.structured_outputs`): OpenAI's, vLLM's, vLLM's older names
    response_format: dict | None = None
    structured_outputs: dict | None = None
    guided_json: str | dict | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None

    def unsupported(self) -> list[tuple[str, str]]:
        """(field, why) for what we cannot serve, checked before any work."""
        out = self.not_implemented()
        if self.stream_options is not None and not self.stream:
            out.append(("stream_options", "stream_options needs stream: true"))
        if self.best_of is not None and self.best_of > self.n and self.stream:
            out.append(("best_of", "best_of > n does not stream: the n returned are chosen at the end"))
        if self.prompt_logprobs is not None and self.stream:
            out.append(("prompt_logprobs", "prompt_logprobs does not stream"))
        if self.use_beam_search:
            if self.stream:
                out.append(("use_beam_search", "beam search does not stream: its beams are known at the end"))
            out += [(name, f"{name} does not apply to beam search") for name, off in BEAM_SEARCH_UNUSED.items()
                    if getattr(self, name, None) not in off]
        elif self.length_penalty != 1.0:
            out.append(("length_penalty", "length_penalty needs use_beam_search: true"))
        return out

    def beam_search_params(self, max_tokens: int) -> BeamSearchParams:
        if not 1 <= self.n <= MAX_BEAM_WIDTH:
            raise ValueError(f"n: beam search takes 1 to {MAX_BEAM_WIDTH} beams, got {self.n}")
        return BeamSearchParams(beam_width=self.n, max_tokens=max_tokens, ignore_eos=self.ignore_eos,
                                temperature=0.0 if self.temperature is None else self.temperature,
                                length_penalty=self.length_penalty,
                                include_stop_str_in_output=self.include_stop_str_in_output)

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def forced_schema(self) -> dict | None:
        """The JSON schema the output must follow (a forced tool choice's), or None."""
        return None

    def structured_outputs_params(self):
        schema = self.forced_schema()
        if schema is not None:
            from distengine import StructuredOutputsParams
            return StructuredOutputsParams(json=schema)
        return structured_outputs.from_request(self)

    def wanted_prompt_logprobs(self, logprobs: int | None) -> int | None:
        """The prompt logprobs the engine computes: those asked, or the completion's k when an
        echoed prompt's tokens need theirs."""
        if self.prompt_logprobs is not None:
            return self.prompt_logprobs
        return logprobs if getattr(self, "echo", False) and logprobs is not None else None

    def token_biases(self) -> dict[int, float] | None:
        """`logit_bias` with its keys as token ids and each bias clipped to [-100, 100] (OpenAI's
        range; vLLM clips it the same way)."""
        if not self.logit_bias:
            return None
        out = {}
        for key, bias in self.logit_bias.items():
            if not key.isascii() or not key.isdigit():
                raise ValueError(f"logit_bias: key {key!r:.40} is not a token id (a non-negative integer)")
            if bias != bias:
                raise ValueError(f"logit_bias[{key}]: the bias must be a number, got NaN")
            out[int(key)] = min(100.0, max(-100.0, bias))
        return out

    def to_sampling_params(self, max_tokens: int | None, logprobs: int | None,
                           defaults: SamplingDefaults = SamplingDefaults()) -> SamplingParams:
        """A field the request leaves out takes the server's default (`--generation-config`), else
        the neutral one; `max_tokens` is decided by the caller."""
        kw = dict(n=self.n, best_of=self.best_of, max_tokens=max_tokens, stop=self.stop, seed=self.seed,
                  ignore_eos=self.ignore_eos,
                  min_tokens=self.min_tokens, stop_token_ids=self.stop_token_ids, logprobs=logprobs,
                  skip_special_tokens=self.skip_special_tokens,
                  include_stop_str_in_output=self.include_stop_str_in_output,
                  logit_bias=self.token_biases(), allowed_token_ids=self.allowed_token_ids,
                  bad_words=self.bad_words, prompt_logprobs=self.wanted_prompt_logprobs(logprobs),
                  structured_outputs=self.structured_outputs_params())
        for name, neutral in (("temperature", 1.0), ("top_p", 1.0), ("top_k", 0), ("min_p", 0.0),
                              ("presence_penalty", 0.0), ("frequency_penalty", 0.0), ("repetition_penalty", 1.0)):
            value = getattr(self, name)
            if value is None:
                value = getattr(defaults, name, None)
            kw[name] = neutral if value is None else value
        return SamplingParams(**kw)


PromptInput = str | list[str] | list[StrictInt] | list[list[StrictInt]]


class CompletionRequest(_Sampling):
    prompt: PromptInput
    max_tokens: int | None = 16  # OpenAI's default for completions
    logprobs: int | None = None
    echo: bool = False  # the prompt before each completion (with its tokens' logprobs, when asked)

    @field_validator("prompt")
    @classmethod
    def _bounded(cls, prompt):
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) \
                and len(prompt) > MAX_PROMPTS_PER_REQUEST:
            raise ValueError(f"at most {MAX_PROMPTS_PER_REQUEST} prompts per request, got {len(prompt)}")
        return prompt

    def unsupported(self) -> list[tuple[str, str]]:
        out = super().unsupported()
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            out.append(("logprobs", f"logprobs must be in [0, 20], got {self.logprobs}"))
        if self.echo and (self.stream or self.use_beam_search):
            out.append(("echo", "echo with stream or use_beam_search is not supported"))
        return out

    def prompts(self) -> list:
        """The prompts as the engine takes them (text, or {'prompt_token_ids': [...]})."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and all(isinstance(x, int) for x in p):
            return [{"prompt_token_ids": list(p)}]
        return [x if isinstance(x, str) else {"prompt_token_ids": list(x)} for x in p]


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCallMessage(BaseModel):
    """A call an earlier assistant message made."""
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(Body):
    role: str
    content: str | list[dict] | None = None
    name: str | None = None
    tool_calls: list[ToolCallMessage] | None = None  # an assistant's
    tool_call_id: str | None = None  # a "tool" message's: the call it answers

    @field_validator("content")
    @classmethod
    def _text_parts(cls, value):
        try:
            check_message_content(value, "content")
        except TypeError as e:  # pydantic reports only ValueError as a validation error
            raise ValueError(str(e)) from None
        return value

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part["text"] for part in self.content)

    def for_template(self) -> dict:
        """The message as chat templates read it: an assistant's calls with their arguments as
        objects (Qwen's, Llama's and others' templates write them with `tojson`), as vLLM passes them."""
        out: dict = {"role": self.role, "content": self.text()}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            out["tool_calls"] = [{**({"id": c.id} if c.id is not None else {}), "type": c.type,
                                  "function": {"name": c.function.name,
                                               "arguments": _arguments_object(c.function.arguments)}}
                                 for c in self.tool_calls]
        return out


def _arguments_object(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return text


class FunctionDefinition(BaseModel):
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict | None = None  # a JSON schema
    strict: bool | None = None


class Tool(BaseModel):
    type: Literal["function"]
    function: FunctionDefinition

    def for_template(self) -> dict:
        return {"type": "function", "function": self.function.model_dump(exclude_none=True)}


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None  # None: true, as OpenAI's
    add_generation_prompt: bool = True
    chat_template_kwargs: dict | None = None  # vLLM's: more variables for the template (enable_thinking, ...)

    def unsupported(self) -> list[tuple[str, str]]:
        out = super().unsupported()
        if (self.model_extra or {}).get("echo") not in (None, False):
            out.append(("echo", "echo on chat completions is not supported"))
        out += self._tool_problems()
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= 20:
            out.append(("top_logprobs", f"top_logprobs must be in [0, 20], got {self.top_logprobs}"))
        if self.top_logprobs and not self.logprobs:  # vLLM's rule: it would be ignored silently
            out.append(("top_logprobs", "top_logprobs needs logprobs: true"))
        return out

    def _tool_problems(self) -> list[tuple[str, str]]:
        if self.tool_choice is not None and self.tool_choice != "none" and not self.tools:
            return [("tool_choice", "when using `tool_choice`, `tools` must be set")]
        if self.tools and self.use_beam_search:
            return [("tools", "tools do not apply to beam search")]
        choice = self.resolved_tool_choice()
        names = [t.function.name for t in self.tools or ()]
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            return [("tool_choice", f"tool_choice: the function {choice.function.name!r} is not among the "
                                    f"tools {names}")]
        try:
            schema = self.forced_schema()
        except ValueError as e:
            return [("tools", str(e))]
        if schema is not None:
            if (self.response_format or {}).get("type", "text") != "text" or \
                    any(getattr(self, name, None) is not None for name in STRUCTURED_OUTPUT_FIELDS):
                return [("tool_choice", "tool_choice 'required' or a named function sets the output's schema: "
                                        "it cannot be combined with response_format or structured_outputs")]
            try:
                from distengine import StructuredOutputsParams  # noqa: F401
            except ImportError:
                return [("tool_choice", "tool_choice 'required' or a named function needs structured outputs, "
                                        "which this build does not have")]
        return []

    def resolved_tool_choice(self):
        """vLLM's default: "auto" when tools are given, else "none"."""
        if self.tool_choice is not None:
            return self.tool_choice
        return "auto" if self.tools else "none"

    def tool_dicts(self) -> list[dict] | None:
        return [t.for_template() for t in self.tools] if self.tools else None

    def tool_choice_value(self):
        choice = self.resolved_tool_choice()
        return choice.model_dump() if isinstance(choice, NamedToolChoice) else choice

    def forced_schema(self) -> dict | None:
        from launch.serve.tool_calls import forced_schema
        return forced_schema(self.tool_choice_value(), self.tool_dicts(), self.parallel_tool_calls is not False)

    def requested_max_tokens(self) -> int | None:
        """OpenAI's newer name wins over the deprecated one."""
        return self.max_tokens if self.max_completion_tokens is None else self.max_completion_tokens

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, max_length=MAX_MESSAGES)
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)
    add_special_tokens: bool = True


class DetokenizeRequest(Body):
    model: str | None = None
    tokens: list[StrictInt] = Field(max_length=MAX_TOKEN_IDS)


def chat_prompt(tokenizer, messages: list[ChatMessage], add_generation_prompt: bool = True,
                chat_template: str | None = None, template_kwargs: dict | None = None,
                tools: list[dict] | None = None) -> str:
    """The messages as one prompt, through `chat_template`, else the tokenizer's, with the
    request's `template_kwargs` as more template variables and its `tools` as the template's
    `tools` (as transformers passes them); ValueError names `messages`."""
    if tokenizer is None:
        raise ValueError("messages: this model has no tokenizer: use /v1/completions with token ids")
    if not chat_template and not getattr(tokenizer, "chat_template", None):
        raise ValueError("messages: this model has no chat template: give the server one (--chat-template) "
                         "or use /v1/completions")
    try:
        reserved = {"chat_template", "tokenize", "add_generation_prompt", "conversation", "messages", "tools"} & \
            set(template_kwargs or {})
        if reserved:
            raise ValueError(f"chat_template_kwargs: {sorted(reserved)[0]!r} is set by the request itself")
        return tokenizer.apply_chat_template([m.for_template() for m in messages], tools=tools,
                                             chat_template=chat_template, tokenize=False,
                                             add_generation_prompt=add_generation_prompt, **(template_kwargs or {}))
    except ValueError:
        raise
    except Exception as e:  # noqa: BLE001 - jinja2's TemplateError (raise_exception), ...
        raise ValueError(f"messages: the chat template refused them: {e}") from None


# ---- response bodies ---------------------------------------------------------------------------


def sse(body: dict) -> str:
    """One server-sent event carrying `body`."""
    return "data: " + json.dumps(body) + "\n\n"


SSE_DONE = "data: [DONE]\n\n"


def usage(prompt_tokens: int, completion_tokens: int, cached: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _finite(x):
    """A logprob strict JSON can carry: NaN and anything below -9999 (-inf included) become
    -9999, vLLM's floor; rounding above 0 becomes 0."""
    return None if x is None else (-9999.0 if x != x or x < -9999.0 else min(x, 0.0))


class TokenIdSpelling:
    """What names the logprobs' tokens under vLLM's `return_tokens_as_token_ids`: each token as
    "token_id:ID", whatever text it decodes to (a token that is part of a character has none)."""

    @staticmethod
    def decode(ids: list[int]) -> str:
        return "".join(f"token_id:{t}" for t in ids)


def token_text(tokenizer, t: int, prev: int | None = None) -> str:
    """The token's text as it reads after `prev` (a sentencepiece decoder drops the leading
    space of a lone token: "▁with" would read "with", not " with")."""
    if tokenizer is None:
        return str(t)
    if prev is None:
        return tokenizer.decode([t])
    head, both = tokenizer.decode([prev]), tokenizer.decode([prev, t])
    return both[len(head):] if both.startswith(head) else tokenizer.decode([t])


def token_gap(tokenizer, prev: int, t: int) -> str:
    """What token `t` reads as after `prev` beyond its own text (a completion's text is its
    tokens' own: the space its first token takes after the prompt, for an echoed prompt)."""
    if tokenizer is None:
        return ""
    alone, after = tokenizer.decode([t]), token_text(tokenizer, t, prev)
    return after[:len(after) - len(alone)] if alone and after.endswith(alone) else ""


def completion_logprobs(tokenizer, token_ids: list[int], lps: list[dict], offset: int,
                        prev: int | None = None) -> dict:
    prevs = [prev, *token_ids[:-1]]
    tokens = [token_text(tokenizer, t, p) for t, p in zip(token_ids, prevs)]
    offsets, pos = [], offset
    for t in tokens:
        offsets.append(pos)
        pos += len(t)
    return {"tokens": tokens, "token_logprobs": [_finite(d.get(t)) for d, t in zip(lps, token_ids)],
            "top_logprobs": [{token_text(tokenizer, k, p): _finite(v) for k, v in d.items()}
                             for d, p in zip(lps, prevs)],
            "text_offset": offsets}


def chat_logprobs(tokenizer, token_ids: list[int], lps: list[dict], top: int, prev: int | None = None) -> dict:
    content = []
    for t, d, p in zip(token_ids, lps, [prev, *token_ids[:-1]]):
        s = token_text(tokenizer, t, p)
        tops = sorted(d.items(), key=lambda kv: -kv[1])[:top]
        top_texts = [(token_text(tokenizer, k, p), v) for k, v in tops]  # each decoded once, not per field
        content.append({"token": s, "logprob": _finite(d.get(t)), "bytes": list(s.encode()),
                        "top_logprobs": [{"token": text, "logprob": _finite(v), "bytes": list(text.encode())}
                                         for text, v in top_texts]})
    return {"content": content}


@dataclass(frozen=True)
class ResponseBuilder:
    """The bodies of one /v1/completions or /v1/chat/completions request: what every body and
    chunk repeats (id, creation time, model), and the shape of its choices, which differs
    between the two APIs."""
    id: str
    created: int
    model: str
    chat: bool
    tokenizer: object
    top_logprobs: int = 0  # chat's; completions return all the logprobs they asked for

    @classmethod
    def start(cls, model: str, chat: bool, tokenizer, top_logprobs: int = 0,
              base_id: str | None = None) -> ResponseBuilder:
        """`base_id`: the client's request id (OpenAI's prefix is put before it); None: a new one."""
        rid = ("chatcmpl-" if chat else "cmpl-") + (base_id or uuid.uuid4().hex)
        return cls(rid, int(time.time()), model, chat, tokenizer, top_logprobs)

    def logprobs(self, token_ids: list[int], lps: list[dict], offset: int = 0, prev: int | None = None) -> dict:
        """`offset`: where the tokens start in the choice's text; `prev`: the token before them."""
        if self.chat:
            return chat_logprobs(self.tokenizer, token_ids, lps, self.top_logprobs, prev)
        return completion_logprobs(self.tokenizer, token_ids, lps, offset, prev)

    def echoed_logprobs(self, prompt: list[int], prompt_lps: list | None, completion: dict) -> dict:
        """A completion's logprobs (OpenAI's legacy shape) after those of its echoed prompt: the
        first prompt token has none, each later one its logprob and the top k."""
        first = token_text(self.tokenizer, prompt[0])
        head = {"tokens": [first], "token_logprobs": [None], "top_logprobs": [None], "text_offset": [0]}
        if len(prompt) > 1:
            rest = completion_logprobs(self.tokenizer, prompt[1:], prompt_lps[1:], len(first), prompt[0])
            for key in head:
                head[key] += rest[key]
        return {key: head[key] + completion[key] for key in head}

    def prompt_logprobs(self, prompt: list[int], lps: list, ranks: list) -> list:
        """vLLM's `prompt_logprobs`: None for the first token, then {token id: {logprob, rank,
        decoded_token}} of the prompt token and the top k (ranked by their order)."""
        out: list = [None]
        for t, d, r in zip(prompt[1:], lps[1:], ranks[1:]):
            top = sorted(d.items(), key=lambda kv: -kv[1])
            entry = {str(k): {"logprob": _finite(v), "rank": n + 1, "decoded_token": token_text(self.tokenizer, k)}
                     for n, (k, v) in enumerate(top) if k != t}
            out.append({str(t): {"logprob": _finite(d[t]), "rank": r, "decoded_token": token_text(self.tokenizer, t)},
                        **entry})
        return out

    def choice(self, index: int, text: str, logprobs: dict | None, finish_reason, stop_reason) -> dict:
        body = {"message": {"role": "assistant", "content": text}} if self.chat else {"text": text}
        return {"index": index, **body, "logprobs": logprobs, "finish_reason": finish_reason,
                "stop_reason": stop_reason}

    def response(self, choices: list[dict], usage: dict) -> dict:
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": choices, "usage": usage}

    def delta_choice(self, index: int, output, logprobs: dict | None, finished: bool, first: bool) -> dict:
        """A streamed choice: `output` is a `CompletionOutput` delta; `first`: the choice's first
        chunk, which names chat's role."""
        reason = output.finish_reason if finished else None
        if self.chat:
            delta = {"content": output.text}
            if first:
                delta["role"] = "assistant"
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
        else:
            choice = {"index": index, "text": output.text, "logprobs": logprobs, "finish_reason": reason}
        if finished:
            choice["stop_reason"] = output.stop_reason
        return choice

    def chunk(self, choices: list[dict], **extra) -> str:
        return sse({"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                    "created": self.created, "model": self.model, "choices": choices, **extra})
