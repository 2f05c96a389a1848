"""The model's Hugging Face config as plain data: what transformers computed on the driver (the
stored fields, the class's defaults and derived properties, aliases, the text part of a wrapper),
read by the workers without importing transformers. A worker process that imported it only to
parse config.json spent most of its start-up there (seconds on a small host, for every rank of
every engine)."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

_PLAIN = (bool, int, float, str, type(None), torch.dtype)
_SKIP = object()  # a value transformers keeps for itself (a class, a per-layer view): not carried


class ConfigSnapshot:
    """Attribute access as on the `PretrainedConfig` it was taken from, plus its `to_dict()` and
    `get_text_config()`; `copy.copy` gives one whose attributes may be changed apart."""

    def __init__(self, values: dict[str, Any], as_dict: dict[str, Any], text_key: str | None) -> None:
        object.__setattr__(self, "_values", values)
        object.__setattr__(self, "_dict", as_dict)
        object.__setattr__(self, "_text_key", text_key)

    def __getattr__(self, name: str) -> Any:
        values = object.__getattribute__(self, "_values")
        if name in values:
            return values[name]
        raise AttributeError(f"the model's config has no attribute {name!r}")

    def __setattr__(self, name: str, value: Any) -> None:
        self._values[name] = value

    def __copy__(self) -> ConfigSnapshot:
        return ConfigSnapshot(dict(self._values), self._dict, self._text_key)

    def __getstate__(self):
        return self._values, self._dict, self._text_key

    def __setstate__(self, state) -> None:
        self.__init__(*state)

    def __dir__(self):
        return sorted(self._values)

    def __repr__(self) -> str:
        return f"ConfigSnapshot({self._values.get('model_type')!r}, {len(self._values)} attributes)"

    def to_dict(self) -> dict[str, Any]:
        return _copy(self._dict)

    def get_text_config(self) -> ConfigSnapshot:
        """The language model's part: itself, or the sub-config transformers names."""
        return self if self._text_key is None else self._values[self._text_key]


def snapshot(config, _memo: dict[int, ConfigSnapshot] | None = None) -> ConfigSnapshot:
    """`config` (a transformers `PretrainedConfig`) as plain data. A heterogeneous config's
    `per_layer_config` becomes a tuple of the layers' snapshots (each the config itself where
    the layers agree)."""
    from transformers import PretrainedConfig

    memo = {} if _memo is None else _memo
    if id(config) in memo:
        return memo[id(config)]
    values: dict[str, Any] = {}
    text = config.get_text_config()
    text_key = None
    if text is not config:
        text_key = next((k for k, v in vars(config).items() if v is text), "_text_config_snapshot")
    out = memo[id(config)] = ConfigSnapshot(values, config.to_dict(), text_key)

    def plain(value):
        if isinstance(value, PretrainedConfig):
            return snapshot(value, memo)
        if type(value) in _PLAIN:
            return value
        if type(value) in (list, tuple, set, frozenset):
            items = [plain(v) for v in value]
            return _SKIP if any(v is _SKIP for v in items) else type(value)(items)
        if type(value) is dict:
            items = {k: plain(v) for k, v in value.items()}
            ok = all(type(k) in _PLAIN for k in items) and not any(v is _SKIP for v in items.values())
            return items if ok else _SKIP
        if isinstance(value, Sequence):  # transformers' per-layer view (of a config with layers)
            try:
                layers = list(value)
            except Exception:
                return _SKIP
            if all(isinstance(v, PretrainedConfig) for v in layers):
                return tuple(snapshot(v, memo) for v in layers)
        return _SKIP

    for name in dir(config):
        if name.startswith("__"):
            continue
        try:
            value = getattr(config, name)
        except Exception:  # a property that does not apply to this config (transformers raises)
            continue
        if callable(value) and not isinstance(value, PretrainedConfig):
            continue
        value = plain(value)
        if value is not _SKIP:
            values[name] = value
    for alias, target in getattr(config, "attribute_map", {}).items():  # (transformers resolves them on access)
        if target in values:
            values.setdefault(alias, values[target])
    if text_key is not None and text_key not in values:
        values[text_key] = snapshot(text, memo)
    return out


def _copy(value):
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copy(v) for v in value]
    return value
