"""Structured outputs through `LLM` on the tiny model with a byte-level tokenizer (random weights:
only the grammar makes the text valid): a JSON schema, a regex, a choice, a JSON object and a
grammar (EBNF under xgrammar, Lark under llguidance), with each library, greedy (with a penalty,
so that the model does not loop on whitespace), with logprobs and seeded, with the overlapped
scheduler on and off (JSON strings may hold raw control characters, as vLLM's outputs do: they are
parsed with strict=False); several completions, a tiny pool (preemption); bad specs, refused
naming the library; a token the grammar rejects; the sampler's bitmask alone; which library serves
which spec; stop tokens under both; one fill over rows of both libraries; the engine's option."""
from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch

from distengine import LLM, SamplingParams, StructuredOutputsParams
from distengine.step import RequestSampling
from distengine.structured_outputs import GrammarCompiler, RequestGrammar, check, fill_bitmasks, library_for
from tests.server_harness import build_byte_level_model
from workers.sampler import SamplingTensors, sample

SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 8},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "color": {"enum": ["red", "green", "blue"]},
                         "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 3}},
          "required": ["name", "age", "color", "tags"], "additionalProperties": False}
PROMPTS = ["user : give me JSON assistant :", "x"]
LIBRARIES = ["xgrammar", "guidance"]
# One grammar in each library's syntax: xgrammar's EBNF, llguidance's Lark.
GRAMMARS = {"xgrammar": 'root ::= "(" num ("+" num)* ")"\nnum ::= [0-9] | [1-9] [0-9]',
            "guidance": 'start: "(" num ("+" num)* ")"\nnum: /[0-9]/ | /[1-9][0-9]/'}
BAD_GRAMMARS = {"xgrammar": "root ::= undefined_rule", "guidance": "start: undefined_rule"}
NAMES = {"xgrammar": "xgrammar", "guidance": "llguidance"}


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


@pytest.fixture(scope="module")
def tokenizer(folder):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(folder)


@pytest.mark.parametrize("library", LIBRARIES)
def test_json_schema(llm, library):
    greedy = SamplingParams(temperature=0.0, frequency_penalty=1.0, max_tokens=150,
                            structured_outputs=so(json=SCHEMA, backend=library))
    seeded = SamplingParams(temperature=1.0, seed=6, max_tokens=150,
                            structured_outputs=so(json=json.dumps(SCHEMA), backend=library))
    for sp in (greedy, seeded):
        for out in llm.generate(PROMPTS, sp, use_tqdm=False):
            c = out.outputs[0]
            assert c.finish_reason == "stop", c
            satisfies(json.loads(c.text, strict=False))
    _idle(llm)


@pytest.mark.parametrize("library", LIBRARIES)
def test_regex_choice_object_grammar(llm, library):
    cases = [(so(regex=r"[a-z]{3}-\d{2,4}", backend=library), lambda t: re.fullmatch(r"[a-z]{3}-\d{2,4}", t)),
             (so(choice=["yes", "no", "maybe so"], backend=library), lambda t: t in ("yes", "no", "maybe so")),
             (so(json_object=True, backend=library), lambda t: isinstance(json.loads(t, strict=False), dict)),
             (so(grammar=GRAMMARS[library], backend=library),
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


@pytest.mark.parametrize("library", LIBRARIES)
def test_bad_specs_are_refused_by_name(llm, library):
    name = NAMES[library]
    out = llm.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=8, structured_outputs=so(
        choice=["ok"], backend=library)), use_tqdm=False)  # (the engine's compiler is made by now)
    assert out[0].outputs[0].text == "ok"
    for spec, field in [(so(json={"type": "nope"}, backend=library), "structured_outputs.json"),
                        (so(json="{not json", backend=library), "structured_outputs.json"),
                        (so(json={"type": "object", "default": {1, 2}}, backend=library), "structured_outputs.json"),
                        (so(regex="(ab", backend=library), "structured_outputs.regex"),
                        (so(grammar=BAD_GRAMMARS[library], backend=library), "structured_outputs.grammar")]:
        with pytest.raises(ValueError, match=re.escape(field) + f": ({name} cannot compile|the schema is not JSON)"):
            llm.generate(PROMPTS, SamplingParams(structured_outputs=spec), use_tqdm=False)
        with pytest.raises(ValueError, match=re.escape(field) + f": ({name} cannot compile|the schema is not JSON)"):
            llm.engine._grammars.compile(spec)  # the engine's own compile, against the tokenizer
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
    for bad in ("outlines", "llguidance", "", 3):
        with pytest.raises(ValueError, match="structured_outputs.backend must be one of auto, xgrammar, guidance"):
            so(regex="a", backend=bad)
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


