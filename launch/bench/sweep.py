"""`distengine bench sweep SWEEP_FILE [--out DIR] [--ray-address ADDR] [--resume]`: a grid of
benchmark points, scheduled by Ray across the cluster's GPUs (or CPUs).

The sweep file (JSON or YAML) names a `model`, a `kind` (latency, throughput or serve), an optional
`device` (auto, cuda, cpu), a `grid` (a parameter to a list of values) and fixed parameters beside
it; every combination of the grid is a point. Each point runs the matching bench command's code in
a Ray task on its own placement group: one small CPU bundle for the task and `tensor_parallel_size`
device bundles for the engine's workers, which the engine finds and uses. All the groups are asked
for at once and Ray grants them as devices free up, so points run in parallel as far as the cluster
allows. A point that needs more devices than the cluster has is reported and skipped; a point that
fails is recorded with its error and the sweep goes on. Every result is appended to
DIR/results.jsonl as it comes (`--resume` skips the points already there); at the end DIR gets
results.md (a table; `per GPU vs TP=1` compares a point's throughput per device with the same
point at TP=1) and PNG plots.
"""
from __future__ import annotations

import itertools
import json
import os

KINDS = ("latency", "throughput", "serve")
ENGINE = {"tensor_parallel_size", "dtype", "max_model_len", "gpu_memory_utilization", "max_num_seqs",
          "max_num_batched_tokens", "enforce_eager", "enable_prefix_caching", "load_format", "seed",
          "custom_all_reduce", "async_scheduling", "kv_cache_dtype"}
PARAMS = {"latency": ENGINE | {"batch_size", "input_len", "output_len", "num_iters", "num_iters_warmup"},
          "throughput": ENGINE | {"num_prompts", "input_len", "output_len", "dataset_path"},
          "serve": ENGINE | {"num_prompts", "input_len", "output_len", "prefix_len", "request_rate", "max_concurrency",
                             "ignore_eos"}}
TOP = {"model", "kind", "device", "grid"}


def add_arguments(p) -> None:
    p.add_argument("sweep_file", help="JSON or YAML: model, kind, device, grid, and fixed parameters")
    p.add_argument("--out", default="sweep-results", help="folder for results.jsonl, results.md and the plots")
    p.add_argument("--ray-address", default=None, help="an existing Ray cluster (default: $RAY_ADDRESS, else local)")
    p.add_argument("--resume", action="store_true", help="skip the points already in --out")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


# ---- the sweep file ----------------------------------------------------------------------------
def load_sweep(path: str) -> dict:
    with open(path) as f:
        text = f.read()
    if path.endswith((".yaml", ".yml")):
        import yaml
        spec = yaml.safe_load(text)
    else:
        spec = json.loads(text)
    if not isinstance(spec, dict):
        raise ValueError(f"{path}: a sweep file is a mapping (model, kind, grid, ...)")
    for key in ("model", "kind", "grid"):
        if key not in spec:
            raise ValueError(f"{path}: '{key}' is missing")
    if spec["kind"] not in KINDS:
        raise ValueError(f"{path}: kind must be one of {KINDS}, got {spec['kind']!r}")
    if spec.get("device", "auto") not in ("auto", "cuda", "cpu"):
        raise ValueError(f"{path}: device must be auto, cuda or cpu, got {spec['device']!r}")
    grid = spec["grid"]
    if not isinstance(grid, dict) or not grid or not all(isinstance(v, list) and v for v in grid.values()):
        raise ValueError(f"{path}: grid maps parameter names to non-empty lists of values")
    allowed = PARAMS[spec["kind"]]
    fixed = {k: v for k, v in spec.items() if k not in TOP}
    unknown = sorted((set(grid) | set(fixed)) - allowed)
    if unknown:
        raise ValueError(f"{path}: unknown parameter(s) {unknown} for kind {spec['kind']}; known: {sorted(allowed)}")
    both = sorted(set(grid) & set(fixed))
    if both:
        raise ValueError(f"{path}: {both} both fixed and in the grid")
    return {"model": str(spec["model"]), "kind": spec["kind"], "device": spec.get("device", "auto"), "grid": grid,
            "fixed": fixed}


def points(spec: dict) -> list[dict]:
    names = list(spec["grid"])
    return [{**spec["fixed"], **dict(zip(names, combo))} for combo in itertools.product(*spec["grid"].values())]


def point_key(point: dict) -> str:
    return json.dumps(point, sort_keys=True)


