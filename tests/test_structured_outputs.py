"""Structured outputs through `LLM` on the tiny model with a byte-level tokenizer (random weights:
only the grammar makes the text valid): a JSON schema, a regex, a choice, a JSON object and an
EBNF grammar, greedy (with a penalty, so that the model does not loop on whitespace), with logprobs
and seeded, with the overlapped scheduler on and off (xgrammar's JSON strings may hold raw
control characters, as vLLM's outputs do: they are parsed with strict=False); several completions, a tiny pool (preemption);
bad specs; a token the grammar rejects; the sampler's bitmask alone."""
from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch

from distengine import LLM, SamplingParams, StructuredOutputsParams
from distengine.step import RequestSampling
from distengine.structured_outputs import RequestGrammar
from tests.server_harness import build_byte_level_model
from tests.test_engine import ray_cluster  # noqa: F401 - a fixture
from workers.sampler import SamplingTensors, sample

SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 8},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "color": {"enum": ["red", "green", "blue"]},
                         "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 3}},
          "required": ["name", "age", "color", "tags"], "additionalProperties": False}
PROMPTS = ["user : give me JSON assistant :", "x"]


def satisfies(value, schema=SCHEMA) -> None:
    try:
        import jsonschema
    except ImportError:
        assert set(value) == set(schema["required"])
        assert isinstance(value["name"], str) and len(value["name"]) <= 8
        assert isinstance(value["age"], int) and 0 <= value["age"] <= 120
        assert value["color"] in ("red", "green", "blue")
        assert isinstance(value["tags"], list) and len(value["tags"]) <= 3
        assert all(isinstance(t, str) and len(t) <= 5 for t in value["tags"])
    else:
        jsonschema.validate(value, schema)


def so(**kw) -> StructuredOutputsParams:
    return StructuredOutputsParams(**kw)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return build_byte_level_model(str(tmp_path_factory.mktemp("bytes")))


@pytest.fixture(scope="module", params=[True, False], ids=["async", "sync"])
def llm(folder, request):
    with LLM(folder, device="cpu", dtype="float32", max_model_len=256, async_scheduling=request.param) as llm:
        yield llm


def _idle(llm) -> None:
    assert not llm.scheduler.requests and llm.scheduler.manager.usage == 0


def test_json_schema(llm):
    greedy = SamplingParams(temperature=0.0, frequency_penalty=1.0, max_tokens=150, structured_outputs=so(json=SCHEMA))
    seeded = SamplingParams(temperature=1.0, seed=6, max_tokens=150, structured_outputs=so(json=json.dumps(SCHEMA)))
    for sp in (greedy, seeded):
        for out in llm.generate(PROMPTS, sp, use_tqdm=False):
            c = out.outputs[0]
            assert c.finish_reason == "stop", c
            satisfies(json.loads(c.text, strict=False))
    _idle(llm)


def test_regex_choice_object_grammar(llm):
    cases = [(so(regex=r"[a-z]{3}-\d{2,4}"), lambda t: re.fullmatch(r"[a-z]{3}-\d{2,4}", t)),
             (so(choice=["yes", "no", "maybe so"]), lambda t: t in ("yes", "no", "maybe so")),
             (so(json_object=True), lambda t: isinstance(json.loads(t, strict=False), dict)),
             (so(grammar='root ::= "(" num ("+" num)* ")"\nnum ::= [0-9] | [1-9] [0-9]'),
              lambda t: re.fullmatch(r"\((?:[0-9]|[1-9][0-9])(?:\+(?:[0-9]|[1-9][0-9]))*\)", t))]
    for spec, ok in cases:
        for sp in (SamplingParams(temperature=0.0, repetition_penalty=2.0, logprobs=2, max_tokens=150,
                                  structured_outputs=spec),
                   SamplingParams(temperature=1.0, seed=1, max_tokens=150, structured_outputs=spec)):
            for out in llm.generate(PROMPTS, sp, use_tqdm=False):
                c = out.outputs[0]
                assert c.finish_reason == "stop" and ok(c.text), (spec, c)
                if sp.logprobs:  # every sampled token was allowed, and its logprob finite
                    assert all(np.isfinite(lp[t]) for t, lp in zip(c.token_ids, c.logprobs))
    _idle(llm)


