"""No request, abort or fault can end or stall the engine (CPU, a tiny model):

- every field is bounded where a request enters, so nothing that passes can fail to encode in a
  step (a top_k past 64 bits once ended a TP=2 server for good); a string UTF-8 cannot carry is a
  400, not a 500; every list is bounded;
- a step that fails on the driver fails the requests it concerns, and the engine goes on;
- `AsyncLLM.abort` ends its reader's stream with a last output; a Ctrl-C in `LLM.generate` aborts
  that call and the next one works, at TP 1 and 2;
- a shutdown that cannot wait ends the streams it cuts with an error event and [DONE], quietly; a
  dead engine makes the server exit with status 1;
- random request bodies, well- and ill-typed, never get a 5xx, leak no block and change no token.
"""
from __future__ import annotations

import asyncio
import faulthandler
import json
import os
import signal
import subprocess
import time

import pytest

from distengine import LLM, SamplingParams
from distengine.executor import EngineDeadError
from tests.test_server import KEY, Server, model  # noqa: F401 - the served model fixture

httpx = pytest.importorskip("httpx")
ray = pytest.importorskip("ray")

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module", params=[1, 2], ids=["tp1", "tp2"])
def served(request, model):  # noqa: F811
    s = Server(model, "--tensor-parallel-size", str(request.param), "--shutdown-timeout", "5")
    s.tp = request.param
    s.greedy = s.post("/v1/completions", {"prompt": "what is water", "max_tokens": 8, "temperature": 0,
                                          "ignore_eos": True}).json()["choices"][0]["text"]
    yield s
    assert s.stop() == 0


def completions(s: Server, **body) -> httpx.Response:
    return s.post("/v1/completions", {"prompt": "what is water", "max_tokens": 4, **body})


def assert_serving(s: Server) -> None:
    """No block held, and the same greedy text as at the start."""
    s.wait_idle()
    r = completions(s, max_tokens=8, temperature=0, ignore_eos=True)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == s.greedy


def wait_idle(engine) -> None:
    """Until the engine holds no request and no block (10 s at most)."""
    deadline = time.monotonic() + 10
    while not engine.engine.call("is_idle").result(timeout=10):
        assert time.monotonic() < deadline, "blocks still held after the aborts"
        time.sleep(0.1)


# ---- one bounded contract -------------------------------------------------------------------------
BAD_BODIES = [
    ("top_k", {"top_k": 2 ** 64}), ("top_k", {"top_k": 2 ** 31}), ("max_tokens", {"max_tokens": 2 ** 40}),
    ("min_tokens", {"min_tokens": 2 ** 63}), ("temperature", {"temperature": 10 ** 400}),
    ("stop", {"stop": ["x"] * 10_000}), ("stop", {"stop": ["y" * 5000]}),
    ("stop_token_ids", {"stop_token_ids": list(range(2000))}), ("stop_token_ids", {"stop_token_ids": [2 ** 64]}),
    ("prompt", {"prompt": ["a"] * 1025}), ("model", {"model": "\ud800"}), ("stop", {"stop": ["\udc00"]}),
    ("prompt", {"prompt": "water \ud800"}), ("logit_bias", {"logit_bias": {"x": 1}}),
    ("logit_bias", {"logit_bias": {"999999999": 1}}),
    ("allowed_token_ids", {"allowed_token_ids": []}), ("allowed_token_ids", {"allowed_token_ids": [2 ** 40]}),
    ("prompt_logprobs", {"prompt_logprobs": 21}), ("prompt_logprobs", {"prompt_logprobs": 1, "stream": True}),
    ("echo", {"echo": True, "stream": True}), ("n", {"use_beam_search": True, "n": 65}), ("use_beam_search", {"use_beam_search": True, "stream": True}),
    ("top_p", {"use_beam_search": True, "top_p": 0.5}),
    ("spaces_between_special_tokens", {"spaces_between_special_tokens": False}), ("n", {"n": 129}), ("best_of", {"n": 3, "best_of": 2}),
    ("bad_words", {"bad_words": [""]}), ("bad_words", {"bad_words": "water"}), ("guided_decoding_backend", {"guided_decoding_backend": "outlines"}),
    ("structured_outputs.structural_tag", {"structured_outputs": {"structural_tag": "{}"}}),
]


@pytest.mark.parametrize("field,extra", BAD_BODIES, ids=[f"{f}-{i}" for i, (f, _) in enumerate(BAD_BODIES)])
def test_out_of_bounds_fields_are_refused_by_name(served, field, extra):
    r = completions(served, **extra)
    assert r.status_code == 400, r.text
    assert field in r.json()["error"]["message"] or r.json()["error"]["param"] == field, r.text


