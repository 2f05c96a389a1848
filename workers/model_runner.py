"""One tensor-parallel rank: its shard of the model, its share of the KV cache, and the step.

`execute(plan)` applies the plan to the persistent batch (`workers.input_batch`), runs the model
(a CUDA graph for decode steps, eagerly otherwise) and samples; it launches all of that on the
device and returns at once with a `PendingOutput`, whose `get()` waits for the sampled tokens.
A step whose grammar masks follow (`StepPlan.masks_follow`) stops after its logits; the next plan
brings the masks, and its `execute` samples that step first, before anything of its own.
Every rank samples the same tokens from the same gathered logits (one generator per rank, seeded
alike), so each keeps its rows' last tokens on its own device; only rank 0's come back.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from distengine.config import EngineConfig
from distengine.config_snapshot import ConfigSnapshot
from distengine.kv_cache.plan import KVCachePlan
from distengine.step import GrammarMasks, RequestSampling, StepOutput, StepPlan
from distengine.worker_info import MemoryProfile
from workers.cuda_graphs import DecodeGraphs
from workers.input_batch import InputBatch, StepInputs
from workers.kv_cache import allocate_kv_cache
from workers.loader import get_model
from workers.parallel import TPGroup
from workers.sampler import SamplerOutput, SamplingTensors, sample


class _PinnedBuffers:
    """Host buffers the sampled tokens are copied into, two of each (steps alternate), grown on
    demand: a step's results are read while the next step's are being written. On a GPU the
    copies run on a stream of their own, so the next step's inputs and kernels never queue
    behind them."""

    def __init__(self, device: torch.device) -> None:
        self.pin = device.type == "cuda"
        self.bufs: dict[tuple[str, int], torch.Tensor] = {}
        self.stream = torch.cuda.Stream(device) if self.pin else None

    def get(self, name: str, parity: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        n = int(np.prod(shape)) if shape else 1
        buf = self.bufs.get((name, parity))
        if buf is None or buf.numel() < n or buf.dtype != dtype:
            buf = torch.empty(max(n, 256), dtype=dtype, pin_memory=self.pin)
            self.bufs[(name, parity)] = buf
        return buf[:n].view(shape)


class PromptLogprobs:
    """One request's prompt logprobs as its prefill chunks compute them (on the device): for
    each prompt position but the last, the next prompt token's logprob, its rank, and the top k."""

    LOGITS_ROWS = 512  # positions whose logits [rows, vocab] are computed at once

    def __init__(self, prompt: list[int], k: int) -> None:
        self.prompt, self.k, self.done = prompt, k, 0
        self.parts: list[tuple[torch.Tensor, ...]] = []

    @property
    def complete(self) -> bool:
        return self.done >= len(self.prompt)

    def add_chunk(self, model, hidden: torch.Tensor, n: int) -> None:
        """`hidden` [n, H]: the chunk's positions done .. done + n - 1 (every rank calls this:
        the LM head's gather is a collective)."""
        m = min(n, len(self.prompt) - 1 - self.done)  # the last prompt position has no next prompt token
        for a in range(0, max(m, 0), self.LOGITS_ROWS):
            b = min(m, a + self.LOGITS_ROWS)
            lp = torch.log_softmax(model.compute_logits(hidden[a:b]).float(), dim=-1)
            nxt = torch.tensor(self.prompt[self.done + a + 1:self.done + b + 1])
            nxt = nxt.pin_memory().to(lp.device, non_blocking=True) if lp.is_cuda else nxt  # (no wait on the device)
            got = lp.gather(1, nxt[:, None])
            rank = (lp > got).sum(1) + 1
            top = lp.topk(self.k, dim=-1) if self.k else None
            self.parts.append((nxt, got[:, 0], rank, *((top.indices, top.values) if top is not None else (None, None))))
        self.done += n

    def rows(self) -> list[list]:
        """[tokens, logprobs, ranks, top ids, top logprobs] as lists (`StepOutput.prompt_logprobs`)."""
        cols = list(zip(*self.parts)) if self.parts else [()] * 5
        out = [torch.cat(c).tolist() if c else [] for c in cols[:3]]
        for c in cols[3:]:
            out.append(torch.cat(c).tolist() if c and c[0] is not None else [[] for _ in out[0]])
        return out


