"""Time GPU calls as the engine's decode runs them: captured in one CUDA graph, replayed, timed
with CUDA events. The per-call time is the graph's time over the number of calls, launch gaps
included (a decode step's kernels are back to back in a graph, so those gaps are part of it)."""
from __future__ import annotations

import torch

__all__ = ["REPS", "graph_time_us"]

# Copies of a case's weights / caches, one per call of a graph: a 48-layer model reads a layer's
# bytes once per step, so a call must not find the previous call's bytes in L2.
REPS = 24


def graph_time_us(fns) -> float:
    """Median microseconds per call of `fns`, run in order inside one CUDA graph (10 replays)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in fns:
            f()
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(10):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / len(fns))
    times.sort()
    return times[len(times) // 2]
