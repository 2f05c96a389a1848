"""CUDA graphs for decode steps: the whole forward (embedding, every layer's attention and MLP,
their all-reduces, the final norm) and the LM head, captured once per batch size.

A decode batch of n sequences runs in the graph of the smallest captured size >= n; the padded
entries use the persistent batch's padding row (context 0: they read and write nothing). The
graphs read their inputs from fixed device buffers (`InputBatch.decode_inputs`): the step's
rows, positions and context lengths, and the rows' last sampled tokens and block tables, so a
replay needs no host-side tensor at all. Graphs are captured largest first into one memory pool,
so together they hold about what the largest one needs. Every tensor-parallel rank captures the
same sizes in the same order (NCCL's collectives are captured with them) and replays the same
one each step, since every rank runs the same plan.
"""
from __future__ import annotations

import bisect
import gc
from collections.abc import Callable

import torch


class DecodeGraphs:
    def __init__(self, sizes: list[int] | tuple[int, ...], forward: Callable[[int], torch.Tensor],
                 device: torch.device) -> None:
        self.sizes = sorted(set(sizes))
        self.forward = forward
        self.device = device
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None

    @property
    def max_size(self) -> int:
        return self.sizes[-1]

    def size_for(self, n: int) -> int | None:
        i = bisect.bisect_left(self.sizes, n)
        return self.sizes[i] if i < len(self.sizes) else None

    def capture(self) -> None:
        """Warm up (Triton compiles, NCCL sets up its channels) and capture every size."""
        self.pool = torch.cuda.graph_pool_handle()
        with torch.no_grad():
            for size in reversed(self.sizes):
                for _ in range(2):
                    self.forward(size)
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool):
                    out = self.forward(size)
                self.graphs[size] = (graph, out)
        torch.cuda.synchronize(self.device)

    def replay(self, size: int) -> torch.Tensor:
        graph, out = self.graphs[size]
        graph.replay()
        return out

    def release(self) -> None:
        self.graphs.clear()
        self.pool = None
        gc.collect()
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
