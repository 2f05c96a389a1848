"""The sampling defaults a checkpoint recommends, as vLLM's `--generation-config` reads them: the
temperature, top_p, top_k, min_p, repetition_penalty and max_new_tokens of `generation_config.json`
(the model's own with "auto", another folder's with a path; "vllm": none). A request that leaves
one of those fields out gets the checkpoint's value instead of the neutral one. The other fields
of the file (token ids, do_sample, ...) are not sampling defaults, as in vLLM."""
from __future__ import annotations

import json
import pathlib
from dataclasses import asdict, dataclass

from distengine.sampling_params import SamplingParams

FILE = "generation_config.json"
# generation_config.json's name -> ours; vLLM takes these and no others.
FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
          "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


@dataclass(frozen=True)
class SamplingDefaults:
    """The values a request's left-out sampling fields take (None: the neutral default)."""
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    max_tokens: int | None = None

    def given(self) -> dict:
        """The defaults set, by `SamplingParams` field name."""
        return {k: v for k, v in asdict(self).items() if v is not None}


def sampling_defaults(generation_config: str, model: str) -> SamplingDefaults:
    """`generation_config`: "auto" (the model's generation_config.json, if it has one), "vllm"
    (none) or a folder holding a generation_config.json. ValueError names what is wrong."""
    if generation_config == "vllm":
        return SamplingDefaults()
    if generation_config == "auto":
        from distengine.hf_config import resolve_model_path
        path = resolve_model_path(model) / FILE
        if not path.is_file():
            return SamplingDefaults()
    else:
        folder = pathlib.Path(generation_config).expanduser()
        if not folder.is_dir():
            raise ValueError(f"generation_config {generation_config!r} is neither 'auto', 'vllm' nor a folder")
        path = folder / FILE
        if not path.is_file():
            raise ValueError(f"generation_config: {folder} holds no {FILE}")
    return read_sampling_defaults(path)


def read_sampling_defaults(path: pathlib.Path) -> SamplingDefaults:
    """The sampling defaults of one generation_config.json, each checked as a request's would be."""
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeError, ValueError) as e:
        raise ValueError(f"{path}: cannot be read as JSON: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path}: must hold a JSON object, got {type(config).__name__}")
    values = {}
    for theirs, ours in FIELDS.items():
        if config.get(theirs) is None:
            continue
        try:
            SamplingParams(**{ours: config[theirs]})
        except (ValueError, TypeError) as e:
            raise ValueError(f"{path}: {theirs}: {e}") from None
        values[ours] = config[theirs]
    return SamplingDefaults(**values)
