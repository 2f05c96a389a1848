"""`distengine bench kvcache`: drive the KV cache manager the way the scheduler does.

FCFS admission while blocks last, whole prompts in one step, one decode token per running
request per step, at most 256 running; on a shortage the newest running request is preempted
(its blocks freed) and requeued at the front. Prefix-cache hits are counted at a request's first
admission (a preempted request finding its own blocks again is not a hit of the trace).

Two generated traces (`--trace-kind`, both seeded; `--trace` reads one from a file instead):
- shared-prompt (the default): a shared 1000-token system prompt plus a unique question, 30%
  follow-ups of an earlier request (see `make_trace`);
- multi-turn: conversations of 2-8 turns, each turn's prompt the previous turn's prompt plus its
  answer plus a new question, queued a few steps after the previous turn finished; the first turn
  starts with the same shared system prompt; many conversations run interleaved (see
  `make_multi_turn_trace`). A hit there is mostly the conversation so far, which a hybrid model
  can only resume where a recurrent state was kept.

The pool is sized in memory: `--num-blocks N` is N blocks of vLLM's layout of the model (its
group size, and for a Mamba hybrid its one-page state); our layout gets the same bytes
(`--memory-gib` gives the bytes directly).

A hybrid of attention and recurrent-state layers (`--layout bamba-9b`, a Mamba2 hybrid; the
Gated DeltaNet hybrids `qwen3.6-35b-a3b`, `qwen3.6-27b`, `qwen3-next-80b-a3b`) is also run
through our manager with vLLM's layout: one page holds a state, so blocks are large (Bamba-9B:
528 tokens against our 176; the DeltaNet hybrids: 784-1056 against our 64-112), and a state is
kept at every block end, as vLLM keeps them with dense retention
(`prefix_cache_retention_interval=None`). The hit tokens against that rule show what the finer
layout buys. vLLM's default keeps states only where a later request can resume; `--reference
vllm` drives vLLM's own manager so (`vllm_reference`). When the pool is short, that can hit more
than the dense rule, whose states crowd the cache.
"""
from __future__ import annotations

import gc
import json
import random
import time
from collections import deque
from dataclasses import dataclass, field

from distengine.kv_cache.manager import KVCacheManager
from distengine.model_config import load_config_dict, parse_model_config
from distengine.kv_cache.plan import GIB, KVCachePlan, make_plan, vllm_plan
from distengine.request import Request

LAYOUTS = {"full": "llama-3-8b", "gemma-3-27b": "gemma-3-27b", "bamba-9b": "bamba-9b",
           "qwen3.6-35b-a3b": "qwen3.6-35b-a3b", "qwen3.6-27b": "qwen3.6-27b",
           "qwen3-next-80b-a3b": "qwen3-next-80b-a3b"}
TRACE_KINDS = ("shared-prompt", "multi-turn")
VLLM_LAYOUT = "vllm-layout:"  # prefix of a result of our manager on vLLM's layout (Mamba hybrids)
MAX_RUNNING = 256


@dataclass
class TraceRequest:
    id: int
    arrival_step: int | None  # None for a follow-up: it arrives think_steps after its parent ends
    parent: int | None
    think_steps: int
    prompt: list[int]
    output: list[int]


def make_trace(seed: int = 0, num_requests: int = 600, vocab: int = 32000) -> list[TraceRequest]:
    """A shared 1000-token system prompt plus a unique 64-1536-token suffix, 16-512 output
    tokens; 30% multi-turn follow-ups (an earlier request's prompt + output + 16-256 new tokens,
    queued 1-20 steps after it finished); exponential arrivals, mean gap 1 step."""
    rng = random.Random(seed)
    tokens = lambda n: [rng.randrange(vocab) for _ in range(n)]  # noqa: E731
    system = tokens(1000)
    trace: list[TraceRequest] = []
    t = 0.0
    for i in range(num_requests):
        output = tokens(rng.randint(16, 512))
        if trace and rng.random() < 0.3:
            parent = rng.choice(trace)
            trace.append(TraceRequest(i, None, parent.id, rng.randint(1, 20),
                                      parent.prompt + parent.output + tokens(rng.randint(16, 256)), output))
        else:
            t += rng.expovariate(1.0)
            trace.append(TraceRequest(i, int(t), None, 0, system + tokens(rng.randint(64, 1536)), output))
    return trace