def test_unencodable_text_is_a_400_everywhere(served):
    for path, body in (("/v1/chat/completions", {"model": "\ud800", "messages": [{"role": "user", "content": "x"}]}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x \udfff"}]}),
                       ("/tokenize", {"model": "\ud800", "prompt": "x"}), ("/tokenize", {"prompt": "\ud800"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}] * 5000})):
        r = served.post(path, body)
        assert r.status_code == 400, (path, r.text)
        r.json()  # a body the client can read
    assert_serving(served)


def test_bounds_hold_offline_too():
    for kw, match in ((dict(top_k=2 ** 64), "top_k"), (dict(stop=["x"] * 10_000), "stop"),
                      (dict(stop=["\ud800"]), "stop"), (dict(stop_token_ids=list(range(5000))), "stop_token_ids"),
                      (dict(max_tokens=2 ** 40), "max_tokens"), (dict(repetition_penalty=10 ** 400), "repetition")):
        with pytest.raises(ValueError, match=match):
            SamplingParams(**kw)


# ---- faults on the driver fail their requests only ------------------------------------------------
class EncodingExecutor:
    """What the Ray executor does with a step: msgpack it (and run nothing)."""
    def __init__(self) -> None:
        self.pending = None

    def execute(self, plan):
        from distengine.step import StepOutput
        plan.encode()
        out = StepOutput(plan.step_id, [s.req_id for s in plan.scheduled if s.sample],
                         [1 for s in plan.scheduled if s.sample])
        previous, self.pending = self.pending, out if out.req_ids else None
        return previous if plan.defer_output else out

    def shutdown(self) -> None:
        pass


def test_a_step_that_cannot_be_encoded_fails_only_its_request():
    from distengine.config import EngineConfig
    from distengine.engine_core import EngineCore, EngineInfo
    from distengine.model_config import FULL
    from distengine.scheduler import EngineRequest
    from tests.helpers import plan_of
    plan = plan_of((FULL, 2), block_size=4, max_len=64)
    config = EngineConfig(model="fake", max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64)
    core = EngineCore(config, EncodingExecutor(), EngineInfo(config, plan, 100, 50, [], []))
    good = EngineRequest("good", [1, 2, 3], sampling=SamplingParams(max_tokens=3))
    bad = EngineRequest("bad", [4, 5], sampling=SamplingParams(max_tokens=3))
    bad.sampling.top_k = 2 ** 70  # past the checks, as a bug would get it
    core.add_request(good)
    core.add_request(bad)
    updates = []
    for _ in range(10):
        updates += core.step()
    failed = [u for u in updates if u.failed]
    assert [u.req_id for u in failed] == ["bad"] and "cannot be encoded" in failed[0].stop_reason
    assert good.output_token_ids == [1, 1, 1] and not core.has_unfinished()
    assert core.scheduler.manager.num_free_blocks == 99  # every block back


def test_a_failure_decoding_one_output_fails_that_request_only(model):  # noqa: F811
    from distengine.async_llm import AsyncLLM
    from distengine.executor import RequestError

    async def run(engine):
        async def one(rid):
            out = []
            async for o in engine.generate("what is water", GREEDY, rid):
                out.append(o)
            return out
        return await asyncio.gather(one("a"), one("b"), return_exceptions=True)

    engine = AsyncLLM(model, device="cpu", dtype="float32", max_model_len=256, engine_process=False)
    try:
        real = engine.outputs._apply

        def breaks_for_a(st, u, now):
            if st.output_id == "a":
                raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "a broken detokenizer")
            return real(st, u, now)
        engine.outputs._apply = breaks_for_a
        a, b = asyncio.run(run(engine))
        assert isinstance(a, RequestError) and "broken detokenizer" in str(a)
        assert b[-1].finished and len([t for o in b for t in o.outputs[0].token_ids]) == 8
        assert engine.engine.call("is_idle").result(timeout=10)
    finally:
        engine.shutdown()


# ---- aborts end their streams -----------------------------------------------------------------------
def test_abort_ends_the_readers_stream(model):  # noqa: F811
    from distengine.async_llm import AsyncLLM
    long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)

    async def storm(engine):
        async def read(rid):
            outs = []
            async for o in engine.generate("what is water", long, rid):
                outs.append(o)
            return outs
        tasks = [asyncio.create_task(read(f"r{i}")) for i in range(40)]
        await asyncio.sleep(0.3)
        for i in range(40):
            engine.abort(f"r{i}")
        return await asyncio.wait_for(asyncio.gather(*tasks), timeout=30)  # no reader left waiting

    engine = AsyncLLM(model, device="cpu", dtype="float32", max_model_len=256)
    try:
        streams = asyncio.run(storm(engine))
        assert all(outs[-1].finished and outs[-1].outputs[0].finish_reason in ("abort", "length") for outs in streams)
        assert any(outs[-1].outputs[0].finish_reason == "abort" for outs in streams)
        wait_idle(engine)
    finally:
        engine.shutdown()


