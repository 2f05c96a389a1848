"""Drives one of our models the way the engine does: the KV cache manager hands out blocks, each
step goes through the workers' persistent batch, the model runs on the paged cache."""
from __future__ import annotations

import torch

from distengine.kv_cache.manager import KVCacheManager
from distengine.model_config import parse_model_config
from distengine.kv_cache.plan import make_plan
from distengine.request import Request
from distengine.step import NewRequest, RequestSampling, ScheduledRequest
from workers.input_batch import InputBatch
from workers.kv_cache import allocate_kv_cache
from workers.parallel import TPGroup

DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


class Harness:
    def __init__(self, model, config, tp: TPGroup = TPGroup(), num_blocks: int = 256, block_size: int = 4,
                 device: str = "cpu", dtype: torch.dtype = torch.float32) -> None:
        d = config.to_dict()
        d.setdefault("max_position_embeddings", 4096)
        self.plan = make_plan(parse_model_config(d, dtype=DTYPE_NAMES[dtype]), tp.world_size, block_size)
        self.model, self.device = model, torch.device(device)
        self.manager = KVCacheManager(self.plan, num_blocks)
        allocate_kv_cache(self.plan, model.cache_layers(), num_blocks, dtype, self.device)
        self.batch = InputBatch(self.plan, 1, config.get_text_config().vocab_size, self.device, debug_checks=True)
        self.n = 0

    def step(self, req: Request, num_new: int, hit: int = 0, hit_blocks=None) -> torch.Tensor:
        """Compute `num_new` tokens of `req` after its computed ones; logits of the last one."""
        assert self.manager.allocate_slots(req, num_new, hit, hit_blocks) is not None, "pool too small"
        req.num_computed_tokens += hit
        start = req.num_computed_tokens
        rid = req.request_id
        # The whole table each step: the request enters the batch, runs one step, and leaves it.
        self.batch.add(NewRequest(rid, [list(t) for t in self.manager.get_block_ids(rid)], RequestSampling()))
        step = self.batch.prepare([ScheduledRequest(rid, start, num_new, req.all_token_ids[start:start + num_new],
                                                    [], True)], None)
        inputs = self.batch.eager_inputs(step)
        self.batch.remove(rid)
        with torch.no_grad():
            hidden = self.model(inputs.input_ids, inputs.positions, inputs.metadata)
            logits = self.model.compute_logits(hidden)
        req.num_computed_tokens += num_new
        return logits

    def new_request(self, tokens: list[int]) -> Request:
        self.n += 1
        return Request(f"r{self.n}", list(tokens))

    def prefill_logits(self, tokens: list[int], chunk: int | None = None, use_cache: bool = False) -> torch.Tensor:
        """Logits of every prompt token (chunks of `chunk` tokens; with `use_cache`, the prefix
        the cache holds is not recomputed)."""
        req = self.new_request(tokens)
        out = []
        hit, blocks = 0, None
        if use_cache:
            blocks, hit = self.manager.get_computed_blocks(req)
        pos = hit
        while pos < len(tokens):
            n = min(chunk or len(tokens), len(tokens) - pos)
            out.append(self.step(req, n, hit, blocks))
            hit, blocks = 0, None
            pos += n
        self.manager.free(req)
        return torch.cat(out), pos

    def greedy(self, tokens: list[int], max_new: int) -> list[int]:
        req = self.new_request(tokens)
        logits = self.step(req, len(tokens))
        out = []
        for _ in range(max_new):
            t = int(logits[-1].argmax())
            out.append(t)
            req.append_output_token(t)
            logits = self.step(req, 1)
        self.manager.free(req)
        return out
