"""A request's structured-output fields as the engine's `StructuredOutputsParams`: OpenAI's
`response_format` (text, json_object, json_schema), vLLM's `structured_outputs` object, and vLLM's
older `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`. One form per request; a
field of vLLM's we do not implement (structural_tag, whitespace_pattern, ...) is refused by name.
A request may name its library (`structured_outputs.backend`, or vLLM's older
`guided_decoding_backend`): "xgrammar" or "guidance" (llguidance), or "auto" for the server's
`--structured-outputs-backend`; any other is refused by name."""
from __future__ import annotations

from distengine.config import STRUCTURED_OUTPUTS_BACKENDS
from distengine.sampling_params import StructuredOutputsParams

GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
FIELDS = ("json", "regex", "choice", "grammar", "json_object")


def _backend(name: str, value) -> str | None:
    if value is not None and (not isinstance(value, str) or value not in STRUCTURED_OUTPUTS_BACKENDS):
        raise ValueError(f"{name}: must be one of {', '.join(repr(b) for b in STRUCTURED_OUTPUTS_BACKENDS)} "
                         f"(xgrammar, llguidance, or the server's choice), got {value!r:.60}")
    return value


def _response_format(value, backend: str | None) -> StructuredOutputsParams | None:
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise ValueError("response_format: must be an object with a 'type' (text, json_object or json_schema)")
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True, backend=backend)
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise ValueError("response_format.json_schema: must be an object with a 'schema' (a JSON schema object)")
        return StructuredOutputsParams(json=spec["schema"], backend=backend)
    raise ValueError(f"response_format.type: {kind!r:.40} is not supported (text, json_object or json_schema)")


def _object(value, backend: str | None) -> StructuredOutputsParams:
    if not isinstance(value, dict):
        raise ValueError("structured_outputs: must be an object (json, regex, choice, grammar or json_object)")
    for key, v in value.items():
        if key == "backend":
            if v is not None:
                backend = _backend("structured_outputs.backend", v)
        elif key not in FIELDS and v not in (None, False):
            raise ValueError(f"structured_outputs.{key} is not supported")
    return StructuredOutputsParams(**{k: value[k] for k in FIELDS if value.get(k) is not None}, backend=backend)


def from_request(req) -> StructuredOutputsParams | None:
    """The request's structured outputs, or None; a ValueError naming the field otherwise."""
    backend = _backend("guided_decoding_backend", req.guided_decoding_backend)
    forms = {}
    if req.response_format is not None and (not isinstance(req.response_format, dict)
                                            or req.response_format.get("type") != "text"):
        forms["response_format"] = lambda: _response_format(req.response_format, backend)
    if req.structured_outputs is not None:
        forms["structured_outputs"] = lambda: _object(req.structured_outputs, backend)
    for name, field in GUIDED.items():
        value = getattr(req, name)
        if value is not None:
            forms[name] = lambda field=field, value=value: StructuredOutputsParams(**{field: value}, backend=backend)
    if len(forms) > 1:
        raise ValueError(f"{list(forms)[1]}: one structured-output form per request, got {', '.join(forms)}")
    if not forms:
        return None
    (name, build), = forms.items()
    try:
        return build()
    except ValueError as e:
        message = str(e)
        if message.startswith("structured_outputs") and name != "structured_outputs":
            raise ValueError(f"{name}: {message}") from None
        raise
