"""SamplingParams validation, outputs, incremental detokenisation and stop strings (CPU, fast)."""
from __future__ import annotations

import dataclasses
import json
import math
import random
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from distengine.detokenizer import IncrementalDetokenizer, check_stop_strings
from distengine.outputs import CompletionOutput, RequestOutput
from distengine.sampling_params import SamplingParams
from distengine.step import NewRequest, RequestSampling, StepPlan
from workers.sampler import SamplingTensors

WORKER_KEYS = {"temperature", "top_k", "top_p", "min_p", "presence_penalty",
               "frequency_penalty", "repetition_penalty", "seed", "logprobs", "prompt_logprobs"}
ADJUST_KEYS = {"logit_bias", "allowed_token_ids", "min_tokens", "stop_ids", "bad_words"}  # the logit adjustments' record

# ---------------------------------------------------------------------------- SamplingParams


def test_defaults():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert (p.max_tokens, p.min_tokens, p.seed, p.logprobs) == (16, 0, None, None)
    assert p.stop == [] and p.stop_token_ids == []
    assert not p.ignore_eos and not p.include_stop_str_in_output and p.skip_special_tokens
    assert not p.is_greedy
    assert p.output_text_buffer_length == 0


BAD = [
    ("n", dict(n=0)),
    ("n", dict(n=-3)),
    ("n", dict(n=1.5)),
    ("temperature", dict(temperature=-0.1)),
    ("temperature", dict(temperature=math.inf)),
    ("temperature", dict(temperature=math.nan)),
    ("temperature", dict(temperature="hot")),
    ("top_p", dict(top_p=0.0)),
    ("top_p", dict(top_p=1.01)),
    ("top_p", dict(top_p=-0.5)),
    ("top_p", dict(top_p=math.nan)),
    ("top_k", dict(top_k=-2)),
    ("top_k", dict(top_k=2.5)),
    ("top_k", dict(top_k=True)),
    ("min_p", dict(min_p=-0.01)),
    ("min_p", dict(min_p=1.5)),
    ("presence_penalty", dict(presence_penalty=2.5)),
    ("presence_penalty", dict(presence_penalty=-2.01)),
    ("frequency_penalty", dict(frequency_penalty=3.0)),
    ("frequency_penalty", dict(frequency_penalty=-2.5)),
    ("frequency_penalty", dict(frequency_penalty=math.nan)),
    ("repetition_penalty", dict(repetition_penalty=0.0)),
    ("repetition_penalty", dict(repetition_penalty=-1.0)),
    ("repetition_penalty", dict(repetition_penalty=math.inf)),
    ("max_tokens", dict(max_tokens=0)),
    ("max_tokens", dict(max_tokens=-5)),
    ("max_tokens", dict(max_tokens=3.0)),
    ("min_tokens", dict(min_tokens=-1)),
    ("min_tokens", dict(min_tokens=20, max_tokens=10)),
    ("logprobs", dict(logprobs=-2)),
    ("logprobs", dict(logprobs=1.5)),
    ("seed", dict(seed="abc")),
    ("stop", dict(stop="")),
    ("stop", dict(stop=["ok", ""])),
    ("stop", dict(stop=["ok", 3])),
    ("stop", dict(stop=42)),
    ("stop_token_ids", dict(stop_token_ids=[1, "2"])),
    ("stop_token_ids", dict(stop_token_ids=[1, 2.0])),
    ("stop_token_ids", dict(stop_token_ids=[-1])),
    ("stop_token_ids", dict(stop_token_ids=7)),
    ("ignore_eos", dict(ignore_eos="yes")),
    ("include_stop_str_in_output", dict(include_stop_str_in_output=1)),
    ("skip_special_tokens", dict(skip_special_tokens=None)),
]


@pytest.mark.parametrize("field,kwargs", BAD, ids=[f"{f}-{i}" for i, (f, _) in enumerate(BAD)])
def test_validation_names_field(field, kwargs):
    with pytest.raises(ValueError) as ei:
        SamplingParams(**kwargs)
    msg = str(ei.value)
    # The message starts with the field's exact name (as vLLM's do), not a longer name.
    assert re.match(rf"{re.escape(field)}(?![a-z_])", msg), msg