class PendingOutput:
    """A step's sampled tokens on their way to the host (a non-blocking copy and an event)."""

    def __init__(self, step_id: int, req_ids: list[str], out: SamplerOutput, bufs: _PinnedBuffers,
                 cuda: bool, prompt_logprobs: dict[str, PromptLogprobs] | None = None) -> None:
        self.step_id, self.req_ids = step_id, req_ids
        self.prompt_logprobs = prompt_logprobs
        parity = step_id & 1
        outputs = [(name, t) for name, t in (("tokens", out.token_ids), ("logprobs", out.logprobs),
                                             ("top_ids", out.top_token_ids), ("top_lp", out.top_logprobs))
                   if t is not None]
        self.host: dict[str, torch.Tensor] = {}
        self.event = None
        if not cuda:
            self.host = dict(outputs)
            return
        bufs.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(bufs.stream):
            for name, t in outputs:
                dst = bufs.get(name, parity, tuple(t.shape), t.dtype)
                dst.copy_(t, non_blocking=True)
                t.record_stream(bufs.stream)  # (its memory is not reused before the copy)
                self.host[name] = dst
            self.event = torch.cuda.Event()
            self.event.record()

    def get(self) -> StepOutput:
        if self.event is not None:
            self.event.synchronize()
        h = self.host
        return StepOutput(self.step_id, self.req_ids, h["tokens"].tolist(),
                          h["logprobs"].tolist() if "logprobs" in h else None,
                          h["top_ids"].tolist() if "top_ids" in h else None,
                          h["top_lp"].tolist() if "top_lp" in h else None,
                          {rid: p.rows() for rid, p in self.prompt_logprobs.items()} if self.prompt_logprobs else None)


@dataclass
class _Unsampled:
    """A step run up to its logits, waiting on its grammar masks."""
    step_id: int
    step: StepInputs
    logits: torch.Tensor