def make_multi_turn_trace(seed: int = 0, num_requests: int = 600, vocab: int = 32000) -> list[TraceRequest]:
    """Conversations of 2-8 turns, `num_requests` turns in all (the last conversation cut short).
    The first turn is the shared 1000-token system prompt plus a 64-1536-token question; each
    later turn's prompt is the previous turn's prompt and answer plus a 16-512-token question,
    queued 1-20 steps after the previous turn finished. Answers are 16-512 tokens. Conversations
    start at exponential arrivals, mean gap 4 steps: a conversation lasts over a thousand steps,
    so about a hundred run interleaved."""
    rng = random.Random(seed)
    tokens = lambda n: [rng.randrange(vocab) for _ in range(n)]  # noqa: E731
    system = tokens(1000)
    trace: list[TraceRequest] = []
    t = 0.0
    while len(trace) < num_requests:
        t += rng.expovariate(1 / 4)
        turns = min(rng.randint(2, 8), num_requests - len(trace))
        first = len(trace)
        trace.append(TraceRequest(first, int(t), None, 0, system + tokens(rng.randint(64, 1536)),
                                  tokens(rng.randint(16, 512))))
        for i in range(first + 1, first + turns):
            prev = trace[-1]
            trace.append(TraceRequest(i, None, prev.id, rng.randint(1, 20),
                                      prev.prompt + prev.output + tokens(rng.randint(16, 512)),
                                      tokens(rng.randint(16, 512))))
    return trace


def generated_trace(kind: str, seed: int, num_requests: int) -> list[TraceRequest]:
    if kind not in TRACE_KINDS:
        raise ValueError(f"unknown trace kind {kind!r}; one of {', '.join(TRACE_KINDS)}")
    if num_requests < 1:
        raise ValueError(f"a generated trace needs at least 1 request, got {num_requests}")
    make = make_multi_turn_trace if kind == "multi-turn" else make_trace
    return make(seed, num_requests)


def load_trace(path: str) -> list[TraceRequest]:
    with open(path) as f:
        raw = json.load(f)
    if not isinstance(raw, list):
        raise ValueError(f"{path}: a trace is a JSON list of requests")
    out, ids = [], set()
    for i, r in enumerate(raw):
        missing = {"id", "prompt", "output"} - set(r)
        if missing:
            raise ValueError(f"{path}: request #{i} lacks {', '.join(sorted(missing))}")
        if not r["prompt"] or not r["output"]:
            raise ValueError(f"{path}: request {r['id']} has an empty prompt or output")
        parent = r.get("parent")
        if parent is not None and parent not in ids:
            raise ValueError(f"{path}: request {r['id']}'s parent {parent} does not come before it")
        if parent is None and r.get("arrival_step") is None:
            raise ValueError(f"{path}: request {r['id']} has neither arrival_step nor parent")
        ids.add(r["id"])
        out.append(TraceRequest(r["id"], r.get("arrival_step"), parent, int(r.get("think_steps") or 0),
                                list(r["prompt"]), list(r["output"])))
    return out


def save_trace(trace: list[TraceRequest], path: str) -> None:
    with open(path, "w") as f:
        json.dump([t.__dict__ for t in trace], f)


@dataclass
class SimResult:
    layout: str
    group_size: int
    num_groups: int
    num_blocks: int
    block_size: int
    block_bytes: int
    prompt_tokens: int = 0
    hit_tokens: int = 0
    peak_blocks: int = 0
    preemptions: int = 0
    steps: int = 0
    prompt_calls: int = 0
    decode_calls: int = 0
    prompt_ns: int = 0
    decode_ns: int = 0
    step_ns: int = 0
    finished: int = 0
    extra: dict = field(default_factory=dict)

    def summary(self) -> dict:
        return {
            "layout": self.layout, "group_size": self.group_size, "num_groups": self.num_groups,
            "num_blocks": self.num_blocks, "prompt_tokens": self.prompt_tokens, "hit_tokens": self.hit_tokens,
            "hit_rate": round(self.hit_tokens / max(self.prompt_tokens, 1), 4),
            "peak_blocks": self.peak_blocks, "preemptions": self.preemptions, "steps": self.steps,
            "us_per_allocate_prompt": round(self.prompt_ns / max(self.prompt_calls, 1) / 1e3, 3),
            "us_per_allocate_decode": round(self.decode_ns / max(self.decode_calls, 1) / 1e3, 3),
            "us_per_step": round(self.step_ns / max(self.steps, 1) / 1e3, 1),
        }