def test_n_and_best_of():
    p = SamplingParams(n=2, best_of=3)
    assert p.num_children == 3 and p.ranks_children and SamplingParams(n=4).num_children == 4
    assert not SamplingParams(n=2, best_of=2).ranks_children
    for kw, match in ((dict(n=129), "n must be at most 128"), (dict(n=3, best_of=2), "best_of must be at least n=3"),
                      (dict(best_of=1.5), "best_of must be an int")):
        with pytest.raises(ValueError, match=match):
            SamplingParams(**kw)
    with pytest.raises(ValueError, match="front ends"):  # the engine takes one completion a request
        from distengine.scheduler import EngineRequest, Scheduler
        Scheduler.add_request(None, EngineRequest("x", [1], sampling=p))


def test_vllm_wording():
    with pytest.raises(ValueError, match=re.escape("top_p must be in (0, 1], got 0.0.")):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match=re.escape("min_p must be in [0, 1], got 2.")):
        SamplingParams(min_p=2)
    with pytest.raises(ValueError, match=re.escape("presence_penalty must be in [-2, 2], got 3")):
        SamplingParams(presence_penalty=3)
    with pytest.raises(ValueError, match=re.escape("max_tokens must be at least 1, got 0.")):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match=re.escape(
            "min_tokens must be less than or equal to max_tokens=4, got 5.")):
        SamplingParams(min_tokens=5, max_tokens=4)
    with pytest.raises(ValueError, match=re.escape("stop cannot contain an empty string.")):
        SamplingParams(stop=[""])


@pytest.mark.parametrize("kwargs", [
    dict(top_k=-1), dict(top_k=0), dict(top_k=1), dict(top_p=1.0), dict(top_p=1e-6),
    dict(min_p=0.0), dict(min_p=1.0), dict(presence_penalty=-2.0), dict(presence_penalty=2.0),
    dict(frequency_penalty=-2), dict(frequency_penalty=2), dict(repetition_penalty=1e-3),
    dict(temperature=0.0), dict(temperature=5), dict(max_tokens=None, min_tokens=1000),
    dict(max_tokens=1), dict(min_tokens=7, max_tokens=7), dict(logprobs=0), dict(logprobs=-1),
    dict(logprobs=20), dict(seed=0), dict(seed=2**70), dict(stop_token_ids=(5, 5, 3)),
])
def test_valid_edges(kwargs):
    SamplingParams(**kwargs)


def test_normalisation():
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "bc")).stop == ["a", "bc"]
    assert SamplingParams(stop_token_ids=[5, 3, 5, 9, 3]).stop_token_ids == [5, 3, 9]
    assert SamplingParams(seed=-1).seed is None
    assert SamplingParams(logprobs=True).logprobs == 1
    p = SamplingParams(stop=["ab", "abcd"])
    assert p.output_text_buffer_length == 3
    assert SamplingParams(stop=["abcd"], include_stop_str_in_output=True) \
        .output_text_buffer_length == 0
    # Scalars become plain Python types.
    p = SamplingParams(temperature=1, top_p=torch.tensor(0.5).item(), top_k=3)
    assert type(p.temperature) is float and type(p.top_p) is float and type(p.top_k) is int


def test_greedy_as_vllm():
    p = SamplingParams(temperature=0.0, top_p=0.3, top_k=5, min_p=0.2)
    assert p.is_greedy and (p.top_p, p.top_k, p.min_p) == (1.0, 0, 0.0)
    assert SamplingParams(temperature=9e-6).is_greedy
    assert not SamplingParams(temperature=1e-5).is_greedy


