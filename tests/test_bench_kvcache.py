"""The kvcache benchmark runs, reads and writes traces, and rejects bad ones (not a timing test)."""
from __future__ import annotations

import json
from collections import Counter

import pytest

from launch.bench.kvcache import (generated_trace, layout_plan, load_trace, make_multi_turn_trace, make_trace,
                                   save_trace, simulate)
from launch.cli import main


def test_generated_trace_shape():
    trace = make_trace(seed=3, num_requests=200)
    assert len(trace) == 200
    top = [t for t in trace if t.parent is None]
    assert all(t.prompt[:1000] == top[0].prompt[:1000] for t in top)
    assert all(1064 <= len(t.prompt) <= 2536 and 16 <= len(t.output) <= 512 for t in top)
    by_id = {t.id: t for t in trace}
    for t in trace:
        if t.parent is not None:
            p = by_id[t.parent]
            assert t.prompt[:len(p.prompt) + len(p.output)] == p.prompt + p.output
            assert 1 <= t.think_steps <= 20
    assert 0.2 < sum(t.parent is not None for t in trace) / 200 < 0.4


def test_multi_turn_trace_shape():
    trace = make_multi_turn_trace(seed=3, num_requests=200)
    assert len(trace) == 200 and [t.id for t in trace] == list(range(200))
    assert [t.prompt for t in make_multi_turn_trace(seed=3, num_requests=200)] == [t.prompt for t in trace]
    assert [t.prompt for t in make_multi_turn_trace(seed=4, num_requests=200)] != [t.prompt for t in trace]
    by_id = {t.id: t for t in trace}
    firsts = [t for t in trace if t.parent is None]
    assert all(t.prompt[:1000] == firsts[0].prompt[:1000] and 1064 <= len(t.prompt) <= 2536 for t in firsts)
    conversation: dict[int, int] = {}  # request -> its conversation's first request
    for t in trace:
        conversation[t.id] = t.id if t.parent is None else conversation[t.parent]
        assert 16 <= len(t.output) <= 512
        if t.parent is None:
            continue
        # The previous turn, its answer, a new question; queued after the previous turn ends.
        p = by_id[t.parent]
        assert t.parent == t.id - 1 and t.arrival_step is None and 1 <= t.think_steps <= 20
        assert t.prompt[:len(p.prompt) + len(p.output)] == p.prompt + p.output
        assert 16 <= len(t.prompt) - len(p.prompt) - len(p.output) <= 512
    turns = Counter(conversation.values())
    last = conversation[trace[-1].id]
    assert all(2 <= n <= 8 for first, n in turns.items() if first != last) and turns[last] <= 8
    # Conversations start about 4 steps apart: dozens are under way at once.
    starts = [t.arrival_step for t in firsts]
    assert starts == sorted(starts) and 2 < (starts[-1] - starts[0]) / (len(starts) - 1) < 8


def test_multi_turn_follow_ups_hit_the_whole_conversation_so_far():
    trace = make_multi_turn_trace(seed=5, num_requests=60)
    res = simulate(layout_plan("full"), 20000, trace, "full", time_calls=False)
    assert res.finished == 60 and res.preemptions == 0
    by_id = {t.id: t for t in trace}
    # A turn arrives after the previous one finished: its prompt and answer (the last answer
    # token was sampled, never computed) are cached in full blocks of 16.
    so_far = sum((len(by_id[t.parent].prompt) + len(by_id[t.parent].output) - 1) // 16 * 16
                 for t in trace if t.parent is not None)
    firsts = sum(1 for t in trace if t.parent is None)
    assert so_far + (firsts - 1) * 992 <= res.hit_tokens <= so_far + firsts * 992


@pytest.mark.parametrize("kind, num_requests, message", [("chat", 10, "unknown trace kind"),
                                                         ("multi-turn", 0, "at least 1 request")])
def test_bad_generated_trace_is_rejected(kind, num_requests, message):
    with pytest.raises(ValueError, match=message):
        generated_trace(kind, 0, num_requests)


def test_trace_kind_cannot_go_with_a_trace_file(tmp_path, capsys):
    path = tmp_path / "trace.json"
    save_trace(make_trace(seed=4, num_requests=3), str(path))
    assert main(["bench", "kvcache", "--trace", str(path), "--trace-kind", "multi-turn", "--layout", "full"]) == 2
    assert "--trace-kind" in capsys.readouterr().err


def test_simulation_hits_the_shared_prompt_and_leaks_nothing():
    trace = make_trace(seed=1, num_requests=40)
    # A Gemma-3-27B prefill briefly holds every window block: ~1,600 blocks of 5 slots.
    for layout, num_blocks in (("full", 3000), ("gemma-3-27b", 20000)):
        res = simulate(layout_plan(layout), num_blocks, trace, layout, time_calls=True)
        assert res.finished == 40
        # Every request after the first shares the 1000-token system prompt (62 full blocks).
        assert res.hit_tokens >= 39 * 992 * 0.9
        assert res.hit_tokens <= res.prompt_tokens