def simulate(plan: KVCachePlan, num_blocks: int, trace: list[TraceRequest], layout: str,
             time_calls: bool, make_manager=KVCacheManager) -> SimResult:
    """One pass over the trace. With `time_calls`, each allocate_slots call is timed; without,
    whole steps are (so the per-call timers do not inflate the step time).

    `make_manager(plan, num_blocks)` returns anything with KVCacheManager's methods used here
    (get_computed_blocks, allocate_slots, free, num_free_blocks, usage): ours, or a reference;
    one with a `new_step_starts()` is told when each step starts, as vLLM's scheduler tells its
    manager."""
    mgr = make_manager(plan, num_blocks)
    # A reference manager groups the layers its own way: take its figures where it has them.
    res = SimResult(layout, getattr(mgr, "group_size", plan.num_slots), mgr.num_groups, num_blocks,
                    getattr(mgr, "block_size", plan.block_size), getattr(mgr, "block_bytes", plan.block_bytes))
    new_step_starts = getattr(mgr, "new_step_starts", None)
    children: dict[int, list[TraceRequest]] = {}
    arrivals: dict[int, list[TraceRequest]] = {}
    for t in trace:
        if t.parent is None:
            arrivals.setdefault(t.arrival_step, []).append(t)
        else:
            children.setdefault(t.parent, []).append(t)
    reqs: dict[str, Request] = {}
    outputs: dict[str, list[int]] = {}
    first_admit: set[str] = set()
    waiting: deque[Request] = deque()
    running: list[Request] = []
    res.prompt_tokens = sum(len(t.prompt) for t in trace)
    remaining = len(trace)
    total_blocks = num_blocks - 1
    clock = time.perf_counter_ns
    step = 0
    max_steps = 10_000_000  # a trace whose requests can never fit would loop forever
    gc.collect()
    gc.freeze()
    while remaining:
        if step > max_steps:
            raise RuntimeError("simulation made no progress")
        for t in arrivals.pop(step, ()):
            r = Request(str(t.id), t.prompt)
            reqs[r.request_id], outputs[r.request_id] = r, t.output
            waiting.append(r)
        t_step = clock()
        if new_step_starts is not None:
            new_step_starts()
        # Decodes first, oldest first; preempt the newest on a shortage.
        i = 0
        while i < len(running):
            req = running[i]
            if time_calls:
                t0 = clock()
                new = mgr.allocate_slots(req, 1)
                res.decode_ns += clock() - t0
                res.decode_calls += 1
            else:
                new = mgr.allocate_slots(req, 1)
            if new is None:
                victim = running.pop()
                mgr.free(victim)
                victim.num_computed_tokens = 0
                waiting.appendleft(victim)
                res.preemptions += 1
                continue  # retry req (unless it was the victim: then the loop ends)
            i += 1
        # Admissions, FCFS, while blocks last.
        while waiting and len(running) < MAX_RUNNING:
            req = waiting[0]
            if time_calls:
                t0 = clock()
            blocks, hit = mgr.get_computed_blocks(req)
            new = mgr.allocate_slots(req, req.num_tokens - hit, hit, blocks)
            if time_calls:
                res.prompt_ns += clock() - t0
                res.prompt_calls += 1
            if new is None:
                break
            waiting.popleft()
            if req.request_id not in first_admit:
                first_admit.add(req.request_id)
                res.hit_tokens += hit
            req.num_computed_tokens = hit  # the step computes the rest below
            running.append(req)
        # The step ran: every scheduled request computed its tokens and sampled one more.
        used = total_blocks - mgr.num_free_blocks
        if used > res.peak_blocks:
            res.peak_blocks = used
        still = []
        for req in running:
            req.num_computed_tokens = req.num_tokens
            out = outputs[req.request_id]
            n_out = req.num_tokens - req.num_prompt_tokens
            req.append_output_token(out[n_out])  # sampled by this step
            if n_out + 1 < len(out):
                still.append(req)
                continue
            mgr.free(req)
            remaining -= 1
            res.finished += 1
            for child in children.get(int(req.request_id), ()):
                arrivals.setdefault(step + max(1, child.think_steps), []).append(child)
        running = still
        res.step_ns += clock() - t_step
        res.steps += 1
        step += 1
    gc.unfreeze()
    res.extra["usage_end"] = mgr.usage
    assert mgr.num_free_blocks == total_blocks, "blocks leaked"
    return res


