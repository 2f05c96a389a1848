"""Host time to prepare one decode step, at two context lengths: the scheduler's `schedule()`, the
step's msgpack round trip, the worker's persistent batch (`InputBatch.prepare`: the one staged
copy, the table appends, the new rows) and the sampler's batch flags. No model runs (the device
work of a step is not the host's); a real model's KV cache plan (Gemma-3-12B by default).

    python -m launch.bench.host [--config gemma-3-12b] [--batch 128] [--contexts 512 8192] [--steps 200]

The per-step host work must grow with the batch only: the two contexts should take the same time.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch


def measure(config: str, batch: int, context: int, steps: int, max_model_len: int) -> dict[str, float]:
    from distengine.model_config import load_config_dict, parse_model_config
    from distengine.kv_cache.plan import make_plan
    from distengine.sampling_params import SamplingParams
    from distengine.scheduler import EngineRequest, Scheduler
    from distengine.step import StepOutput, StepPlan
    from workers.input_batch import InputBatch

    name, cfg = load_config_dict(config)
    plan = make_plan(parse_model_config(cfg, name), 1, 16, max_model_len)
    vocab = int((cfg.get("text_config") or cfg).get("vocab_size", 32000))
    per_req = len(plan.groups) * -(-(context + steps + 2) // plan.block_size)  # a prefill holds every block
    sched = Scheduler(plan, batch * per_req + 16, max_num_seqs=batch, max_num_batched_tokens=batch * context,
                      enable_prefix_caching=True)
    ib = InputBatch(plan, batch, vocab, torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    for i in range(batch):
        sched.add_request(EngineRequest(str(i), torch.randint(0, vocab, (context,), generator=g).tolist(),
                                        sampling=SamplingParams(temperature=0.0, max_tokens=steps + 1,
                                                                ignore_eos=True)))
    parts: dict[str, list[float]] = {"schedule": [], "msgpack": [], "prepare": [], "update": []}
    for step in range(steps + 1):
        t0 = time.perf_counter()
        plan_ = sched.schedule()
        t1 = time.perf_counter()
        wire = StepPlan.decode(plan_.encode())
        t2 = time.perf_counter()
        for rid in wire.finished_req_ids:
            ib.remove(rid)
        for r in wire.new_requests:
            ib.add(r)
        inputs = ib.prepare(wire.scheduled, [batch])
        ib.sampling_tensors(inputs, None)
        t3 = time.perf_counter()
        tokens = [7] * len(inputs.sample_req_ids)
        ib.record_sampled(inputs, torch.tensor(tokens, dtype=torch.int64), False)
        sched.update(plan_.step_id, StepOutput(plan_.step_id, inputs.sample_req_ids, tokens))
        t4 = time.perf_counter()
        if step == 0:
            assert len(wire.scheduled) == batch, "the prefill did not fit in one step"
            continue  # the prefill
        assert inputs.graph_size == batch and inputs.num_tokens == batch
        for k, dt in zip(parts, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
            parts[k].append(dt)
    return {k: statistics.median(v) * 1e6 for k, v in parts.items()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="gemma-3-12b", help="a built-in config name or config.json (default: %(default)s)")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--contexts", type=int, nargs="+", default=[512, 8192])
    p.add_argument("--steps", type=int, default=200)
    args = p.parse_args()
    max_len = max(args.contexts) + args.steps + 16
    rows = {c: measure(args.config, args.batch, c, args.steps, max_len) for c in args.contexts}
    print(f"host time per decode step, batch {args.batch}, {args.config} plan, median of {args.steps} steps (us)")
    print(f"{'context':>8}  " + "  ".join(f"{k:>9}" for k in next(iter(rows.values()))) + "      total")
    for c, r in rows.items():
        print(f"{c:>8}  " + "  ".join(f"{v:9.1f}" for v in r.values()) + f"  {sum(r.values()):9.1f}")
    totals = [sum(r.values()) for r in rows.values()]
    print(f"longest / shortest context: {totals[-1] / totals[0]:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
