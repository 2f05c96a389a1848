"""Tensor parallelism on CPU: two processes joined by gloo, each loading only its shard, give
transformers' logits and greedy tokens; sizes that do not divide the heads are refused before
anything runs."""
from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch
import torch.multiprocessing as mp

from tests.test_models import CONFIGS, build
from workers.parallel import NVLinkAllReduce, TPGroup

ARCHS = sorted(CONFIGS)


def _worker(rank: int, world: int, rendezvous: str, folder: str, backend: str = "gloo") -> None:
    import importlib

    from safetensors.torch import load_file

    from tests.model_harness import Harness
    from workers.parallel import init_tp_group
    device = torch.device("cpu")
    # Two ranks on a small host: each on one thread, as the engine's CPU workers (torch's default
    # of a thread a core makes them spin against each other).
    torch.set_num_threads(1)
    if backend != "gloo":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    tp = init_tp_group(rank, world, rendezvous, "gloo" if backend == "gloo" else "nccl")
    if backend == "nvlink":  # the NVLink all-reduce, fused with the norms where a layer defers it
        tp = dataclasses.replace(tp, custom=NVLinkAllReduce(device, torch.float32, 1 << 20))
    results = {}
    for name in ARCHS:
        config = getattr(importlib.import_module("transformers"), CONFIGS[name][0]).from_pretrained(
            os.path.join(folder, name))
        module, cls = CONFIGS[name][1].split(":")
        ours = getattr(importlib.import_module(module), cls)(config, tp, torch.float32, device)
        state = load_file(os.path.join(folder, name, "model.safetensors"))
        loaded = ours.load_weights(state.items())
        assert ours.missing_weights(loaded) == [], name
        h = Harness(ours, config, tp, device=str(device))
        prompt = json.load(open(os.path.join(folder, "prompt.json")))
        logits, _ = h.prefill_logits(prompt)
        results[name] = {"logits": logits.cpu().tolist(), "greedy": h.greedy(prompt, 32)}
    if rank == 0:
        json.dump(results, open(os.path.join(folder, "tp_results.json"), "w"))
    # Both ranks leave together: a gloo peer that tears its connections down while the other is
    # still in its own teardown can abort it ("terminate called without an active exception").
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


BACKENDS = ["gloo"] + (["nccl", "nvlink"] if torch.cuda.device_count() >= 2 else [])


@pytest.mark.parametrize("backend", BACKENDS)
def test_tp2_matches_transformers(tmp_path, backend):
    prompt = torch.randint(0, 300, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    json.dump(prompt, open(tmp_path / "prompt.json", "w"))
    refs = {}
    for name in ARCHS:
        hf, _ = build(name)
        hf.save_pretrained(tmp_path / name)
        with torch.no_grad():
            refs[name] = (hf(torch.tensor([prompt])).logits[0],
                          hf.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False,
                                      attention_mask=torch.ones(1, 40, dtype=torch.long))[0, 40:].tolist())
    # A file rendezvous: a free port picked here could be taken before the workers bind it.
    mp.start_processes(_worker, args=(2, f"file://{tmp_path / 'rendezvous'}", str(tmp_path), backend), nprocs=2,
                       join=True, start_method="spawn")
    got = json.load(open(tmp_path / "tp_results.json"))
    for name in ARCHS:
        assert (torch.tensor(got[name]["logits"]) - refs[name][0]).abs().max().item() < 1e-3, name
        assert got[name]["greedy"] == refs[name][1], name


def test_tp_size_that_does_not_divide_heads_is_refused():
    from tests.test_models import COMMON
    import transformers
    from workers.models.llama import LlamaForCausalLM
    config = transformers.LlamaConfig(**COMMON, num_hidden_layers=1)
    with pytest.raises(ValueError, match="query heads .* not divisible by the tensor-parallel size 3"):
        LlamaForCausalLM(config, TPGroup(rank=0, world_size=3), torch.float32, torch.device("cpu"))


def test_mamba_configs_that_cannot_be_sharded_are_refused():
    """Mamba heads must split evenly; B/C groups must split with them or each rank must read one."""
    from distengine.model_config import ConfigError, MambaShape, mamba_groups_per_rank
    from workers.layers.mamba import MambaMixer2
    shape = MambaShape(2, intermediate=8 * 16, d_state=16, d_conv=4, n_heads=8, d_head=16, n_groups=2)
    with pytest.raises(ValueError, match="8 Mamba heads cannot be split across tensor-parallel size 3"):
        MambaMixer2(64, shape, TPGroup(rank=0, world_size=3), torch.float32, "cpu", "model.layers.0.mamba")
    assert mamba_groups_per_rank(2, 8, 2) == 1 and mamba_groups_per_rank(1, 8, 4) == 1
    assert mamba_groups_per_rank(2, 8, 4) == 1 and mamba_groups_per_rank(4, 8, 2) == 2
    with pytest.raises(ConfigError, match="3 Mamba2 groups cannot be sharded across tp=2"):
        mamba_groups_per_rank(3, 12, 2)
    # Two ranks sharing a group still each hold a whole head range of it.
    MambaMixer2(64, shape, TPGroup(rank=1, world_size=4), torch.float32, "cpu", "model.layers.0.mamba")
    # Mamba-1 (Jamba): its channels split evenly.
    from workers.layers.mamba1 import MambaMixer1
    with pytest.raises(ValueError, match=r"intermediate channels \(128\) is not divisible by the tensor-parallel size 3"):
        MambaMixer1(64, MambaShape(1, 128, 16, 4), 8, TPGroup(rank=0, world_size=3), torch.float32, "cpu",
                    "model.layers.0.mamba")


def test_only_a_forward_that_reduces_them_defers_the_all_reduces():
    """At TP > 1 a layer defers o_proj's (and Gemma's down_proj's) all-reduce only when its own
    forward reduces the output (fused with the norms after it); a subclass with a forward of its
    own keeps the plain all-reduce, so nothing is left unreduced. A bias does not stop it: it
    joins the first rank's partial sum (gpt-oss's, in `test_tp2_matches_transformers`)."""
    from transformers import Gemma2Config, LlamaConfig

    from distengine.model_config import FULL
    from workers.models.gemma2 import Gemma2DecoderLayer
    from workers.models.llama import LlamaDecoderLayer

    small = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                 num_hidden_layers=1, vocab_size=100, head_dim=16)
    args = (0, FULL, TPGroup(0, 2), torch.float32, torch.device("cpu"), None)

    class OwnForward(LlamaDecoderLayer):
        def forward(self, positions, x, residual, meta):
            return super().forward(positions, x, residual, meta)

    assert LlamaDecoderLayer(LlamaConfig(**small), *args).self_attn.o_proj.deferred
    assert LlamaDecoderLayer(LlamaConfig(**small, attention_bias=True), *args).self_attn.o_proj.deferred
    assert not OwnForward(LlamaConfig(**small), *args).self_attn.o_proj.deferred
    assert not LlamaDecoderLayer(LlamaConfig(**small), 0, FULL, TPGroup(), torch.float32, torch.device("cpu"),
                                 None).self_attn.o_proj.deferred  # one rank: nothing to reduce
    gemma = Gemma2DecoderLayer(Gemma2Config(**small), *args)
    assert gemma.self_attn.o_proj.deferred and gemma.mlp.down_proj.deferred