def layout_plan(layout: str) -> KVCachePlan:
    """Our plan of a layout; "vllm-layout:NAME" is vLLM's layout of the same model."""
    vllm = layout.startswith(VLLM_LAYOUT)
    name, cfg = load_config_dict(LAYOUTS[layout.removeprefix(VLLM_LAYOUT)])
    plan = make_plan(parse_model_config(cfg, name))
    return vllm_plan(plan) if vllm else plan


def is_hybrid(layout: str) -> bool:
    return any(g.spec.kind == "mamba" for g in layout_plan(layout).groups)


def run_layout(layout: str, trace: list[TraceRequest], num_blocks_vllm: int, make_manager=KVCacheManager,
               memory_bytes: int | None = None, block_bytes: int | None = None) -> dict:
    """Both passes over the trace for one layout, in a pool of `num_blocks_vllm` blocks of vLLM's
    layout (or of `memory_bytes`), converted to blocks of `block_bytes` (default: the plan's; a
    reference manager's blocks may differ)."""
    plan = layout_plan(layout)
    pool_bytes = memory_bytes or num_blocks_vllm * vllm_plan(plan).block_bytes
    num_blocks = pool_bytes // (block_bytes or plan.block_bytes)
    timed_calls = simulate(plan, num_blocks, trace, layout, time_calls=True, make_manager=make_manager)
    timed_steps = simulate(plan, num_blocks, trace, layout, time_calls=False, make_manager=make_manager)
    a, b = timed_calls.summary(), timed_steps.summary()
    for key in ("hit_tokens", "peak_blocks", "preemptions", "steps"):
        assert a[key] == b[key], f"the two passes disagree on {key}: {a[key]} != {b[key]}"
    a["us_per_step"] = b["us_per_step"]
    a["pool_layer_pages"] = num_blocks * a["group_size"]
    a["block_size"] = timed_calls.block_size
    a["pool_gib"] = round(num_blocks * timed_calls.block_bytes / GIB, 2)
    return a


COLUMNS = ["prompt_tokens", "hit_tokens", "hit_rate", "peak_blocks", "preemptions",
           "us_per_allocate_prompt", "us_per_allocate_decode", "us_per_step"]
# Printed headers (the JSON keeps the names above): each distinct within its column's width.
LABELS = {"prompt_tokens": "prompt tok", "hit_tokens": "hit tok", "hit_rate": "hit rate", "peak_blocks": "peak blocks",
          "preemptions": "preemptions", "us_per_allocate_prompt": "us/alloc pr", "us_per_allocate_decode": "us/alloc dec",
          "us_per_step": "us/step"}


