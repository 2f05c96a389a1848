"""The input contract (`distengine.inputs`) at TP=1 and TP=2: every bad request raises
`TypeError`/`ValueError` naming the field and the value, nothing reaches a worker (no block is
held, nothing is queued), and after each one the engine gives the same tokens as before. Plus
`logprobs=-1` (the whole vocabulary, as vLLM)."""
from __future__ import annotations

import pytest

from distengine import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from launch.demo import build_model
    folder = str(tmp_path_factory.mktemp("demo"))
    build_model(folder)
    return folder


def bad_inputs(vocab: int):
    """(what, call(llm), exception, message pattern)."""
    ok = {"prompt_token_ids": [5, 6, 7]}
    return [
        ("prompts=5", lambda llm: llm.generate(5, GREEDY), TypeError, r"prompts must be .* got int 5"),
        ("prompts=None", lambda llm: llm.generate(None, GREEDY), TypeError, "prompts must be"),
        ("id = vocab", lambda llm: llm.generate({"prompt_token_ids": [1, vocab]}, GREEDY), ValueError,
         rf"prompts\[0\]\['prompt_token_ids'\]\[1\] = {vocab} is not a token id .*\[0, {vocab}\)"),
        ("id -1", lambda llm: llm.generate([ok, {"prompt_token_ids": [-1]}], GREEDY), ValueError,
         r"prompts\[1\]\['prompt_token_ids'\]\[0\] = -1"),
        ("id 10**6", lambda llm: llm.generate({"prompt_token_ids": [10 ** 6]}, GREEDY), ValueError, "1000000"),
        ("id '5'", lambda llm: llm.generate({"prompt_token_ids": ["5"]}, GREEDY), TypeError,
         r"\[0\] must be an integer token id, got str '5'"),
        ("id 5.7", lambda llm: llm.generate({"prompt_token_ids": [5.7]}, GREEDY), TypeError, "got float 5.7"),
        ("id True", lambda llm: llm.generate({"prompt_token_ids": [True]}, GREEDY), TypeError, "got bool"),
        ("ids as a string", lambda llm: llm.generate({"prompt_token_ids": "1 2"}, GREEDY), TypeError,
         "must be a list of token ids"),
        ("no ids", lambda llm: llm.generate({"prompt_token_ids": []}, GREEDY), ValueError, r"prompts\[0\] is empty"),
        ("unknown key", lambda llm: llm.generate({"tokens": [1]}, GREEDY), ValueError, r"unknown key\(s\) \['tokens'\]"),
        ("an image", lambda llm: llm.generate({"prompt_token_ids": [1], "multi_modal_data": {"image": None}}, GREEDY),
         ValueError, r"prompts\[0\]\['multi_modal_data'\]: images, audio and video are not supported"),
        ("an image in chat", lambda llm: llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
         ValueError, r"messages\[0\]\[0\]\['content'\]\[0\] is a 'image_url' part"),
        ("prompt of bytes", lambda llm: llm.generate([ok, b"hi"], GREEDY), TypeError, r"prompts\[1\] must be"),
        ("params as dict", lambda llm: llm.generate(ok, {"temperature": 0}), TypeError,
         "sampling_params must be a SamplingParams"),
        ("a bad params entry", lambda llm: llm.generate([ok, ok], [GREEDY, "x"]), TypeError, r"sampling_params\[1\]"),
        ("params count", lambda llm: llm.generate([ok, ok, ok], [GREEDY, GREEDY]), ValueError,
         "2 sampling params for 3 prompts"),
        ("stop token 999", lambda llm: llm.generate(ok, SamplingParams(stop_token_ids=[3, 999])), ValueError,
         r"sampling_params.stop_token_ids\[1\] = 999"),
        ("logprobs > vocab", lambda llm: llm.generate(ok, SamplingParams(logprobs=vocab + 1)), ValueError,
         "logprobs"),
        ("too long", lambda llm: llm.generate({"prompt_token_ids": [1] * 600}, GREEDY), ValueError,
         "600 tokens long but max_model_len is 512"),
        ("temperature -1", lambda llm: llm.generate(ok, SamplingParams(temperature=-1)), ValueError, "temperature"),
        ("chat(5)", lambda llm: llm.chat(5), TypeError, "messages must be"),
        ("chat without role", lambda llm: llm.chat([{"content": "x"}]), TypeError, r"messages\[0\]"),
    ]


def walk(llm: LLM) -> None:
    vocab = llm.info.vocab_size
    prompt = {"prompt_token_ids": [7, 8, 9, 10]}
    want = llm.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    mgr = llm.scheduler.manager
    for what, call, exc, pattern in bad_inputs(vocab):
        with pytest.raises(exc, match=pattern):
            call(llm)
        assert not llm.scheduler.has_unfinished() and mgr.num_free_blocks == mgr.pool.num_blocks - 1, what
        got = llm.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
        assert got == want, what


def test_bad_inputs_tp1(model):
    with LLM(model, device="cpu", dtype="float32", max_model_len=512) as llm:
        walk(llm)
        # vLLM's -1: every token of the vocabulary, at every position.
        out = llm.generate({"prompt_token_ids": [3, 4]}, SamplingParams(temperature=0, max_tokens=2, logprobs=-1),
                           use_tqdm=False)[0].outputs[0]
        vocab = llm.info.vocab_size
        assert [len(d) for d in out.logprobs] == [vocab, vocab]
        assert all(max(d, key=d.get) == t for d, t in zip(out.logprobs, out.token_ids))


def test_bad_inputs_tp2(model, ray_cluster):
    with LLM(model, tensor_parallel_size=2, device="cpu", dtype="float32", max_model_len=512) as llm:
        walk(llm)