def test_aborted_forks_and_beams_leave_no_block(model):  # noqa: F811
    """Requests of several completions (n, best_of) aborted by their id while their children
    run, and beam searches cancelled mid-way: every child's blocks go back to the pool."""
    from distengine.async_llm import AsyncLLM
    from distengine.beam_search import BeamSearchParams
    forked = [SamplingParams(n=3, temperature=1.0, max_tokens=200, ignore_eos=True),
              SamplingParams(n=2, best_of=4, temperature=1.0, max_tokens=200, ignore_eos=True)]

    async def storm(engine):
        async def read(rid, sp):
            outs = []
            async for o in engine.generate("what is water made of", sp, rid):
                outs.append(o)
            return outs
        tasks = [asyncio.create_task(read(f"f{i}", forked[i % 2])) for i in range(12)]
        beams = [asyncio.create_task(engine.beam_search("what is water", BeamSearchParams(beam_width=3, max_tokens=50),
                                                        f"b{i}")) for i in range(4)]
        await asyncio.sleep(0.5)
        for i in range(12):
            engine.abort(f"f{i}")
        for b in beams:
            b.cancel()
        await asyncio.gather(*beams, return_exceptions=True)
        return await asyncio.wait_for(asyncio.gather(*tasks), timeout=30)

    engine = AsyncLLM(model, device="cpu", dtype="float32", max_model_len=256)
    try:
        streams = asyncio.run(storm(engine))
        assert all(outs[-1].finished for outs in streams if outs)
        wait_idle(engine)
    finally:
        engine.shutdown()