def run(args) -> int:
    if args.trace and args.trace_kind:
        raise ValueError("--trace-kind picks a generated trace: it cannot go with --trace")
    if args.reference == "vllm":  # a missing vLLM is said before our own runs, not after them
        from launch.bench.vllm_reference import import_vllm
        import_vllm()
    if args.trace:
        trace = load_trace(args.trace)
    else:
        trace = generated_trace(args.trace_kind or TRACE_KINDS[0], args.seed, args.requests)
    if args.save_trace:
        save_trace(trace, args.save_trace)
    layouts = [args.layout] if args.layout else list(LAYOUTS)
    memory = int(args.memory_gib * GIB) if args.memory_gib else None
    results = {layout: run_layout(layout, trace, args.num_blocks, memory_bytes=memory) for layout in layouts}
    for layout in layouts:
        if is_hybrid(layout):
            results[VLLM_LAYOUT + layout] = run_layout(VLLM_LAYOUT + layout, trace, args.num_blocks,
                                                       memory_bytes=memory)
    if args.reference == "vllm":
        from launch.bench.vllm_reference import make_vllm_manager, vllm_block_bytes
        for layout in layouts:
            # The same bytes in blocks of vLLM's own layout (for a hybrid, its block differs a
            # little from vllm_plan's: see vllm_reference).
            results[f"vllm:{layout}"] = run_layout(layout, trace, args.num_blocks, make_vllm_manager,
                                                   memory_bytes=memory,
                                                   block_bytes=vllm_block_bytes(layout_plan(layout)))
    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    follow_ups = sum(1 for t in trace if t.parent is not None)
    print(f"trace: {len(trace)} requests ({len(trace) - follow_ups} arriving on their own, {follow_ups} "
          f"follow-ups), {sum(len(t.prompt) for t in trace):,} prompt tokens")
    labels = {name: name if name.startswith("vllm:") else f"ours:{name}" for name in results}
    width = max(26, *(len(label) for label in labels.values()))
    print(f"{'manager:layout':{width}s} {'groups x slots':>14s} {'block':>6s} {'blocks':>7s} "
          + " ".join(f"{LABELS[c]:>12s}" for c in COLUMNS))
    for name, r in results.items():
        print(f"{labels[name]:{width}s} {r['num_groups']:6d} x {r['group_size']:5d} {r.get('block_size', ''):>6} "
              f"{r['num_blocks']:7d} " + " ".join(f"{r[c]:>12}" for c in COLUMNS))
    for layout in layouts:
        rule = results.get(VLLM_LAYOUT + layout)
        if rule:
            ours = results[layout]
            print(f"{layout}: {ours['hit_tokens']:,} hit tokens in blocks of {ours['block_size']} vs {rule['hit_tokens']:,} "
                  f"with vLLM's {rule['block_size']}-token blocks (a state every block): "
                  f"{ours['hit_tokens'] / max(rule['hit_tokens'], 1):.3f}x, same memory ({ours['pool_gib']} GiB)")
        ref = results.get(f"vllm:{layout}")
        if ref:
            ours = results[layout]
            print(f"{layout}: hit tokens {ours['hit_tokens'] / max(ref['hit_tokens'], 1):.3f}x vLLM's; "
                  f"decode allocate {ref['us_per_allocate_decode'] / ours['us_per_allocate_decode']:.1f}x "
                  f"faster; step {ref['us_per_step'] / ours['us_per_step']:.1f}x faster")
    return 0


def add_arguments(p) -> None:
    p.add_argument("--trace", help="JSON list of {id, arrival_step, parent, think_steps, prompt, output}")
    p.add_argument("--trace-kind", choices=TRACE_KINDS, default=None,
                   help="the generated trace (not with --trace; unset: shared-prompt). shared-prompt: a "
                        "shared 1000-token system prompt plus a unique question, 30%% follow-ups of an "
                        "earlier request; multi-turn: interleaved conversations of 2-8 turns, each turn's "
                        "prompt the previous turn's prompt, its answer and a new question, queued 1-20 "
                        "steps after the previous turn finished")
    p.add_argument("--layout", choices=sorted(LAYOUTS), default=None, help="default: every layout")
    p.add_argument("--num-blocks", type=int, default=20000,
                   help="pool size, in blocks of vLLM's layout of the model (same memory for ours)")
    p.add_argument("--memory-gib", type=float, default=None,
                   help="pool size in GiB instead (every layout gets it), e.g. 80 for Bamba-9B on an H200")
    p.add_argument("--requests", type=int, default=600, help="requests (turns) in the generated trace")
    p.add_argument("--seed", type=int, default=0, help="the generated trace's seed")
    p.add_argument("--save-trace", help="write the trace used as JSON")
    p.add_argument("--reference", choices=["vllm"], default=None,
                   help="also drive vLLM's own manager on the same trace (needs vllm installed: "
                        "launch/bench/vllm_reference.py says how)")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
