"""On a GPU: greedy tokens of a large model with programmatic dependent launch (kernels/pdl.py) on
and off are the same. A kernel that read before its producer finished would show here, at batches
1, 8 and 64 of a Gemma-3-12B-shaped model on random weights (`--load-format dummy`: only its
config.json is written)."""
from __future__ import annotations

import pytest
import torch

from distengine import LLM, SamplingParams

pytestmark = pytest.mark.gpu

BATCHES = (1, 8, 64)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from launch.bench.common import build_random_model
    folder = str(tmp_path_factory.mktemp("gemma-3-12b"))
    build_random_model(folder, "gemma-3-12b", weights=False)
    return folder


def _greedy_tokens(model_dir: str) -> dict[int, list[list[int]]]:
    g = torch.Generator().manual_seed(0)
    greedy = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    out = {}
    # In this process, so that the switch set by the test is the one the kernels read.
    with LLM(model_dir, load_format="dummy", max_model_len=1024, distributed_executor_backend="uni") as llm:
        for batch in BATCHES:
            prompts = [{"prompt_token_ids": torch.randint(10, 200000, (200 + 3 * i,), generator=g).tolist()}
                       for i in range(batch)]
            out[batch] = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    return out


def test_pdl_on_and_off_give_the_same_tokens_on_a_12b_shape(model_dir, monkeypatch):
    import kernels.pdl as pdl
    if not pdl.pdl_enabled(torch.empty(1, device="cuda")):
        pytest.skip("PDL needs compute capability 9.0 or later (and DISTENGINE_PDL unset or 1)")
    if torch.cuda.get_device_properties(0).total_memory < 32 << 30:
        pytest.skip("a 12B-shaped model's bf16 weights take ~24 GB")
    runs = []
    for enabled in (True, False):
        monkeypatch.setattr(pdl, "ENABLED", enabled)
        runs.append(_greedy_tokens(model_dir))
    with_pdl, without = runs
    for batch in BATCHES:
        assert with_pdl[batch] == without[batch], f"batch {batch}: PDL changed the tokens"
    # Random weights could collapse to one token everywhere, which would compare equal however
    # the kernels raced: the check only means something when the prompts lead apart.
    assert len({t[0] for t in with_pdl[64]}) > 1, "every prompt gave the same first token"