class ModelRunner:
    """Built from a placed config (device, dtype and token budget resolved) and the engine's plan."""

    def __init__(self, config: EngineConfig, plan: KVCachePlan, tp: TPGroup = TPGroup(),
                 device: torch.device | None = None, hf_config: ConfigSnapshot | None = None) -> None:
        self.config, self.plan, self.tp = config, plan, tp
        self.device = device or torch.device(config.device)
        self.model = get_model(config.model, tp, config.dtype, self.device, max_model_len=config.max_model_len,
                               load_format=config.load_format, seed=config.seed,
                               kv_cache_dtype=config.kv_cache_dtype, quantization=config.quantization,
                               hf_config=hf_config)
        self.dtype = self.model.model.embedding.weight.dtype if hasattr(self.model.model, "embedding") \
            else next(self.model.parameters()).dtype  # (FP8 linears hold another dtype)
        self.vocab_size = int(self.model.config.get_text_config().vocab_size)
        self.batch = InputBatch(plan, config.max_num_seqs, self.vocab_size, self.device, config.debug_checks)
        self.generator = torch.Generator(self.device).manual_seed(config.seed)
        self.use_graphs = self.device.type == "cuda" and not config.enforce_eager
        self.graphs: DecodeGraphs | None = None
        self.outputs = _PinnedBuffers(self.device)
        self.prompt_logprobs: dict[str, PromptLogprobs] = {}  # requests whose prompt logprobs are being computed
        self.kv_pool: torch.Tensor | None = None
        self.num_blocks = 0
        self._unsampled: _Unsampled | None = None  # a step whose masks follow

    # ---- KV cache ------------------------------------------------------------------------
    def profile_memory(self) -> MemoryProfile:
        """This rank's memory for the engine to size the KV cache by: on a GPU after a profiling
        forward pass at the largest step (and the sampler at the most requests) and a capture of
        the decode CUDA graphs."""
        weights = sum(p.numel() * p.element_size() for p in self.model.parameters())
        if self.device.type != "cuda":
            return MemoryProfile(weight_bytes=weights)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        self.profile_run()
        graphs = self._measure_graph_memory() if self.use_graphs else 0
        free, total = torch.cuda.mem_get_info(self.device)
        return MemoryProfile(weight_bytes=weights, peak_bytes=torch.cuda.max_memory_allocated(self.device),
                             reserved_bytes=torch.cuda.memory_reserved(self.device), free_bytes=free,
                             total_bytes=total, graph_bytes=graphs)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.kv_pool = allocate_kv_cache(self.plan, self.model.cache_layers(), num_blocks, self.dtype, self.device,
                                         self.config.kv_cache_dtype)
        self.num_blocks = num_blocks
        if self.use_graphs:
            self.batch.reset_static()
            self.graphs = DecodeGraphs(self.config.cuda_graph_sizes, self._decode_forward, self.device)
            self.graphs.capture()

    def _with_dummy_cache(self, fn):
        """Run `fn` on a throwaway two-block cache (profiling), then unbind it."""
        layers = self.model.cache_layers()
        allocate_kv_cache(self.plan, layers, 2, self.dtype, self.device, self.config.kv_cache_dtype)
        try:
            return fn()
        finally:
            for layer in layers.values():
                layer.unbind()

    def profile_run(self) -> None:
        """A forward pass at the largest step, then the LM head and the sampler at the most
        requests with every sampling option on, so the peak activation memory is known."""
        def run() -> None:
            # The token budget as sequences no longer than max_model_len (longer ones would run
            # positions past the rotary cache), no more of them than the batch holds.
            n, longest = self.config.max_num_batched_tokens, self.plan.max_model_len
            lengths = [min(longest, n - i) for i in range(0, n, longest)][:self.config.max_num_seqs]
            inputs = self.batch.eager_inputs(self.batch.dummy_prefill(lengths))
            with torch.no_grad():
                hidden = self.model(inputs.input_ids, inputs.positions, inputs.metadata)
                r = self.config.max_num_seqs
                rows = torch.arange(r, device=self.device) % hidden.shape[0]
                logits = self.model.compute_logits(hidden[rows])
                every_option = RequestSampling(temperature=0.8, top_k=50, top_p=0.9, min_p=0.05,
                                               repetition_penalty=1.1, presence_penalty=0.1, frequency_penalty=0.1,
                                               logprobs=20)
                gen = torch.Generator(self.device).manual_seed(0)  # the engine's generator stays untouched
                every_token = torch.full((r, -(-self.vocab_size // 32)), -1, dtype=torch.int32)  # a grammar's mask
                sample(logits, SamplingTensors.build([every_option] * r, [[]] * r, [[]] * r, self.vocab_size,
                                                     self.device, gen, every_token))
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
        inputs = self.batch.decode_inputs(size)
        return self.model.compute_logits(self.model(inputs.input_ids, inputs.positions, inputs.metadata))

    # ---- the step ------------------------------------------------------------------------
    def execute(self, plan: StepPlan) -> list[PendingOutput]:
        """Launch one step (and first sample the step before it, when that one waited on the masks
        this plan brings); rank 0 gets a `PendingOutput` for each step sampled, in step order."""
        launched = []
        masks = plan.grammar_masks
        waiting, self._unsampled = self._unsampled, None
        if waiting is not None:
            if masks is None or masks.step_id != waiting.step_id:
                got = "none" if masks is None else f"step {masks.step_id}'s"
                raise ValueError(f"step {waiting.step_id} waits on its grammar masks; step {plan.step_id} "
                                 f"brought {got}")
            # Before the plan's changes to the batch: the rows are still those of that step.
            launched.append(self._sample(waiting.step_id, waiting.step, waiting.logits, masks))
            masks = None
        elif masks is not None and masks.step_id != plan.step_id:
            raise ValueError(f"step {plan.step_id} brought the grammar masks of step {masks.step_id}, which "
                             f"does not wait on them")
        launched.append(self._launch(plan, masks))
        return [p for p in launched if p is not None]

    def _launch(self, plan: StepPlan, masks: GrammarMasks | None) -> PendingOutput | None:
        batch = self.batch
        for rid in plan.finished_req_ids:
            batch.remove(rid)
            self.prompt_logprobs.pop(rid, None)
        for req in plan.new_requests:
            batch.add(req)
            if req.sampling.prompt_logprobs is not None and req.num_output_tokens == 0:
                self.prompt_logprobs[req.req_id] = PromptLogprobs(req.prompt_token_ids, req.sampling.prompt_logprobs)
        if not plan.scheduled:
            return None
        step = batch.prepare(plan.scheduled, self.graphs.sizes if self.graphs else None)
        with torch.no_grad():
            logits = self._logits(step, plan)
        if logits is None:
            return None
        if plan.masks_follow:
            self._unsampled = _Unsampled(plan.step_id, step, logits)
            return None
        return self._sample(plan.step_id, step, logits, masks)

    def _sample(self, step_id: int, step: StepInputs, logits: torch.Tensor,
                masks: GrammarMasks | None) -> PendingOutput | None:
        batch = self.batch
        with torch.no_grad():
            t = batch.sampling_tensors(step, self.generator, masks.masks if masks is not None else None)
            if t.argmax_only:
                out = SamplerOutput(token_ids=batch.pick_greedy(step, logits))
            else:
                out = sample(logits, t)
                batch.record_sampled(step, out.token_ids, t.any_penalties,
                                     t.adjust is not None and t.adjust.reads_history)
        done = {rid: self.prompt_logprobs.pop(rid) for rid in step.sample_req_ids
                if rid in self.prompt_logprobs and self.prompt_logprobs[rid].complete}
        if self.tp.rank != 0:
            return None
        return PendingOutput(step_id, step.sample_req_ids, out, self.outputs, self.device.type == "cuda", done)

    def _prompt_chunks(self, plan: StepPlan, hidden: torch.Tensor) -> None:
        """The prompt logprobs of the step's prefill chunks that ask for them."""
        start = 0
        for s in plan.scheduled:
            p = self.prompt_logprobs.get(s.req_id)
            if p is not None and not p.complete:
                p.add_chunk(self.model, hidden[start:start + s.num_new_tokens], s.num_new_tokens)
            start += s.num_new_tokens

    def _logits(self, step: StepInputs, plan: StepPlan) -> torch.Tensor | None:
        """The logits of the step's sampling requests (every rank computes them: the LM head's
        gather is a collective)."""
        if step.graph_size is not None:
            logits = self.graphs.replay(step.graph_size)
            if not step.sample_req_ids:
                return None
            if len(step.sample_req_ids) == step.num_seqs:
                return logits[:step.num_seqs]
            return logits[self.batch.sample_seq(step)]
        inputs = self.batch.eager_inputs(step)
        hidden = self.model(inputs.input_ids, inputs.positions, inputs.metadata)
        if self.prompt_logprobs:
            self._prompt_chunks(plan, hidden)
        if not step.sample_req_ids:
            return None
        return self.model.compute_logits(hidden[inputs.logits_indices])