def test_for_workers_record():
    p = SamplingParams(temperature=0.7, top_p=0.9, top_k=40, min_p=0.05, presence_penalty=0.5,
                       frequency_penalty=-0.25, repetition_penalty=1.2, seed=1234, logprobs=3,
                       max_tokens=33, stop=["x"], stop_token_ids=[7])
    r = p.for_workers()
    assert {f.name for f in dataclasses.fields(r)} == WORKER_KEYS | ADJUST_KEYS
    for k in WORKER_KEYS:
        assert getattr(r, k) == getattr(p, k)
    assert r.penalised and r.reads_prompt and not r.greedy and not r.adjusts_logits
    # Plain scalars only (the plan is sent with msgpack), and it survives the step's encoding.
    assert all(v is None or type(v) in (int, float) for v in dataclasses.astuple(r) if not isinstance(v, tuple))
    step = StepPlan(3, new_requests=[NewRequest("a", [[1]], r, 2, [1, 2], [3])])
    assert StepPlan.decode(step.encode()) == step
    a = SamplingParams(logit_bias={5: -1.5, 2: 3}, allowed_token_ids=[4, 2, 4], min_tokens=2,
                       stop_token_ids=[8]).for_workers(eos_token_ids=[1])
    assert (a.logit_bias, a.allowed_token_ids, a.min_tokens, a.stop_ids) == (((2, 3.0), (5, -1.5)), (4, 2), 2, (1, 8))
    step = StepPlan(4, new_requests=[NewRequest("b", [[1]], a, 0)])
    assert StepPlan.decode(step.encode()) == step
    # Greedy is temperature 0; top_k -1 is 0 (off); penalties off are off.
    g = SamplingParams(temperature=5e-6, top_k=-1).for_workers()
    assert g.temperature == 0.0 and g.greedy and g.top_k == 0 and not g.penalised and not g.reads_prompt
    assert SamplingParams(frequency_penalty=0.1).for_workers().penalised
    assert not SamplingParams(frequency_penalty=0.1).for_workers().reads_prompt

    # The worker sampler takes it, and agrees with it.
    greedy = SamplingParams(temperature=0.0).for_workers()
    st = SamplingTensors.build([r, greedy, SamplingParams().for_workers()],
                               [[1, 2], [3], []], [[4], [], []], vocab_size=100, device="cpu")
    assert torch.allclose(st.temperature, torch.tensor([0.7, 0.0, 1.0]))
    assert st.top_k.tolist() == [40, 100, 100]
    assert torch.allclose(st.top_p, torch.tensor([0.9, 1.0, 1.0]))
    assert torch.allclose(st.repetition_penalty, torch.tensor([1.2, 1.0, 1.0]))
    assert st.has_seed.tolist() == [True, False, False] and st.seeds[0].item() == 1234
    assert st.num_logprobs == 3


def test_worker_seed_is_low_64_bits():
    big = (5 << 64) + 77
    assert SamplingParams(seed=big).for_workers().seed == 77
    r = SamplingParams(seed=(1 << 64) - 1).for_workers()
    assert r.seed == -1
    # Same tensors as the raw seed would give.
    a = SamplingTensors.build([r], [[]], [[]], 10, "cpu").seeds
    b = SamplingTensors.build([RequestSampling(temperature=1.0, seed=(1 << 64) - 1)], [[]], [[]], 10, "cpu").seeds
    assert torch.equal(a, b)


def test_clone_is_independent():
    p = SamplingParams(stop=["a"], stop_token_ids=[1])
    q = p.clone()
    q.stop.append("b")
    assert p.stop == ["a"] and q == SamplingParams(stop=["a", "b"], stop_token_ids=[1])


# ---------------------------------------------------------------------------- outputs


def test_outputs_repr_and_fields():
    c = CompletionOutput(index=0, text="hi there", token_ids=[5, 6], finish_reason="stop",
                         stop_reason="\n", logprobs=[{5: -0.1}, {6: -0.2, 7: -3.0}],
                         cumulative_logprob=-0.3)
    r = RequestOutput(request_id="0", prompt="Hello", prompt_token_ids=[1, 2, 3],
                      num_cached_tokens=0, finished=True, outputs=[c])
    assert c.finished() and r.outputs[0].text == "hi there"
    s = repr(r)
    for piece in ("RequestOutput(", "request_id='0'", "prompt='Hello'", "num_cached_tokens=0",
                  "finished=True", "CompletionOutput(", "text='hi there'", "token_ids=[5, 6]",
                  "finish_reason='stop'", "stop_reason='\\n'", "[2 positions]"):
        assert piece in s, (piece, s)
    running = CompletionOutput(0, "", [])
    assert not running.finished() and running.logprobs is None and running.stop_reason is None
    assert RequestOutput("1", None, [1]).outputs == []


# ---------------------------------------------------------------------------- tokenizers

