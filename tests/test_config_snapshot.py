"""The model's config as the workers receive it: the attributes transformers gives (stored,
defaulted, derived, per layer), the text part, and a worker that builds the model from it without
importing transformers."""
from __future__ import annotations

import copy
import os
import pickle
import subprocess
import sys
import textwrap

import pytest

from distengine.config_snapshot import snapshot
from distengine.hf_config import load_hf_config
from tests.test_models import CONFIGS, build

ROOT = __file__.rsplit("/tests/", 1)[0]


def _same(ours, theirs, where: str, seen: set | None = None) -> None:
    from transformers import PretrainedConfig
    seen = set() if seen is None else seen
    if isinstance(theirs, PretrainedConfig):
        if id(ours) in seen:  # (a layer's config that is the model's own)
            return
        seen.add(id(ours))
        for name in dir(ours):
            _same(getattr(ours, name), getattr(theirs, name), f"{where}.{name}", seen)
    elif isinstance(ours, tuple) and ours and all(hasattr(o, "get_text_config") for o in ours):
        layers = list(theirs)  # transformers' per-layer view: each layer's config
        assert len(ours) == len(layers), where
        for i, (a, b) in enumerate(zip(ours, layers)):
            _same(a, b, f"{where}[{i}]", seen)
    else:
        assert ours == theirs, where


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_snapshot_reads_as_the_config(tmp_path, name):
    hf, _ = build(name)
    hf.save_pretrained(tmp_path)
    config = load_hf_config(tmp_path)
    snap = pickle.loads(pickle.dumps(snapshot(config)))
    _same(snap, config, name)
    for field in ("architectures", "model_type", "vocab_size", "hidden_size", "num_hidden_layers", "dtype"):
        theirs = getattr(config.get_text_config(), field, None)
        assert getattr(snap.get_text_config(), field, None) == theirs, field
    assert (snap.get_text_config() is snap) == (config.get_text_config() is config)
    assert snap.to_dict() == config.to_dict()
    with pytest.raises(AttributeError, match="no attribute 'not_a_field'"):
        snap.not_a_field  # noqa: B018
    changed = copy.copy(snap.get_text_config())
    changed.vocab_size = -1
    assert snap.get_text_config().vocab_size == config.get_text_config().vocab_size != -1


def test_a_worker_builds_the_model_from_the_snapshot_without_transformers(tmp_path):
    hf, _ = build("qwen3_5_moe_vl")
    hf.save_pretrained(tmp_path / "model")
    (tmp_path / "config.pkl").write_bytes(pickle.dumps(snapshot(load_hf_config(tmp_path / "model"))))
    script = textwrap.dedent(f"""
        import pickle, sys
        import torch
        sys.path.insert(0, {ROOT!r})
        from workers.loader import get_model
        from workers.parallel import TPGroup
        snap = pickle.loads(open({str(tmp_path / 'config.pkl')!r}, "rb").read())
        model = get_model({str(tmp_path / 'model')!r}, TPGroup(), "float32", "cpu", hf_config=snap)
        assert "transformers" not in sys.modules, "the worker imported transformers"
        print(type(model).__name__, sum(p.numel() for p in model.parameters()) > 0)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "TRITON_INTERPRET": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["Qwen3_5MoeForCausalLM", "True"]
