"""One tensor-parallel rank: its shard of the model, its share of the KV cache, and the step.

`execute(plan)` applies the plan to the persistent batch (`workers.input_batch`), runs the model
(a CUDA graph for decode steps, eagerly otherwise) and samples; it launches all of that on the
device and returns at once with a `PendingOutput`, whose `get()` waits for the sampled tokens.
Every rank samples the same tokens from the same gathered logits (one generator per rank, seeded
alike), so each keeps its rows' last tokens on its own device; only rank 0's come back.
"""
from __future__ import annotations

import numpy as np
import torch

from distengine.config import EngineConfig, default_batched_tokens
from distengine.kv_cache.model_config import parse_model_config
from distengine.kv_cache.plan import KVCachePlan, make_plan
from distengine.step import StepOutput, StepPlan
from workers.cuda_graphs import DecodeGraphs
from workers.input_batch import InputBatch, StepInputs
from workers.kv_cache import allocate_kv_cache, mamba_group_ids
from workers.loader import get_model
from workers.parallel import TPGroup
from workers.sampler import SamplerOutput, SamplingTensors, sample
from workers.step_inputs import SeqStep, prepare_inputs

DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


class KVCacheTooSmallError(ValueError):
    pass


def resolve_device(device: str) -> torch.device:
    """"auto": this process's GPU when it sees one, else the CPU."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} but this process sees no CUDA GPU (use device='cpu' or 'auto')")
    return torch.device(device)


class _PinnedBuffers:
    """Host buffers the sampled tokens are copied into, two of each (steps alternate), grown on
    demand: a step's results are read while the next step's are being written."""

    def __init__(self, pin: bool) -> None:
        self.pin = pin
        self.bufs: dict[tuple[str, int], torch.Tensor] = {}

    def get(self, name: str, parity: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        n = int(np.prod(shape)) if shape else 1
        buf = self.bufs.get((name, parity))
        if buf is None or buf.numel() < n or buf.dtype != dtype:
            buf = torch.empty(max(n, 256), dtype=dtype, pin_memory=self.pin)
            self.bufs[(name, parity)] = buf
        return buf[:n].view(shape)


class PendingOutput:
    """A step's sampled tokens on their way to the host (a non-blocking copy and an event)."""

    def __init__(self, step_id: int, req_ids: list[str], out: SamplerOutput, bufs: _PinnedBuffers,
                 cuda: bool) -> None:
        self.step_id, self.req_ids = step_id, req_ids
        parity = step_id & 1
        self.host: dict[str, torch.Tensor] = {}
        for name, t in (("tokens", out.token_ids), ("logprobs", out.logprobs), ("top_ids", out.top_token_ids),
                        ("top_lp", out.top_logprobs)):
            if t is not None:
                dst = bufs.get(name, parity, tuple(t.shape), t.dtype) if cuda else t
                if cuda:
                    dst.copy_(t, non_blocking=True)
                self.host[name] = dst
        self.event = None
        if cuda:
            self.event = torch.cuda.Event()
            self.event.record()

    def get(self) -> StepOutput:
        if self.event is not None:
            self.event.synchronize()
        h = self.host
        return StepOutput(self.step_id, self.req_ids, h["tokens"].tolist(),
                          h["logprobs"].tolist() if "logprobs" in h else None,
                          h["top_ids"].tolist() if "top_ids" in h else None,
                          h["top_lp"].tolist() if "top_lp" in h else None)