def _bits(mask: bytes) -> np.ndarray:
    return np.unpackbits(np.frombuffer(mask, dtype=np.uint8), bitorder="little")


@pytest.mark.parametrize("library", LIBRARIES)
def test_bitmask_bars_the_padded_vocabulary_and_travels_exactly(tokenizer, library):
    from distengine.step import GrammarMasks, ScheduledRequest, StepPlan
    tok = tokenizer
    vocab = 500  # the model's, padded past the tokenizer's (and not a whole number of words)
    assert len(tok) < vocab
    grammars = GrammarCompiler(tok, vocab, frozenset({tok.eos_token_id}), backend=library)
    g = grammars.matcher(so(regex=r".+"), [])
    assert g.library == library
    mask, = fill_bitmasks([g])
    bits = _bits(mask)
    assert len(mask) == 4 * -(-vocab // 32) and not bits[len(tok):].any() and bits[:len(tok)].sum() > 200
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
    with LLM(folder, **{"device": "cpu", "dtype": "float32", "max_model_len": 256, **kw}) as llm:
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


def test_the_library_of_each_spec():
    specs = {"json": so(json=SCHEMA), "json_object": so(json_object=True), "regex": so(regex="a"),
             "choice": so(choice=["a"]), "grammar": so(grammar='root ::= "a"')}
    for kind, spec in specs.items():
        assert library_for(spec) == ("xgrammar" if kind == "grammar" else "guidance"), kind
        assert library_for(spec, "xgrammar") == "xgrammar" and library_for(spec, "guidance") == "guidance"
        for library in LIBRARIES:  # a request's own choice wins; its "auto" is the engine's
            named = so(**{k: v for k, v in vars(spec).items() if k != "backend"}, backend=library)
            assert library_for(named, "xgrammar") == library_for(named, "guidance") == library
        assert library_for(so(**{k: v for k, v in vars(spec).items() if k != "backend"}, backend="auto"),
                           "xgrammar") == "xgrammar"
    # The front end's check reads a spec as its library would: EBNF under auto, Lark under guidance.
    check(so(grammar=GRAMMARS["xgrammar"]))
    check(so(grammar=GRAMMARS["guidance"]), "guidance")
    with pytest.raises(ValueError, match="structured_outputs.grammar: xgrammar cannot compile"):
        check(so(grammar=GRAMMARS["guidance"]))
    with pytest.raises(ValueError, match="structured_outputs.regex: llguidance cannot compile this regex"):
        check(so(regex="(ab"))
    with pytest.raises(ValueError, match="structured_outputs.regex: xgrammar cannot compile this regex"):
        check(so(regex="(ab"), "xgrammar")


@pytest.mark.parametrize("library", LIBRARIES)
def test_a_schema_means_the_same_under_either_library(tokenizer, library):
    """An object schema that lists properties allows no others unless it says so (xgrammar's strict
    reading, given to llguidance too); a bare object schema allows any object."""
    grammars = GrammarCompiler(tokenizer, 512, frozenset({tokenizer.eos_token_id}), backend=library)
    closed = {"type": "object", "properties": {"a": {"type": "integer"},
                                               "properties": {"type": "object", "properties": {}}}}
    cases = [(closed, '{"a": 1, "properties": {}}', True), (closed, '{"a": 1, "b": 2}', False),
             (closed, '{"properties": {"x": 1}}', False),
             ({**closed, "additionalProperties": True}, '{"a": 1, "b": 2}', True),
             ({"type": "object"}, '{"a": 1, "b": 2}', True),
             ({"type": "array", "items": {"type": "object", "properties": {"x": {"type": "integer"}}}},
              '[{"x": 1, "y": 2}]', False)]
    for schema, doc, ok in cases:
        g = grammars.matcher(so(json=schema), [])
        accepted = all(g.accept(t) for t in tokenizer(doc)["input_ids"]) and g.accept(tokenizer.eos_token_id)
        assert accepted == ok and g.terminated == ok, (schema, doc)


def _token(tok, text: str) -> int:
    ids = tok.convert_tokens_to_ids([text])
    assert ids[0] != tok.unk_token_id and tok.decode(ids) == text
    return ids[0]


@pytest.mark.parametrize("library", LIBRARIES)
def test_stop_tokens_end_a_finished_grammar_under_either_library(tokenizer, library):
    """The grammar may end with EOS or any of the request's stop_token_ids: those are allowed only
    where it may end, a refused one leaves the matcher as it was, and accepting one terminates."""
    tok = tokenizer
    eos, stop, other = tok.eos_token_id, _token(tok, "x"), _token(tok, "y")
    grammars = GrammarCompiler(tok, 512, frozenset({eos}), backend=library)
    a, b = _token(tok, "a"), _token(tok, "b")
    for ender, stops in ((stop, [stop]), (eos, [stop]), (eos, [])):
        g = grammars.matcher(so(regex="ab+"), stops)
        assert not g.accept(stop) and not g.accept(eos) and not g.accept(b)  # nothing changed:
        assert g.accept(a) and g.accept(b) and g.num_accepted == 2 and not g.terminated
        bits = _bits(fill_bitmasks([g])[0])
        assert bits[b] and bits[eos] and bits[stop] == (stop in stops) and not bits[other] and not bits[a]
        if ender not in stops and ender != eos:
            continue
        assert g.accept(ender) and g.terminated and g.num_accepted == 3
    # A grammar that can take nothing more allows exactly the stop tokens.
    g = grammars.matcher(so(choice=["ab"]), [stop, other])
    assert all(g.accept(t) for t in tok("ab")["input_ids"]) and not g.terminated
    assert set(np.flatnonzero(_bits(fill_bitmasks([g])[0]))) == {eos, stop, other}
    assert g.accept(other) and g.terminated


def test_one_fill_over_rows_of_both_libraries(tokenizer):
    """Rows of both libraries in one call: each mask is the one its grammar gives alone, in order."""
    tok = tokenizer
    grammars = GrammarCompiler(tok, 512, frozenset({tok.eos_token_id}))  # auto: both libraries
    doc = json.dumps({"name": "Ada", "age": 36, "color": "green", "tags": ["a", "bc"]})
    specs = [so(json=SCHEMA), so(grammar=GRAMMARS["xgrammar"]), so(json=SCHEMA, backend="xgrammar"),
             so(regex=r"[a-z]{3}-\d{2,4}"), so(choice=["yes", "no"], backend="xgrammar"), so(json_object=True)]
    prefixes = [doc, "(1+2", doc, "abc-1", "y", '{"k": ']
    rows = []
    for k in range(3):  # several states of each
        for spec, text in zip(specs, prefixes):
            g = grammars.matcher(spec, [_token(tok, "x")])
            for t in tok(text[:len(text) * k // 2])["input_ids"]:
                assert g.accept(t), (spec, text, k)
            rows.append(g)
    assert {g.library for g in rows} == set(LIBRARIES)
    together = fill_bitmasks(rows)
    assert together == [fill_bitmasks([g])[0] for g in rows]
    assert len(set(together)) > len(specs)  # the states differ


def test_the_engine_option_and_the_serve_flag(folder):
    from distengine.config import EngineConfig
    from launch.serve import add_arguments
    for bad in ("outlines", "llguidance", None):
        with pytest.raises(ValueError, match="structured_outputs_backend must be one of 'auto', 'xgrammar', 'guidance'"):
            EngineConfig.create(folder, structured_outputs_backend=bad)
    assert EngineConfig.create(folder).structured_outputs_backend == "auto"
    with pytest.raises(ValueError, match="structured_outputs_backend must be one of"):
        GrammarCompiler(None, 512, frozenset(), backend="outlines")
    import argparse
    p = argparse.ArgumentParser()
    add_arguments(p)
    assert p.parse_args(["m"]).structured_outputs_backend == "auto"
    assert p.parse_args(["m", "--structured-outputs-backend", "xgrammar"]).structured_outputs_backend == "xgrammar"
    assert p.parse_args(["m", "--guided-decoding-backend", "guidance"]).structured_outputs_backend == "guidance"
    with pytest.raises(SystemExit):
        p.parse_args(["m", "--structured-outputs-backend", "outlines"])


def test_an_engine_on_llguidance_reads_grammars_as_lark(folder):
    with LLM(folder, device="cpu", dtype="float32", max_model_len=128, structured_outputs_backend="guidance") as llm:
        sp = SamplingParams(temperature=1.0, seed=2, max_tokens=40, structured_outputs=so(grammar=GRAMMARS["guidance"]))
        out = llm.generate(PROMPTS, sp, use_tqdm=False)
        assert all(re.fullmatch(r"\((?:[0-9]|[1-9][0-9])(?:\+(?:[0-9]|[1-9][0-9]))*\)", o.outputs[0].text)
                   for o in out), out
        with pytest.raises(ValueError, match="structured_outputs.grammar: llguidance cannot compile"):
            llm.generate(PROMPTS, SamplingParams(structured_outputs=so(grammar=BAD_GRAMMARS["guidance"])),
                         use_tqdm=False)
        assert llm.engine._grammars.backend == "guidance"
        _idle(llm)