@pytest.fixture
def ctrl_c():
    """Python's own Ctrl-C handler, which a runner started in the background (SIGINT ignored)
    leaves out."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


@pytest.mark.parametrize("tp", [1, 2])
def test_ctrl_c_in_generate_aborts_that_call_and_the_next_works(model, tp, ctrl_c):  # noqa: F811
    faulthandler.dump_traceback_later(300, exit=True)  # a hang fails the run, not the CI's clock
    try:
        with LLM(model, device="cpu", dtype="float32", max_model_len=256, tensor_parallel_size=tp) as llm:
            want = [o.outputs[0].token_ids for o in llm.generate(["what is water"] * 3, GREEDY, use_tqdm=False)]
            real, calls = llm.executor.execute, []

            def interrupted(plan):
                calls.append(1)
                if len(calls) == 3:  # Ctrl-C while the third step runs: held until it is over
                    os.kill(os.getpid(), signal.SIGINT)
                return real(plan)
            llm.executor.execute = interrupted
            with pytest.raises(KeyboardInterrupt):
                llm.generate(["who made oil"] * 4, SamplingParams(temperature=0.0, max_tokens=50), use_tqdm=False)
            llm.executor.execute = real
            got = [o.outputs[0].token_ids for o in llm.generate(["what is water"] * 3, GREEDY, use_tqdm=False)]
            assert got == want and not llm.scheduler.has_unfinished() and not llm.scheduler.has_in_flight()
            assert llm.scheduler.manager.usage == 0
    finally:
        faulthandler.cancel_dump_traceback_later()


def test_a_second_ctrl_c_inside_a_step_ends_the_engine_not_hangs_it(model, ctrl_c):  # noqa: F811
    with LLM(model, device="cpu", dtype="float32", max_model_len=256) as llm:
        real = llm.executor.worker.execute

        def interrupted_twice(plan):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)
            os.kill(os.getpid(), signal.SIGINT)  # raised at once, inside the step
            return real(plan)
        llm.executor.worker.execute = interrupted_twice
        with pytest.raises(KeyboardInterrupt):
            llm.generate("what is water", GREEDY, use_tqdm=False)
        with pytest.raises(EngineDeadError, match="interrupted"):
            llm.generate("what is water", GREEDY, use_tqdm=False)


# ---- shutdown and death ----------------------------------------------------------------------------
def _stream(s: Server, max_tokens: int = 240) -> httpx.Response:
    return httpx.stream("POST", s.url + "/v1/completions", timeout=60,
                        headers={"Authorization": f"Bearer {KEY}"},
                        json={"prompt": "what is water", "max_tokens": max_tokens, "temperature": 0,
                              "ignore_eos": True, "stream": True})


def _events(response) -> list[str]:
    return [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]


def test_shutdown_timeout_ends_cut_streams_with_an_error_event(model):  # noqa: F811
    s = Server(model, "--shutdown-timeout", "0.5")
    with _stream(s, max_tokens=250) as response:
        lines = response.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        s.proc.send_signal(signal.SIGTERM)
        rest = [line[len("data: "):] for line in lines if line.startswith("data: ")]
    assert rest[-1] == "[DONE]" and "shut down before this request finished" in json.loads(rest[-2])["error"]["message"]
    s.proc.wait(timeout=60)
    log = s.proc.stdout.read()
    assert s.proc.returncode == 0 and "Traceback" not in log and "CancelledError" not in log, log


def test_a_worker_that_dies_while_idle_ends_the_server(model):  # noqa: F811
    s = Server(model, "--tensor-parallel-size", "2")
    victim = _worker_pids(s, 2)[-1]
    t = time.monotonic()
    os.kill(victim, signal.SIGKILL)
    assert s.proc.wait(timeout=30) == 1
    assert time.monotonic() - t < 10  # the idle engine's pings notice within seconds
    assert "the engine died" in s.proc.stdout.read()


def test_a_raylet_that_dies_ends_the_streams_and_the_server(model):  # noqa: F811
    """The node's raylet killed under a TP=2 engine (the cluster it started declares a node dead
    after 3 missed 1-s health checks): the stream ends with an error event within seconds."""
    s = Server(model, "--tensor-parallel-size", "2")
    raylet = [p for p in _descendants(s.proc.pid) if "raylet/raylet" in _args(p)][0]
    with _stream(s) as response:
        lines = response.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        t = time.monotonic()
        os.kill(raylet, signal.SIGKILL)
        rest = [line[len("data: "):] for line in lines if line.startswith("data: ")]
        took = time.monotonic() - t
    assert rest[-1] == "[DONE]" and "error" in json.loads(rest[-2]) and took < 8, (took, rest[-2:])
    assert s.proc.wait(timeout=30) == 1


def _args(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _descendants(root: int) -> set[int]:
    out = subprocess.run(["ps", "-eo", "pid,ppid"], capture_output=True, text=True).stdout.split()[2:]
    parent = dict(zip(map(int, out[0::2]), map(int, out[1::2])))
    found, changed = {root}, True
    while changed:
        new = {p for p, pp in parent.items() if pp in found} - found
        found |= new
        changed = bool(new)
    return found - {root}


def _worker_pids(s: Server, tp: int) -> list[int]:
    """The engine process at TP=1; the Ray workers at TP=2 (the server's descendants)."""
    name = "distengine.core_client" if tp == 1 else "ray::Worker"
    return sorted(p for p in _descendants(s.proc.pid) if name in _args(p))


# ---- random bodies ---------------------------------------------------------------------------------
def test_random_bodies_never_5xx_nor_leak(served):
    hypothesis = pytest.importorskip("hypothesis")
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st
    scalars = st.one_of(st.none(), st.booleans(), st.integers(-2 ** 70, 2 ** 70), st.floats(allow_nan=False),
                        st.text(max_size=8), st.just("\ud800"), st.just(2 ** 64))
    values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4),
                                                                                                inner, max_size=3),
                          max_leaves=6)
    fields = ["model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "min_p", "n", "stream", "stop",
              "seed", "presence_penalty", "frequency_penalty", "repetition_penalty", "logprobs", "min_tokens",
              "stop_token_ids", "ignore_eos", "best_of", "echo", "logit_bias", "stream_options", "messages",
              "max_completion_tokens", "top_logprobs", "skip_special_tokens", "allowed_token_ids", "bad_words",
              "prompt_logprobs", "use_beam_search", "length_penalty", "return_tokens_as_token_ids",
              "chat_template_kwargs"]
    prompts = st.one_of(st.just("what is water"), st.lists(st.integers(0, 120), min_size=1, max_size=6), values)
    body = st.fixed_dictionaries({"prompt": prompts, "max_tokens": st.one_of(st.integers(1, 6), values)},
                                 optional={f: values for f in fields if f not in ("prompt", "max_tokens")})

    @settings(max_examples=40, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(path=st.sampled_from(["/v1/completions", "/v1/chat/completions", "/tokenize"]), body=body)
    def check(path, body):
        data = json.dumps(body, allow_nan=True)
        r = served.post(path, data, raw=True)
        assert r.status_code < 500, (path, data, r.status_code, r.text)
    check()
    assert_serving(served)
    del hypothesis
