"""One tensor-parallel rank: its shard of the model, its share of the KV cache, and the step.

A step arrives as plain data (lists and dicts, msgpack-serialisable): requests admitted this
step come with their tokens and block tables once; afterwards a request only sends its new
tokens and the block ids appended to its tables. The runner flattens the scheduled requests into
one batch (prefills, prefix-continuing chunks and decodes together), runs the model, and rank 0
samples the last token of every request that needs one.

Step format:
    {"new": [{"id", "token_ids", "block_ids": [[...] per group], "sampling": {...}}],
     "scheduled": [{"id", "num_computed", "num_tokens", "new_token_ids": [...],
                    "new_block_ids": [[...] per group], "sample": bool}],
     "finished": [ids]}
`num_computed` tokens of the request are in the cache already; the step computes the next
`num_tokens`. `new_token_ids` are tokens the runner has not seen (the ones sampled last step);
the entries of `new_block_ids` are appended to the request's tables.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from distengine.kv_cache.model_config import parse_model_config
from distengine.kv_cache.plan import KVCachePlan, make_plan
from workers.kv_cache import allocate_kv_cache
from workers.loader import get_model
from workers.parallel import TPGroup
from workers.sampler import SamplingTensors, sample
from workers.step_inputs import SeqStep, prepare_inputs

DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


class KVCacheTooSmallError(ValueError):
    pass


@dataclass
class RequestState:
    token_ids: list[int]
    num_prompt_tokens: int
    block_ids: list[list[int]]
    sampling: dict = field(default_factory=dict)


class ModelRunner:
    def __init__(self, model: str, tp: TPGroup = TPGroup(), device: str | torch.device = "cpu",
                 dtype: str | torch.dtype = "auto", block_size: int = 16, max_model_len: int | None = None,
                 max_num_batched_tokens: int = 2048) -> None:
        self.tp, self.device = tp, torch.device(device)
        self.model = get_model(model, tp, dtype, self.device)
        self.dtype = next(self.model.parameters()).dtype
        self.config = self.model.config
        cfg = self.config.get_text_config().to_dict() if hasattr(self.config, "get_text_config") else self.config.to_dict()
        self.plan: KVCachePlan = make_plan(parse_model_config(cfg, kv_cache_dtype=DTYPE_NAMES[self.dtype]),
                                           tp.world_size, block_size, max_model_len)
        self.max_num_batched_tokens = max_num_batched_tokens
        self.vocab_size = self.config.get_text_config().vocab_size if hasattr(self.config, "get_text_config") \
            else self.config.vocab_size
        self.requests: dict[str, RequestState] = {}
        self.kv_buffers: list[torch.Tensor] = []

    # ---- KV cache ------------------------------------------------------------------------
    def determine_num_blocks(self, gpu_memory_utilization: float = 0.9, cpu_kv_cache_gib: float = 1.0) -> int:
        """Blocks that fit in this rank's memory: on a GPU, what `gpu_memory_utilization` of the
        device leaves after a profiling forward pass at the largest batch; on CPU, a fixed
        budget. All ranks take the minimum. Refuses (clearly) a cache that cannot hold one
        request of max_model_len."""
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
            self.profile_run()
            free, total = torch.cuda.mem_get_info(self.device)
            used_by_others = total - free - torch.cuda.memory_reserved(self.device)
            budget = total * gpu_memory_utilization - torch.cuda.max_memory_allocated(self.device) - used_by_others
        else:
            budget = cpu_kv_cache_gib * (1 << 30)
        # On the rank's device: an NCCL group reduces CUDA tensors only.
        n = torch.tensor([max(0, int(budget // self.plan.block_bytes))], dtype=torch.int64, device=self.device)
        if self.tp.world_size > 1:
            torch.distributed.all_reduce(n, op=torch.distributed.ReduceOp.MIN)
        num_blocks = int(n.item())
        self.check_fits(num_blocks)
        return num_blocks

    def check_fits(self, num_blocks: int) -> None:
        need = sum(self.plan.blocks_per_group(self.plan.max_model_len)) + 1  # + the null block
        if num_blocks >= need:
            return
        fits, lo, hi = 0, 1, self.plan.max_model_len
        while lo <= hi:  # the largest length whose request fits
            mid = (lo + hi) // 2
            if sum(self.plan.blocks_per_group(mid)) + 1 <= num_blocks:
                fits, lo = mid, mid + 1
            else:
                hi = mid - 1
        raise KVCacheTooSmallError(
            f"the KV cache holds {num_blocks} blocks ({num_blocks * self.plan.block_bytes / 2**30:.2f} GiB per rank) "
            f"but one request of max_model_len={self.plan.max_model_len} needs {need} "
            f"({need * self.plan.block_bytes / 2**30:.2f} GiB): raise gpu_memory_utilization, use more GPUs, "
            f"or set max_model_len <= {fits}")

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.check_fits(num_blocks)
        self.kv_buffers = allocate_kv_cache(self.plan, self.model.attention_layers(), num_blocks, self.dtype,
                                            self.device)
        self.num_blocks = num_blocks

    def profile_run(self) -> None:
        """A forward pass at the largest batch (max_num_batched_tokens over a few sequences) on
        a throwaway two-block cache, so the peak activation memory is known."""
        saved = {name: (a.kv_cache, a.group_id) for name, a in self.model.attention_layers().items()}
        allocate_kv_cache(self.plan, self.model.attention_layers(), 2, self.dtype, self.device)
        n, groups = self.max_num_batched_tokens, len(self.plan.groups)
        seqs = [SeqStep([0] * n, 0, [[1] * (-(-n // self.plan.block_size))] * groups)]
        ids, pos, meta, idx = prepare_inputs(seqs, self.plan.block_size, self.device)
        with torch.no_grad():
            self.model.compute_logits(self.model(ids, pos, meta)[idx])
        torch.cuda.synchronize(self.device)
        for name, a in self.model.attention_layers().items():
            a.kv_cache, a.group_id = saved[name]

    # ---- the step ------------------------------------------------------------------------
    def execute(self, step: dict) -> dict | None:
        """Run one step; rank 0 returns {"token_ids": [...], "logprobs": ...} in the order of the
        scheduled requests that sample, other ranks None."""
        for rid in step.get("finished", ()):
            self.requests.pop(rid, None)
        for r in step.get("new", ()):
            self.requests[r["id"]] = RequestState(list(r["token_ids"]), len(r["token_ids"]),
                                                  [list(t) for t in r["block_ids"]], dict(r.get("sampling") or {}))
        seqs, sampled = [], []
        for s in step.get("scheduled", ()):
            st = self.requests.get(s["id"])
            if st is None:
                raise KeyError(f"step schedules request {s['id']} that was never sent")
            st.token_ids.extend(s.get("new_token_ids", ()))
            for table, new in zip(st.block_ids, s.get("new_block_ids", ())):
                table.extend(new)
            c, n = s["num_computed"], s["num_tokens"]
            if c + n > len(st.token_ids):
                raise ValueError(f"request {s['id']}: step computes tokens up to {c + n}, the runner knows "
                                 f"{len(st.token_ids)}")
            seqs.append(SeqStep(st.token_ids[c:c + n], c, st.block_ids, bool(s.get("sample", True))))
            if s.get("sample", True):
                sampled.append(st)
        if not seqs:
            return {"token_ids": []} if self.tp.rank == 0 else None
        ids, pos, meta, idx = prepare_inputs(seqs, self.plan.block_size, self.device)
        with torch.no_grad():
            hidden = self.model(ids, pos, meta)
            if not sampled:
                return {"token_ids": []} if self.tp.rank == 0 else None
            logits = self.model.compute_logits(hidden[idx])  # collective: every rank takes part
        if self.tp.rank != 0:
            return None
        t = SamplingTensors.build([st.sampling for st in sampled], [st.token_ids[:st.num_prompt_tokens] for st in sampled],
                                  [st.token_ids[st.num_prompt_tokens:] for st in sampled], self.vocab_size, self.device)
        out = sample(logits, t)
        result = {"token_ids": out.token_ids.tolist()}
        if out.logprobs is not None:
            result["logprobs"] = out.logprobs.tolist()
        if out.top_logprobs is not None:
            result["top_logprobs"] = out.top_logprobs.tolist()
            result["top_token_ids"] = out.top_token_ids.tolist()
        return result