def test_bamba_layout_hits_finer_than_the_528_token_rule(capsys):
    """Same memory, same trace: Bamba-9B in blocks of 176 tokens (a state spans a block's 3 pages)
    against vLLM's 528-token blocks with a state at every block end."""
    assert main(["bench", "kvcache", "--layout", "bamba-9b", "--requests", "40", "--memory-gib", "20", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    ours, rule = out["bamba-9b"], out["vllm-layout:bamba-9b"]
    assert (ours["block_size"], rule["block_size"]) == (176, 528)
    assert abs(ours["pool_gib"] - 20) < 0.02 and abs(rule["pool_gib"] - 20) < 0.02
    # The 1000-token system prompt: 528 tokens of it hit under the rule; 880 in 176-token blocks
    # from the third sharer on (the second keeps the state where its prompt leaves the cache).
    assert rule["hit_tokens"] >= 39 * 528 * 0.9
    assert ours["hit_tokens"] >= 38 * 880 * 0.9 and ours["hit_tokens"] > rule["hit_tokens"]


@pytest.mark.parametrize("layout, blocks", [("qwen3.6-35b-a3b", (112, 1056)), ("qwen3.6-27b", (64, 784)),
                                            ("qwen3-next-80b-a3b", (96, 1056))])
@pytest.mark.parametrize("kind", ["shared-prompt", "multi-turn"])
def test_deltanet_layouts_hit_finer_than_vllms_layout(capsys, layout, blocks, kind):
    """Same memory, same trace: a Gated DeltaNet hybrid in our blocks against vLLM's layout, one
    page per state, with a state at every block end."""
    assert main(["bench", "kvcache", "--layout", layout, "--trace-kind", kind, "--requests", "30",
                 "--memory-gib", "20", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    ours, rule = out[layout], out["vllm-layout:" + layout]
    assert (ours["block_size"], rule["block_size"]) == blocks
    # The same 20 GiB, to within one block (vLLM's block of Qwen3.6-27B is 0.05 GiB).
    assert abs(ours["pool_gib"] - 20) < 0.06 and abs(rule["pool_gib"] - 20) < 0.06
    assert ours["prompt_tokens"] == rule["prompt_tokens"]
    if kind == "shared-prompt":
        # The 1000-token system prompt fills at most one block of vLLM's layout (784 tokens of
        # Qwen3.6-27B's, none of 1056); ours hits it in whole blocks from the third sharer on
        # (the second keeps the state where its prompt leaves the cache).
        sys_hit = 1000 // blocks[0] * blocks[0]
        assert ours["hit_tokens"] >= 27 * sys_hit and ours["hit_tokens"] > rule["hit_tokens"]
    else:
        # A turn resumes the conversation so far, in vLLM's large blocks too.
        assert rule["hit_tokens"] > 0 and ours["hit_tokens"] > 1.1 * rule["hit_tokens"]


def test_small_pool_preempts_and_still_finishes():
    trace = make_trace(seed=2, num_requests=30)
    res = simulate(layout_plan("full"), 700, trace, "full", time_calls=False)
    assert res.finished == 30 and res.preemptions > 0


def test_trace_file_round_trip_and_json_output(tmp_path, capsys):
    path = tmp_path / "trace.json"
    save_trace(make_trace(seed=4, num_requests=12), str(path))
    assert [t.prompt for t in load_trace(str(path))] == [t.prompt for t in make_trace(seed=4, num_requests=12)]
    assert main(["bench", "kvcache", "--trace", str(path), "--layout", "full", "--num-blocks", "2000", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)["full"]
    for key in ("prompt_tokens", "hit_tokens", "peak_blocks", "preemptions", "us_per_allocate_prompt",
                "us_per_allocate_decode", "us_per_step"):
        assert key in out


@pytest.mark.parametrize("content, message", [
    ('{"id": 1}', "JSON list"),
    ('[{"id": 1, "prompt": [1]}]', "lacks output"),
    ('[{"id": 1, "prompt": [1], "output": [2], "parent": 7}]', "parent 7"),
    ('[{"id": 1, "prompt": [1], "output": [2]}]', "neither arrival_step nor parent"),
])
def test_bad_trace_is_rejected(tmp_path, content, message):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=message):
        load_trace(str(path))


def test_vllm_reference_runs_a_deltanet_hybrid(capsys):
    """vLLM's own manager on Qwen3.6-35B-A3B (needs vLLM: launch/bench/vllm_reference.py)."""
    pytest.importorskip("vllm.v1.core.kv_cache_manager")
    from distengine.request import Request
    from launch.bench.vllm_reference import make_vllm_manager

    mgr = make_vllm_manager(layout_plan("qwen3.6-35b-a3b"), 400)
    assert (mgr.block_size, mgr.num_groups, mgr.group_size) == (1088, 4, 10)

    def serve(rid: str, prompt: list[int]) -> int:
        mgr.new_step_starts()
        req = Request(rid, prompt)
        blocks, hit = mgr.get_computed_blocks(req)
        assert mgr.allocate_slots(req, req.num_tokens - hit, hit, blocks) is not None
        req.num_computed_tokens = req.num_tokens
        mgr.free(req)
        return hit

    prompt = list(range(5000))
    # vLLM keeps a's state only at its prompt's last block boundary (4352): b, sharing 2500
    # tokens, hits nothing but has its prefill cut at the 2176-token junction, whose state c hits.
    assert [serve("a", prompt), serve("b", prompt[:2500] + [7] * 100), serve("c", prompt[:2500] + [8] * 100),
            serve("d", prompt + [9] * 100)] == [0, 0, 2176, 4352]
    assert mgr.num_free_blocks == 399
    assert main(["bench", "kvcache", "--layout", "qwen3.6-35b-a3b", "--trace-kind", "multi-turn", "--requests", "20",
                 "--memory-gib", "20", "--reference", "vllm", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    ref = out["vllm:qwen3.6-35b-a3b"]
    assert ref["block_size"] == 1088 and abs(ref["pool_gib"] - 20) < 0.03
    assert 0 < ref["hit_tokens"] < out["qwen3.6-35b-a3b"]["hit_tokens"]