def test_several_completions_and_a_tiny_pool(folder):
    sp = SamplingParams(temperature=1.0, n=3, max_tokens=150, structured_outputs=so(json=SCHEMA))
    with LLM(folder, device="cpu", dtype="float32", max_model_len=160, block_size=16, max_num_batched_tokens=64,
             num_gpu_blocks_override=60) as llm:
        outs = llm.generate(PROMPTS * 2, sp, use_tqdm=False)
        for out in outs:
            assert len(out.outputs) == 3
            for c in out.outputs:
                if c.finish_reason == "stop":
                    satisfies(json.loads(c.text, strict=False))
                else:  # a long string may reach max_tokens
                    assert c.finish_reason == "length" and len(c.token_ids) == 150
        assert llm.stats().preemptions > 0
        _idle(llm)


def test_bad_specs_are_refused_by_name(llm):
    for spec, field in [(so(json={"type": "nope"}), "structured_outputs.json"),
                        (so(json="{not json"), "structured_outputs.json"),
                        (so(json={"type": "object", "default": {1, 2}}), "structured_outputs.json"),
                        (so(regex="(ab"), "structured_outputs.regex"),
                        (so(grammar="root ::= undefined_rule"), "structured_outputs.grammar")]:
        with pytest.raises(ValueError, match=re.escape(field) + ": (xgrammar cannot compile|the schema is not JSON)"):
            llm.generate(PROMPTS, SamplingParams(structured_outputs=spec), use_tqdm=False)
    out = llm.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=8, structured_outputs=so(
        choice=["ok"])), use_tqdm=False)
    assert out[0].outputs[0].text == "ok"
    _idle(llm)


def test_params_are_checked():
    with pytest.raises(ValueError, match="exactly one of json, regex, choice, grammar, json_object.*regex, choice"):
        so(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="exactly one.*got none"):
        so()
    with pytest.raises(ValueError, match="structured_outputs.choice"):
        so(choice="yes")
    with pytest.raises(ValueError, match="structured_outputs.json must be a JSON schema"):
        so(json=3)
    with pytest.raises(ValueError, match="ignore_eos cannot be used with structured_outputs"):
        SamplingParams(ignore_eos=True, structured_outputs=so(regex="a"))
    with pytest.raises(ValueError, match="min_tokens cannot be used with structured_outputs"):
        SamplingParams(min_tokens=2, structured_outputs=so(regex="a+"))
    with pytest.raises(ValueError, match="structured_outputs must be a StructuredOutputsParams"):
        SamplingParams(structured_outputs={"regex": "a"})
    sp = SamplingParams(structured_outputs=so(json={"type": "object"}))
    assert sp.clone().structured_outputs == sp.structured_outputs