CORPUS = [
    "hello world, the quick brown fox jumps over the lazy dog.",
    "café crème brûlée naïve résumé — déjà vu",
    "日本語のテキスト 日本 東京 こんにちは世界",
    "emoji 🙂🚀 and math ∑ ∫ √ symbols",
    "The end. THE END! stop here ### and there",
] * 3


@pytest.fixture(scope="module")
def byte_bpe():
    """GPT-2 style byte-level BPE trained offline; multi-byte characters span several tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=330, special_tokens=["<eos>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>",
                                   clean_up_tokenization_spaces=False)


@pytest.fixture(scope="module")
def sp_bpe():
    """Llama/sentencepiece style: Metaspace '▁' words, byte fallback <0xXX> for characters outside
    the (ASCII) alphabet, and a decoder that strips the first leading space."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    ascii_corpus = ["".join(ch for ch in s if ord(ch) < 128) for s in CORPUS]
    trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=["▁"], show_progress=False)
    tok.train_from_iterator(ascii_corpus, trainer)
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    spec["model"]["byte_fallback"] = True
    tok = Tokenizer.from_str(json.dumps(spec))
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>", clean_up_tokenization_spaces=False)


def _run(tokenizer, ids, chunks, skip=True, check_prefix=True):
    det = IncrementalDetokenizer(tokenizer, [1, 2, 3], skip_special_tokens=skip)
    final = tokenizer.decode(ids, skip_special_tokens=skip)
    pieces, i = [], 0
    for c in chunks:
        piece = det.append(ids[i:i + c])
        i += c
        pieces.append(piece)
        if check_prefix:  # never emits text it would have to retract
            assert final.startswith("".join(pieces)), ("".join(pieces), final)
    assert i == len(ids)
    assert "".join(pieces) == det.output_text
    tail = det.flush()
    return "".join(pieces) + tail, final, tail


def _chunks(rng, n, max_chunk):
    out = []
    while n:
        c = rng.randint(1, min(max_chunk, n))
        out.append(c)
        n -= c
    return out


@pytest.mark.parametrize("which", ["byte_bpe", "sp_bpe"])
def test_multibyte_chars_really_split(which, request):
    tok = request.getfixturevalue(which)
    ids = tok.encode("京都 ñü 🚀", add_special_tokens=False)
    assert len(ids) >= 8  # 20 UTF-8 bytes over many tokens
    # Some prefix decodes to an incomplete character.
    assert any(tok.decode(ids[:k]).endswith("\ufffd") for k in range(1, len(ids)))


@pytest.mark.parametrize("which", ["byte_bpe", "sp_bpe"])
@pytest.mark.parametrize("skip", [True, False])
def test_incremental_matches_full_decode(which, skip, request):
    tok = request.getfixturevalue(which)
    rng = random.Random(0)
    eos = tok.eos_token_id
    texts = CORPUS[:5] + ["  leading spaces and trailing  ", "a", "日", "x 日本 y é.z 🙂",
                          "mixed\nlines\n\n  indented\ttabs"]
    for text in texts:
        ids = tok.encode(text, add_special_tokens=False)
        # Sprinkle special tokens in (skipped or kept depending on skip).
        for _ in range(2):
            ids.insert(rng.randint(0, len(ids)), eos)
        for chunking in ([1] * len(ids), _chunks(rng, len(ids), 4), [len(ids)]):
            got, final, tail = _run(tok, ids, chunking, skip)
            assert got == final
            # A kept special token inside a multi-byte character can leave a broken tail,
            # which only flush() emits; otherwise append alone is exact.
            assert tail == "" or final.endswith("\ufffd")
            if skip:
                assert final == tok.decode(tok.encode(text, add_special_tokens=False))


def test_sentencepiece_spaces_kept_between_pieces(sp_bpe):
    ids = sp_bpe.encode("hello world the end", add_special_tokens=False)
    det = IncrementalDetokenizer(sp_bpe, [], True)
    pieces = [det.append([t]) for t in ids]
    assert "".join(pieces) == "hello world the end"
    assert any(p.startswith(" ") for p in pieces)  # the window keeps the '▁' -> ' '