# ---- one point, in its Ray task ----------------------------------------------------------------
def _bench_args(kind: str, model: str, device: str, point: dict, out_json: str):
    import argparse

    from launch.bench import latency, throughput
    module = latency if kind == "latency" else throughput
    p = argparse.ArgumentParser()
    module.add_arguments(p)
    args = p.parse_args(["--model", model, "--device", device, "--output-json", out_json])
    for name, value in point.items():
        if name == "batch_size":
            args.batch_size = [value]
        elif name == "enable_prefix_caching":
            args.no_enable_prefix_caching = not value
        elif name == "async_scheduling":
            args.no_async_scheduling = not value
        else:
            setattr(args, name, value)
    args.distributed_executor_backend = "ray"  # the workers go on this task's placement group
    return module, args


def _figures(kind: str, res: dict) -> dict:
    if kind == "latency":
        r = res["results"][0]
        return {"output_tok_s": r["output_tok_s"], "avg_latency_s": r["avg_latency"],
                "decode_step_ms": r["decode_step_s"] * 1e3, "decode_tok_s": r["decode_tok_s"],
                "roofline_output_tok_s": r["roofline_output_tok_s"]}
    if kind == "throughput":
        return {"output_tok_s": res["output_tok_s"], "requests_per_s": res["requests_per_second"],
                "roofline_output_tok_s": res["roofline_output_tok_s"]}
    return {"output_tok_s": res["output_throughput"], "requests_per_s": res["request_throughput"],
            "ttft_p50_ms": res["ttft_ms"]["median"], "ttft_p99_ms": res["ttft_ms"]["p99"],
            "itl_p50_ms": res["itl_ms"]["median"], "itl_p99_ms": res["itl_ms"]["p99"],
            "tpot_mean_ms": res["tpot_ms"]["mean"], "failed": res["failed"]}


def _serve_point(model: str, device: str, point: dict) -> dict:
    """A server in this task (uvicorn in a thread) and `bench serve` against it."""
    import argparse
    import asyncio
    import socket
    import threading
    import time

    import uvicorn

    from distengine.async_llm import AsyncLLM
    from launch.bench import serve as bench_serve
    from launch.serve import build_app
    engine_kw = {k: point[k] for k in ENGINE & set(point) if k not in ("enable_prefix_caching", "async_scheduling",
                                                                     "custom_all_reduce")}
    # The engine loop stays in this task's process: its workers go on the task's placement group.
    engine = AsyncLLM(model, device=device, distributed_executor_backend="ray", engine_process=False,
                      enable_prefix_caching=point.get("enable_prefix_caching", True),
                      async_scheduling=point.get("async_scheduling", True),
                      disable_custom_all_reduce=not point.get("custom_all_reduce", False), **engine_kw)
    try:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        server = uvicorn.Server(uvicorn.Config(build_app(engine, ["model"]), host="127.0.0.1", port=port,
                                               log_level="warning"))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        while not server.started:
            time.sleep(0.05)
        p = argparse.ArgumentParser()
        bench_serve.add_arguments(p)
        args = p.parse_args(["--no-progress", "--model", "model"])
        renames = {"input_len": "random_input_len", "output_len": "random_output_len", "prefix_len": "random_prefix_len"}
        for name in ("num_prompts", "input_len", "output_len", "prefix_len", "request_rate", "max_concurrency",
                     "ignore_eos", "seed"):
            if name in point:
                setattr(args, renames.get(name, name), point[name])
        args.random_vocab_size = min(args.random_vocab_size, engine.info.vocab_size)
        res = asyncio.run(bench_serve._benchmark(args, f"http://127.0.0.1:{port}"))
        server.should_exit = True
        thread.join(timeout=30)
        res["device"] = engine.info.devices[0].name
        return res
    finally:
        engine.shutdown()


def run_point(kind: str, model: str, device: str, point: dict) -> dict:
    """The body of a point's Ray task: its figures and where they were measured."""
    import platform
    import tempfile
    import time

    import ray
    import torch
    import triton

    import distengine
    t0 = time.perf_counter()
    if kind == "serve":
        res = _serve_point(model, device, point)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "res.json")
            module, args = _bench_args(kind, model, device, point, out)
            module.run(args)
            with open(out) as f:
                res = json.load(f)
    return {"figures": _figures(kind, res), "device_name": res["device"],
            "devices": int(point.get("tensor_parallel_size", 1)),
            "versions": {"distengine": distengine.__version__, "torch": torch.__version__,
                         "triton": triton.__version__, "ray": ray.__version__},
            "node": f"{platform.node()} ({ray.get_runtime_context().get_node_id()[:12]})",
            "seconds": time.perf_counter() - t0}