def test_a_token_the_grammar_rejects_fails_that_request_alone(llm, monkeypatch):
    # A bitmask that allows every token: the model samples what the grammar does not allow.
    import distengine.scheduler
    monkeypatch.setattr(distengine.scheduler, "fill_bitmasks",
                        lambda grammars: [b"\xff" * (4 * -(-llm.info.vocab_size // 32))] * len(grammars))
    spec = so(regex="z{40}")
    outs = llm.generate(PROMPTS, [SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=spec),
                                  SamplingParams(temperature=0.0, max_tokens=5)], use_tqdm=False)
    assert outs[0].outputs[0].finish_reason == "error" and "does not allow token" in outs[0].outputs[0].stop_reason
    assert outs[1].outputs[0].finish_reason == "length" and len(outs[1].outputs[0].token_ids) == 5
    _idle(llm)


@pytest.mark.parametrize("kind", ["greedy", "random", "seeded", "logprobs", "penalties"])
def test_sampler_bars_exactly_the_masked_tokens(kind):
    V, N = 100, 4  # 100 tokens: the last word is partly past the vocabulary
    g = torch.Generator().manual_seed(0)
    record = {"greedy": RequestSampling(), "random": RequestSampling(temperature=1.0),
              "seeded": RequestSampling(temperature=1.0, seed=7), "logprobs": RequestSampling(logprobs=-1),
              "penalties": RequestSampling(temperature=1.0, repetition_penalty=1.3, frequency_penalty=0.5)}[kind]
    allowed = torch.rand(N, V, generator=g) < 0.1
    allowed[:, 0] = True
    allowed[3] = True  # a row without a grammar: every bit set
    bits = torch.zeros(N, 128, dtype=torch.int64)
    bits[:, :V] = allowed.long()
    words = (bits.view(N, 4, 32) << torch.arange(32)).sum(-1)
    mask = torch.from_numpy(words.numpy().astype(np.uint32).view(np.int32))
    for trial in range(20):
        logits = torch.randn(N, V, generator=g) * 5
        logits[:, 1] = 100.0  # the favourite, barred in the masked rows unless allowed
        t = SamplingTensors.build([record] * N, [[1, 2]] * N, [[1, 3, 3]] * N, V, "cpu",
                                  torch.Generator().manual_seed(trial), mask)
        out = sample(logits, t)
        assert allowed[torch.arange(N), out.token_ids].all()
        if kind == "greedy":  # the most likely allowed token
            assert torch.equal(out.token_ids, logits.masked_fill(~allowed, float("-inf")).argmax(-1))
        if kind == "logprobs":
            lp = out.top_logprobs
            assert torch.isinf(lp[~allowed.gather(1, out.top_token_ids)]).all()
            ref = torch.log_softmax(logits.masked_fill(~allowed, float("-inf")), -1)
            assert torch.allclose(out.logprobs, ref.gather(1, out.token_ids[:, None])[:, 0])
    assert out.token_ids[3] == 1 or kind != "greedy"  # the unmasked row keeps its favourite


def test_bitmask_bars_the_padded_vocabulary_and_travels_exactly(folder):
    from transformers import AutoTokenizer

    from distengine.step import GrammarMasks, ScheduledRequest, StepPlan
    from distengine.structured_outputs import GrammarCompiler, fill_bitmasks
    tok = AutoTokenizer.from_pretrained(folder)
    vocab = 512  # the model's, padded past the tokenizer's
    assert len(tok) < vocab
    grammars = GrammarCompiler(tok, vocab, frozenset({tok.eos_token_id}))
    g = grammars.matcher(so(regex=r".+"), [])
    mask, = fill_bitmasks([g])
    bits = np.unpackbits(np.frombuffer(mask, dtype=np.uint8), bitorder="little")
    assert len(bits) == vocab and not bits[len(tok):].any() and bits[:len(tok)].sum() > 200
    assert not bits[tok.eos_token_id]  # ".+" may not end before its first character
    assert grammars.compile(so(regex=r".+")) is grammars.compile(so(regex=r".+"))  # cached by spec
    plan = StepPlan(3, scheduled=[ScheduledRequest("a", 0, 2, [5, 6], [], True),
                                  ScheduledRequest("b", 0, 1, [7], [], True)], defer_output=True,
                    masks_follow=True, grammar_masks=GrammarMasks(2, {"a": mask}))
    assert StepPlan.decode(plan.encode()) == plan


def test_an_abort_leaves_no_matcher_or_block(llm):
    sp = SamplingParams(temperature=1.0, seed=0, max_tokens=100, structured_outputs=so(json=SCHEMA))
    rid = llm._add(None, llm.tokenizer("x")["input_ids"], sp, [])
    for _ in range(4):
        llm.engine.step()
    req = llm.scheduler.requests[rid]
    assert req.grammar is not None and req.grammar.num_accepted == req.num_output_tokens > 0
    llm.engine.abort([rid])
    assert req.grammar is None
    while llm.scheduler.has_in_flight():
        llm.engine.step()
    llm.output_processor.pop(rid)
    _idle(llm)


OVERLAP_SPECS = [so(json=SCHEMA), None, so(regex=r"[a-z]{3}( [a-z]{2,4}){6}"), so(choice=["yes", "no", "maybe"])]
OVERLAP_PROMPTS = ["user : JSON please", "x", "write words", "choose"]


def _mixed_batch(folder, **kw):
    """Seeded and greedy rows, one without a grammar: (each completion, the steps run)."""
    params = [SamplingParams(temperature=t, seed=s, max_tokens=150, frequency_penalty=1.0, structured_outputs=spec)
              for spec, t, s in zip(OVERLAP_SPECS, (1.0, 1.0, 0.0, 1.0), (6, 4, None, 5))]
    with LLM(folder, device="cpu", dtype="float32", max_model_len=256, **kw) as llm:
        log = llm.engine.step_log = []
        outs = [o.outputs[0] for o in llm.generate(OVERLAP_PROMPTS, params, use_tqdm=False)]
        _idle(llm)
    return outs, log


@pytest.fixture(scope="module")
def plain_loop(folder):
    return _mixed_batch(folder, async_scheduling=False)[0]


def test_overlap_keeps_every_step_and_the_tokens_of_the_plain_loop(folder, plain_loop):
    """Overlapped, a grammar row is scheduled every step (its sampling waits on masks filled while
    its forward runs) and gives the tokens of the loop that is not overlapped."""
    outs, log = _mixed_batch(folder, async_scheduling=True)
    assert len(log) <= max(len(o.token_ids) for o in outs) + 2  # one token a step, plus the last output
    for a, b in zip(plain_loop, outs):
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
    assert [outs[i].finish_reason for i in (0, 2, 3)] == ["stop"] * 3 and outs[1].token_ids
    satisfies(json.loads(outs[0].text, strict=False))
    assert re.fullmatch(r"[a-z]{3}( [a-z]{2,4}){6}", outs[2].text)
    assert outs[3].text in ("yes", "no", "maybe")


def test_overlap_at_tp2_on_ray(folder, plain_loop, ray_cluster):
    """Both ranks sample a step late with the masks the next plan brings, through the compiled
    graph's bytes."""
    outs, _ = _mixed_batch(folder, async_scheduling=True, tensor_parallel_size=2)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain_loop]


def test_a_step_waiting_on_masks_gets_them_from_the_next_plan_or_nothing_runs(folder):
    """The worker's side of the split step: masks only follow an overlapped step; a plan that does
    not bring the masks its predecessor waits on is refused (the engine would be out of step)."""
    from distengine.executor import EngineDeadError
    from distengine.step import StepPlan
    with LLM(folder, device="cpu", dtype="float32", max_model_len=256) as llm:
        worker = llm.engine.executor.worker
        llm._add(None, [5, 6, 7], SamplingParams(max_tokens=3), [])
        plan = llm.scheduler.schedule()
        with pytest.raises(RuntimeError, match="masks can follow only an overlapped step"):
            worker.execute(StepPlan(plan.step_id, plan.new_requests, plan.scheduled, masks_follow=True))
        with pytest.raises(EngineDeadError, match="waits on its grammar masks; step .* brought none"):
            llm.engine.executor.execute(StepPlan(plan.step_id, plan.new_requests, plan.scheduled,
                                                 defer_output=True, masks_follow=True))
            llm.engine.executor.execute(StepPlan(plan.step_id + 1, defer_output=True))


@pytest.mark.gpu
def test_overlap_on_the_gpu_in_cuda_graphs(folder, plain_loop):
    """On a GPU: decode steps replay CUDA graphs, and a step's logits wait in the graph's output
    until the next plan's masks arrive; the tokens are the CPU loop's that is not overlapped."""
    gpu = dict(device="cuda", gpu_memory_utilization=0.3)
    plain, _ = _mixed_batch(folder, async_scheduling=False, **gpu)
    outs, log = _mixed_batch(folder, async_scheduling=True, **gpu)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert len(log) <= max(len(o.token_ids) for o in outs) + 2
    for o in (outs[0], outs[2], outs[3]):
        assert o.finish_reason == "stop"
    satisfies(json.loads(outs[0].text, strict=False))