def test_random_token_streams_byte_level(byte_bpe):
    """Arbitrary ids (invalid UTF-8, lone continuation bytes, specials): still exact."""
    rng = random.Random(1)
    V = len(byte_bpe)
    for trial in range(60):
        ids = [rng.randrange(V) for _ in range(rng.randint(1, 40))]
        for skip in (True, False):
            got, final, _ = _run(byte_bpe, ids, _chunks(rng, len(ids), 3), skip)
            assert got == final


def test_random_valid_text_sp(sp_bpe):
    rng = random.Random(2)
    alphabet = list("abcdefghij klmnop.,!") + list("éèñ日本語🙂—")
    for trial in range(40):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 30)))
        ids = sp_bpe.encode(text, add_special_tokens=False)
        got, final, tail = _run(sp_bpe, ids, _chunks(rng, len(ids), 3))
        assert got == final and tail == ""


def test_incomplete_tail_needs_flush(byte_bpe):
    ids = byte_bpe.encode("ok 日", add_special_tokens=False)
    ids = ids[:-1]  # drop the last byte of 日: output ends with an incomplete character
    det = IncrementalDetokenizer(byte_bpe, [], True)
    text = "".join(det.append([t]) for t in ids)
    assert text == "ok " and det.output_text == "ok "
    full = byte_bpe.decode(ids)
    assert full.endswith("\ufffd")
    assert text + det.flush() == full


def test_no_tokenizer():
    det = IncrementalDetokenizer(None, [1, 2], skip_special_tokens=True)
    assert det.append([5, 6]) == "" and det.append([]) == "" and det.flush() == ""
    assert det.token_ids == [5, 6] and det.output_text == ""


# ---------------------------------------------------------------------------- stop strings


def test_check_stop_strings_basic():
    text = "Hello world###tail"
    # The stop string ends in the new text (last 6 chars: "##tail" -> "###" straddles).
    assert check_stop_strings(text, 6, ["###"], False) == ("Hello world", "###")
    assert check_stop_strings(text, 6, ["###"], True) == ("Hello world###", "###")
    assert check_stop_strings(text, 6, ["zzz"], False) == (text, None)
    assert check_stop_strings(text, 0, ["###"], False) == (text, None)
    assert check_stop_strings(text, 6, [], False) == (text, None)
    # At the very end, include keeps the whole text.
    assert check_stop_strings("abc STOP", 2, ["STOP"], True) == ("abc STOP", "STOP")
    assert check_stop_strings("abc STOP", 2, ["STOP"], False) == ("abc ", "STOP")
    # Stop string as the whole text.
    assert check_stop_strings("END", 3, ["END"], False) == ("", "END")


def test_check_stop_strings_only_new_text():
    # "ab" lies wholly in the old text: it was checked before, not matched now.
    assert check_stop_strings("ab cd", 2, ["ab"], False) == ("ab cd", None)
    # ... but a match that straddles old/new is found.
    assert check_stop_strings("xxab", 1, ["ab"], False) == ("xx", "ab")
    # new_text_len larger than the text is fine.
    assert check_stop_strings("ab", 10, ["ab"], False) == ("", "ab")


def test_check_stop_strings_earliest():
    # Both end in the new text: the one that ends first wins, whatever the list order.
    assert check_stop_strings("1234567", 7, ["56", "23"], False) == ("1", "23")
    assert check_stop_strings("1234567", 7, ["56", "23"], True) == ("123", "23")
    # "cd" completes before "abcde": a char-by-char stream would have stopped there.
    assert check_stop_strings("xabcde", 5, ["abcde", "cd"], False) == ("xab", "cd")
    # Same end: the earlier start (longer string) wins.
    assert check_stop_strings("xabc", 3, ["bc", "abc"], False) == ("x", "abc")
    # First occurrence of a repeated stop string.
    assert check_stop_strings("a.b.c.", 6, ["."], False) == ("a", ".")


@pytest.mark.parametrize("include", [False, True])
def test_stop_strings_across_token_boundaries(byte_bpe, sp_bpe, include):
    for tok in (byte_bpe, sp_bpe):
        text = "the quick brown fox. THE END! stop here ### and there"
        ids = tok.encode(text, add_special_tokens=False)
        for stop in (["END!"], ["n fox"], ["###", "zzz"], ["k br"], ["fox. TH"]):
            s = stop[0]
            assert any(  # the stop string really spans several tokens
                s not in tok.decode([t]) for t in ids)
            det = IncrementalDetokenizer(tok, [], True)
            out, matched, steps = "", None, 0
            for t in ids:
                piece = det.append([t])
                out += piece
                steps += 1
                out, matched = check_stop_strings(out, len(piece), stop, include)
                if matched:
                    break
            assert matched == s
            cut = text.index(s)
            assert out == (text[:cut + len(s)] if include else text[:cut])
            assert steps < len(ids) or text.endswith(s)