# ---- the driver --------------------------------------------------------------------------------
def run(args) -> int:
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from distengine.executor import PROJECT_ROOT
    spec = load_sweep(args.sweep_file)
    todo = points(spec)
    os.makedirs(args.out, exist_ok=True)
    results_path = os.path.join(args.out, "results.jsonl")
    done: dict[str, dict] = {}
    if os.path.exists(results_path):
        if not args.resume:
            raise ValueError(f"{results_path} exists: give --resume to go on with it, or another --out")
        with open(results_path) as f:
            for line in f:
                if line.strip():
                    rec = json.loads(line)
                    done[point_key(rec["point"])] = rec
    pending = [p for p in todo if point_key(p) not in done]
    print(f"bench sweep: {len(todo)} points of {spec['kind']} on {spec['model']}"
          + (f"; {len(todo) - len(pending)} already in {args.out}, skipped" if done else ""), flush=True)

    started_ray = False
    if not ray.is_initialized():
        address = args.ray_address or os.environ.get("RAY_ADDRESS")
        import logging
        level = logging.INFO if os.environ.get("DISTENGINE_VERBOSE") else logging.ERROR
        logging.getLogger("ray").setLevel(level)
        ray.init(address=address, include_dashboard=False, logging_level=level,
                 log_to_driver=bool(os.environ.get("DISTENGINE_VERBOSE")))
        started_ray = True
    try:
        total = ray.cluster_resources()
        device = spec["device"]
        if device == "auto":
            device = "cuda" if total.get("GPU", 0) >= 1 else "cpu"
        kind = "GPU" if device == "cuda" else "CPU"
        driver_cpus = 1.0 if kind == "GPU" else 0.1
        env = {"PYTHONPATH": os.pathsep.join(p for p in (PROJECT_ROOT, os.environ.get("PYTHONPATH")) if p),
               "NCCL_NVLS_ENABLE": os.environ.get("NCCL_NVLS_ENABLE", "0"),
               "TORCH_SYMM_MEM_DISABLE_MULTICAST": os.environ.get("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")}
        for var in ("TRITON_INTERPRET", "HF_HOME", "HF_HUB_OFFLINE", "DISTENGINE_VERBOSE", "VLLM_CPU_KVCACHE_SPACE"):
            if var in os.environ:
                env[var] = os.environ[var]
        task = ray.remote(num_cpus=driver_cpus)(run_point)
        running = {}
        with open(results_path, "a") as out:
            def record(point: dict, status: str, **extra) -> None:
                rec = {"point": point, "kind": spec["kind"], "model": spec["model"], "status": status, **extra}
                out.write(json.dumps(rec) + "\n")
                out.flush()
                done[point_key(point)] = rec

            for p in pending:
                tp = int(p.get("tensor_parallel_size", 1))
                need = {kind: tp + (driver_cpus if kind == "CPU" else 0)}
                if kind == "GPU":
                    need["CPU"] = driver_cpus
                short = [f"{k}: asks for {v:g}, the cluster has {total.get(k, 0):g}" for k, v in need.items()
                         if v > total.get(k, 0)]
                if short:
                    message = f"skipped: needs more than the cluster has ({'; '.join(short)})"
                    print(f"point {p}: {message}", flush=True)
                    record(p, "skipped", error=message)
                    continue
                bundles = [{"CPU": driver_cpus}] + [{kind: 1}] * tp
                pg = placement_group(bundles, strategy="PACK")
                ref = task.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
                    pg, placement_group_bundle_index=0, placement_group_capture_child_tasks=True),
                    runtime_env={"env_vars": env}).remote(spec["kind"], spec["model"], device, p)
                running[ref] = (p, pg)
            bar = None
            if not args.no_progress and running:
                from tqdm.auto import tqdm
                bar = tqdm(total=len(running), desc="points", dynamic_ncols=True)
            while running:
                ready, _ = ray.wait(list(running), num_returns=1)
                p, pg = running.pop(ready[0])
                try:
                    res = ray.get(ready[0])
                    record(p, "ok", **res)
                except Exception as e:  # noqa: BLE001 - a failed point is recorded; the sweep goes on
                    lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
                    record(p, "failed", error=(lines[-1] if lines else type(e).__name__)[:600])
                finally:
                    remove_placement_group(pg)
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix_str(f"last: {p}"[:60])
            if bar is not None:
                bar.close()
    finally:
        if started_ray:
            ray.shutdown()
    ordered = [done[point_key(p)] for p in todo if point_key(p) in done]
    from launch.bench.sweep_report import write_report
    table = write_report(ordered, spec, args.out)
    print(table)
    failed = sum(r["status"] == "failed" for r in ordered)
    print(f"\n{len(ordered)} points in {args.out}: {sum(r['status'] == 'ok' for r in ordered)} ok, {failed} failed, "
          f"{sum(r['status'] == 'skipped' for r in ordered)} skipped")
    return 0