class ModelRunner:
    def __init__(self, config: EngineConfig, tp: TPGroup = TPGroup(), device: torch.device | None = None) -> None:
        self.config, self.tp = config, tp
        self.device = device or resolve_device(config.device)
        self.model = get_model(config.model, tp, config.dtype, self.device, max_model_len=config.max_model_len,
                               load_format=config.load_format, seed=config.seed)
        self.dtype = next(self.model.parameters()).dtype
        hf = self.model.config
        text = hf.get_text_config() if hasattr(hf, "get_text_config") else hf
        self.plan: KVCachePlan = make_plan(parse_model_config(text.to_dict(), kv_cache_dtype=DTYPE_NAMES[self.dtype]),
                                           tp.world_size, config.block_size, config.max_model_len,
                                           mamba_checkpoint_interval=config.mamba_checkpoint_interval)
        self.vocab_size = int(text.vocab_size)
        self.max_num_batched_tokens = default_batched_tokens(config, self.device)
        self.batch = InputBatch(self.plan, config.max_num_seqs, self.vocab_size, self.device, config.debug_checks)
        self.generator = torch.Generator(self.device).manual_seed(config.seed)
        self.use_graphs = self.device.type == "cuda" and not config.enforce_eager
        self.graphs: DecodeGraphs | None = None
        self.outputs = _PinnedBuffers(self.device.type == "cuda")
        self.kv_pool: torch.Tensor | None = None
        self.num_blocks = 0
        self.graph_memory_bytes = 0
        self.memory_note = ""  # how the KV cache's share of a GPU was found, for a refusal's message

    # ---- KV cache ------------------------------------------------------------------------
    def determine_num_blocks(self) -> int:
        """Blocks that fit in this rank's memory: `kv_cache_memory_bytes` when set; else, on a GPU,
        what `gpu_memory_utilization` of the device leaves after a profiling forward pass at the
        largest batch (and the sampler at the most requests) and after the decode CUDA graphs' own
        memory; on CPU, `cpu_kv_cache_space_gib`. All ranks take the minimum. Refuses (clearly) a
        cache that cannot hold one request of max_model_len."""
        cfg = self.config
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
            self.profile_run()
            if self.use_graphs:
                self.graph_memory_bytes = self._measure_graph_memory()
            free, total = torch.cuda.mem_get_info(self.device)
            used_by_others = total - free - torch.cuda.memory_reserved(self.device)
            budget = (total * cfg.gpu_memory_utilization - torch.cuda.max_memory_allocated(self.device)
                      - used_by_others - self.graph_memory_bytes)
            g = 2 ** 30
            self.memory_note = (f"{cfg.gpu_memory_utilization} x {total / g:.1f} GiB, less the peak of the "
                                f"profiling pass {torch.cuda.max_memory_allocated(self.device) / g:.2f} GiB, memory "
                                f"outside PyTorch's allocator {used_by_others / g:.2f} GiB and the CUDA graphs "
                                f"{self.graph_memory_bytes / g:.2f} GiB")
            if cfg.kv_cache_memory_bytes is not None:
                room = free + torch.cuda.memory_reserved(self.device) - torch.cuda.max_memory_allocated(self.device) \
                    - self.graph_memory_bytes
                if cfg.kv_cache_memory_bytes > room:
                    raise KVCacheTooSmallError(
                        f"kv_cache_memory_bytes={cfg.kv_cache_memory_bytes} ({cfg.kv_cache_memory_bytes / 2**30:.2f} GiB) "
                        f"but only {room / 2**30:.2f} GiB of this GPU are left after the model, its activations "
                        f"and CUDA graphs")
                budget = cfg.kv_cache_memory_bytes
        else:
            budget = cfg.kv_cache_memory_bytes or cfg.cpu_kv_cache_space_gib * (1 << 30)
        # On the rank's device: an NCCL group reduces CUDA tensors only.
        n = torch.tensor([max(0, int(budget // self.plan.block_bytes))], dtype=torch.int64, device=self.device)
        if self.tp.world_size > 1:
            torch.distributed.all_reduce(n, op=torch.distributed.ReduceOp.MIN)
        num_blocks = int(n.item())
        self.check_fits(num_blocks)
        return num_blocks

    def check_fits(self, num_blocks: int) -> None:
        """One request of max_model_len must fit alone, at its peak: while a prefill chunk of
        max_num_batched_tokens tokens is written, a sliding-window group holds the chunk's blocks
        besides its window's (else the scheduler could never run it)."""
        chunk = min(self.max_num_batched_tokens, self.plan.max_model_len)

        def need(length: int) -> int:
            return sum(self.plan.peak_blocks_per_group(length, chunk)) + 1  # + the null block

        if num_blocks >= need(self.plan.max_model_len):
            return
        fits, lo, hi = 0, 1, self.plan.max_model_len
        while lo <= hi:  # the largest length whose request fits
            mid = (lo + hi) // 2
            if need(mid) <= num_blocks:
                fits, lo = mid, mid + 1
            else:
                hi = mid - 1
        if self.device.type == "cuda":
            advice = ("raise gpu_memory_utilization (or set kv_cache_memory_bytes), use more GPUs "
                      "(tensor_parallel_size)")
            if self.memory_note:
                advice = f"(the cache's share: {self.memory_note}) {advice}"
        else:
            advice = "raise kv_cache_memory_bytes (or VLLM_CPU_KVCACHE_SPACE, in GiB)"
        total = need(self.plan.max_model_len)
        raise KVCacheTooSmallError(
            f"the KV cache holds {num_blocks} blocks ({num_blocks * self.plan.block_bytes / 2**30:.3f} GiB per rank) "
            f"but one request of max_model_len={self.plan.max_model_len} needs {total} "
            f"({total * self.plan.block_bytes / 2**30:.3f} GiB) with prefill chunks of up to {chunk} tokens: "
            f"{advice}, lower max_num_batched_tokens, or set max_model_len <= {fits}")

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.check_fits(num_blocks)
        self.kv_pool = allocate_kv_cache(self.plan, self.model.cache_layers(), num_blocks, self.dtype, self.device)
        self.num_blocks = num_blocks
        if self.use_graphs:
            self.batch.reset_static()
            self.graphs = DecodeGraphs(self.config.cuda_graph_sizes, self._decode_forward, self.device)
            self.graphs.capture()

    def _with_dummy_cache(self, fn):
        """Run `fn` on a throwaway two-block cache (profiling), then unbind it."""
        layers = self.model.cache_layers()
        allocate_kv_cache(self.plan, layers, 2, self.dtype, self.device)
        try:
            return fn()
        finally:
            for layer in layers.values():
                layer.unbind()

    def profile_run(self) -> None:
        """A forward pass at the largest batch of tokens, then the LM head and the sampler at the
        most requests with every sampling option on, so the peak activation memory is known."""
        def run() -> None:
            # The token budget as sequences no longer than max_model_len (longer ones would run
            # positions past the rotary cache).
            n, groups, bs = self.max_num_batched_tokens, len(self.plan.groups), self.plan.block_size
            lens = [min(self.plan.max_model_len, n - i) for i in range(0, n, self.plan.max_model_len)]
            seqs = [SeqStep([0] * m, 0, [[1] * (-(-m // bs))] * groups) for m in lens]
            ids, pos, meta, _ = prepare_inputs(seqs, self.plan.block_size, self.device, mamba_group_ids(self.plan))
            with torch.no_grad():
                hidden = self.model(ids, pos, meta)
                r = self.config.max_num_seqs
                rows = torch.arange(r, device=self.device) % hidden.shape[0]
                logits = self.model.compute_logits(hidden[rows])
                p = dict(temperature=0.8, top_k=50, top_p=0.9, min_p=0.05, repetition_penalty=1.1,
                         presence_penalty=0.1, frequency_penalty=0.1, logprobs=20)
                gen = torch.Generator(self.device).manual_seed(0)  # the engine's generator stays untouched
                sample(logits, SamplingTensors.build([p] * r, [[]] * r, [[]] * r, self.vocab_size, self.device, gen))
                for module in self.model.modules():  # kernels whose variants follow the batch: all of them now
                    compile_variants = getattr(module, "compile_variants", None)
                    if compile_variants is not None:
                        compile_variants()
            torch.cuda.synchronize(self.device)
        self._with_dummy_cache(run)

    def _measure_graph_memory(self) -> int:
        """Device memory the decode graphs take: captured once on the throwaway cache, measured,
        released (they are captured for real once the cache exists)."""
        def run() -> int:
            self.batch.reset_static()
            torch.cuda.synchronize(self.device)
            # torch.cuda.graph() empties the allocator's cache when it starts: empty it first, or
            # the profiling pass's cached activations, released then, hide the graphs' memory.
            torch.cuda.empty_cache()
            free0, reserved0 = torch.cuda.mem_get_info(self.device)[0], torch.cuda.memory_reserved(self.device)
            graphs = DecodeGraphs(self.config.cuda_graph_sizes, self._decode_forward, self.device)
            graphs.capture()
            free1, reserved1 = torch.cuda.mem_get_info(self.device)[0], torch.cuda.memory_reserved(self.device)
            graphs.release()
            # The graphs' pool (reserved by the allocator) and what the driver holds for them.
            return max(0, free0 - free1, reserved1 - reserved0)
        return self._with_dummy_cache(run)

    def _decode_forward(self, size: int) -> torch.Tensor:
        ids, pos, meta = self.batch.decode_inputs(size)
        return self.model.compute_logits(self.model(ids, pos, meta))

    # ---- the step ------------------------------------------------------------------------
    def execute(self, plan: StepPlan) -> PendingOutput | None:
        """Launch one step; rank 0 gets a `PendingOutput` when something is sampled."""
        batch = self.batch
        for rid in plan.finished_req_ids:
            batch.remove(rid)
        for req in plan.new_requests:
            batch.add(req)
        if not plan.scheduled:
            return None
        step = batch.prepare(plan.scheduled, self.graphs.sizes if self.graphs else None)
        with torch.no_grad():
            logits = self._logits(step)
            if logits is None:
                return None
            t = batch.sampling_tensors(step, self.generator)
            out = sample(logits, t)
            batch.record_sampled(step, out.token_ids, t.any_penalties)
        if self.tp.rank != 0:
            return None
        return PendingOutput(plan.step_id, step.sample_req_ids, out, self.outputs, self.device.type == "cuda")

    def _logits(self, step: StepInputs) -> torch.Tensor | None:
        """The logits of the step's sampling requests (every rank computes them: the LM head's
        gather is a collective)."""
        if step.graph_size is not None:
            logits = self.graphs.replay(step.graph_size)
            if not step.sample_req_ids:
                return None
            if len(step.sample_req_ids) == step.num_seqs:
                return logits[:step.num_seqs]
            return logits[self.batch.staging.view(step.sections["sample_seq"]).long()]
        ids, pos, meta, idx = self.batch.eager_inputs(step)
        hidden = self.model(ids, pos, meta)
        if not step.sample_req_ids:
            return None
        return self.model.compute_logits(hidden[idx])