def test_stop_string_with_multibyte(byte_bpe):
    text = "voilà 日本語 fin"
    ids = byte_bpe.encode(text, add_special_tokens=False)
    det = IncrementalDetokenizer(byte_bpe, [], True)
    out, matched = "", None
    for t in ids:
        piece = det.append([t])
        out += piece
        out, matched = check_stop_strings(out, len(piece), ["本語"], False)
        if matched:
            break
    assert matched == "本語" and out == "voilà 日"


class _ContextTok:
    """A decoder whose rendering of the *first* token depends on the next one ("q" -> "Q" when
    something follows), so a window's text can rewrite its start; the full decode cannot."""
    VOCAB = ["a", "q", "z", " ", "b"]

    def decode(self, ids, skip_special_tokens=True):  # no clean_up_tokenization_spaces kwarg
        toks = [self.VOCAB[i] for i in ids]
        if len(toks) > 1 and toks[0] == "q":
            toks[0] = "Q"
        return "".join(toks)


def test_window_inconsistency_resyncs_on_full_decode():
    tok = _ContextTok()
    rng = random.Random(3)
    for trial in range(200):
        ids = [0] + [rng.randrange(5) for _ in range(rng.randint(0, 12))]
        got, final, tail = _run(tok, ids, _chunks(rng, len(ids), 3), True)
        assert got == final and tail == ""


_FIELD_VALUES = st.one_of(st.none(), st.booleans(), st.integers(-2 ** 70, 2 ** 70), st.floats(), st.just(10 ** 400),
                          st.text(max_size=3), st.lists(st.integers(-2 ** 70, 2 ** 70), max_size=3),
                          st.lists(st.text(max_size=3), max_size=3))


@settings(max_examples=400, deadline=None, database=None)
@given(st.dictionaries(st.sampled_from(["temperature", "top_p", "top_k", "min_p", "presence_penalty",
                                        "frequency_penalty", "repetition_penalty", "max_tokens", "min_tokens",
                                        "seed", "logprobs", "stop", "stop_token_ids"]), _FIELD_VALUES))
def test_whatever_passes_the_checks_encodes_in_a_step(kw):
    """The bounded contract: params that construct travel in a step's msgpack, whatever they hold
    (an unchecked top_k of 2**64 once ended a TP=2 engine). A bad value is a ValueError or
    TypeError, nothing else."""
    try:
        sp = SamplingParams(**kw)
    except (ValueError, TypeError):
        return
    plan = StepPlan(0, [NewRequest("r", [[1]], sp.for_workers(), 0, [], [])])
    assert StepPlan.decode(plan.encode()) == plan


@pytest.mark.parametrize("kw,match", [
    (dict(logit_bias={"5": 1.0}), "logit_bias keys must be token ids"),
    (dict(logit_bias={True: 1.0}), "logit_bias keys must be token ids"),
    (dict(logit_bias={-1: 1.0}), "logit_bias keys must be token ids"),
    (dict(logit_bias={5: float("nan")}), r"logit_bias\[5\] must be a finite number"),
    (dict(logit_bias={5: "1"}), r"logit_bias\[5\] must be a finite number"),
    (dict(logit_bias=[(5, 1.0)]), "logit_bias must be a dict"),
    (dict(allowed_token_ids=[]), "allowed_token_ids cannot be empty"),
    (dict(allowed_token_ids="5"), "allowed_token_ids must be a list"),
    (dict(allowed_token_ids=[1.5]), "allowed_token_ids must contain only integers"),
])
def test_logit_adjustments_are_checked(kw, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kw)
    p = SamplingParams(logit_bias={7: 2}, allowed_token_ids=(3, 3, 1))
    assert p.logit_bias == {7: 2.0} and p.allowed_token_ids == [3, 1]
    assert p.clone().logit_bias is not p.logit_bias
