"""All-reduce latency at decode sizes on the GPUs of one host, each replayed in a CUDA graph as the
decode graphs run them: NCCL, torch symmetric memory's one-shot kernel, and ours
(`kernels/allreduce.py`, peer-to-peer loads, no multicast); then what a decoder layer does after
its attention: NCCL followed by Gemma's two norm kernels (the second with the residual add),
against our kernel with both norms fused (`nvlink_norms`).

    python -m launch.bench.allreduce [--world-size 2] [--hidden 3840] [--batches 1 8 32 128 256]

NVLink multicast stays off (NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1). Prints one
row per size: microseconds per all-reduce (median of graph replays of 64 back-to-back calls).
"""
from __future__ import annotations

import argparse
import json
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

METHODS = ("nccl", "symm_one_shot", "nvlink", "nccl_norms", "nvlink_norms")


def _time_graph(fn, reps: int = 64, iters: int = 20) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        dist.barrier()
        s.record()
        g.replay()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e) * 1e3 / reps)
    return sorted(times)[len(times) // 2]


def _worker(rank: int, world: int, port: int, hidden: int, batches: list[int], out_path: str) -> None:
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            device_id=torch.device("cuda", rank))
    group = dist.group.WORLD.group_name
    device = torch.device("cuda", rank)
    rows = []
    symm = ours = None
    try:
        import torch.distributed._symmetric_memory as symm_mem

        from workers.parallel import NVLinkAllReduce
        if hasattr(symm_mem, "enable_symm_mem_for_group"):
            symm_mem.enable_symm_mem_for_group(group)
        n_max = max(batches) * hidden
        symm = symm_mem.empty(n_max, dtype=torch.bfloat16, device=device)
        symm_mem.rendezvous(symm, group)
        ours = NVLinkAllReduce(device, torch.bfloat16, n_max * 2)
    except Exception as e:  # noqa: BLE001 - report, keep NCCL's figures
        rows.append({"error": f"symmetric memory unavailable: {type(e).__name__}: {e}"})
    from kernels.allreduce import all_reduce_rows_ref
    from kernels.layernorm import rms_norm
    w = (1 + 0.1 * torch.randn(hidden, device=device)).to(torch.bfloat16)
    for b in batches:
        n = b * hidden
        x = torch.randn(n, dtype=torch.bfloat16, device=device)
        res = torch.randn(b, hidden, dtype=torch.bfloat16, device=device)
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x)
        want = torch.stack(parts).float().sum(0)
        want_norms = all_reduce_rows_ref([p.view(b, hidden) for p in parts], res, w, w, 1e-6, True)[0].float()
        row = {"batch": b, "bytes": n * 2}
        for method in METHODS:
            try:
                ref = want_norms if method.endswith("_norms") else want
                if method == "nccl":
                    y = x.clone()
                    dist.all_reduce(y)
                    got = y
                    fn = lambda: dist.all_reduce(y)  # noqa: E731
                elif method == "nccl_norms":
                    y = x.clone()

                    def fn():
                        dist.all_reduce(y)
                        return rms_norm(rms_norm(y.view(b, hidden), w, 1e-6, gemma=True), w, 1e-6, res,
                                        gemma=True)[0]
                    got = fn()
                elif symm is None:
                    continue
                elif method == "symm_one_shot":
                    buf = symm[:n]
                    buf.copy_(x)
                    fn = lambda: torch.ops.symm_mem.one_shot_all_reduce(buf, "sum", group)  # noqa: E731
                    got = fn()
                else:
                    buf = ours.buffer_for(b, hidden, torch.bfloat16, device)
                    buf.copy_(x.view(b, hidden))
                    if method == "nvlink":
                        fn = lambda: ours(buf)  # noqa: E731
                    else:
                        fn = lambda: ours.reduce_norm(buf, res, w, 1e-6, True, w)[0]  # noqa: E731
                    got = fn()
                err = float((got.float().reshape(ref.shape) - ref).abs().max() / ref.abs().max())
                # In the graph NCCL reduces its buffer over and over: only the timing counts there.
                row[method] = _time_graph(fn)
                row[method + "_rel_err"] = err
            except Exception as e:  # noqa: BLE001
                row[method] = f"{type(e).__name__}: {str(e)[:120]}"
        rows.append(row)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(rows, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--hidden", type=int, default=3840)
    # Decode sizes, then one 8,192-token prefill step's (where NCCL's bandwidth is what counts).
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 128, 256, 1024, 8192])
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "allreduce.json"))
    args = p.parse_args()
    if torch.cuda.device_count() < args.world_size:
        raise SystemExit(f"needs {args.world_size} GPUs, sees {torch.cuda.device_count()}")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(args.world_size, port, args.hidden, args.batches, args.out), nprocs=args.world_size)
    with open(args.out) as f:
        rows = json.load(f)
    print(f"all-reduce, {args.world_size} x {torch.cuda.get_device_name(0)}, bf16, hidden {args.hidden}: "
          "us per call in a CUDA graph (relative error)")
    for r in rows:
        if "error" in r:
            print(r["error"])
            continue
        cells = []
        for m in METHODS:
            v = r.get(m)
            cells.append(f"{m} {v:7.1f} ({r[m + '_rel_err']:.0e})" if isinstance(v, float) else f"{m} {v}")
        print(f"B={r['batch']:5d} {r['bytes'] / 1024:8.1f} KiB  " + "  ".join(cells))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
