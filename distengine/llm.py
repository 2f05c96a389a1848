"""`LLM`: offline generation, as vLLM's. The data path: request -> scheduler -> step plan ->
workers (Ray actors, or one in-process worker) -> model -> kernels, and back: sampled tokens ->
stop checks -> outputs."""
from __future__ import annotations

import itertools
import time
from collections.abc import Sequence

import torch

from distengine.detokenizer import IncrementalDetokenizer, check_stop_strings
from distengine.executor import Executor, RayExecutor, UniprocExecutor
from distengine.kv_cache.model_config import parse_model_config
from distengine.kv_cache.plan import make_plan
from distengine.outputs import CompletionOutput, RequestOutput
from distengine.sampling_params import SamplingParams
from distengine.scheduler import EngineRequest, Scheduler, SchedulerStats
from workers.loader import load_hf_config, resolve_dtype, resolve_model_path, text_config

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}

PromptType = str | dict


class LLM:
    def __init__(self, model: str, tensor_parallel_size: int = 1, device: str = "auto", dtype: str = "auto",
                 block_size: int = 16, max_model_len: int | None = None, gpu_memory_utilization: float = 0.9,
                 num_gpu_blocks_override: int | None = None, enable_prefix_caching: bool = True,
                 max_num_seqs: int = 256, max_num_batched_tokens: int | None = None, seed: int = 0,
                 ray_address: str | None = None, tokenizer: str | None = None,
                 placement_strategy: str = "PACK") -> None:
        if tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {tensor_parallel_size}")
        if not 0 < gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
        self.device = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
        path = resolve_model_path(model)
        config = text_config(load_hf_config(path))
        torch_dtype = resolve_dtype(load_hf_config(path), dtype, torch.device(self.device))
        self.plan = make_plan(parse_model_config(config.to_dict(), kv_cache_dtype=_DTYPE_NAMES[torch_dtype]),
                              tensor_parallel_size, block_size, max_model_len)
        self.max_model_len = self.plan.max_model_len
        batched = max_num_batched_tokens or max(2048, self.max_model_len if self.max_model_len <= 8192 else 2048)
        kwargs = dict(model=str(path), device=self.device, dtype=_DTYPE_NAMES[torch_dtype], block_size=block_size,
                      max_model_len=self.max_model_len, max_num_batched_tokens=batched,
                      gpu_memory_utilization=gpu_memory_utilization, num_gpu_blocks_override=num_gpu_blocks_override,
                      seed=seed)
        self.executor: Executor = (UniprocExecutor(**kwargs) if tensor_parallel_size == 1 and ray_address is None
                                   else RayExecutor(tensor_parallel_size=tensor_parallel_size, ray_address=ray_address,
                                                    placement_strategy=placement_strategy, **kwargs))
        self.scheduler = Scheduler(self.plan, self.executor.num_blocks, max_num_seqs, batched, enable_prefix_caching)
        self.tokenizer = self._load_tokenizer(tokenizer or str(path))
        self.eos_token_ids = self._eos_ids(path, config)
        self._ids = itertools.count()

    # ---- setup ---------------------------------------------------------------------------
    @staticmethod
    def _load_tokenizer(path: str):
        """The model's tokenizer, or None when it ships none (prompts must then be token ids).
        Only tokenizer files count: transformers may otherwise build an empty one."""
        import os
        files = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")
        if os.path.isdir(path) and not any(os.path.exists(os.path.join(path, f)) for f in files):
            return None
        try:
            from transformers import AutoTokenizer
            return AutoTokenizer.from_pretrained(path)
        except (OSError, ValueError, TypeError):
            return None

    @staticmethod
    def _eos_ids(path, config) -> frozenset[int]:
        ids = getattr(config, "eos_token_id", None)
        try:
            from transformers import GenerationConfig
            ids = GenerationConfig.from_pretrained(path).eos_token_id or ids
        except (OSError, ValueError):
            pass
        if ids is None:
            return frozenset()
        return frozenset(ids if isinstance(ids, (list, tuple)) else [ids])

    # ---- API -----------------------------------------------------------------------------
    def get_tokenizer(self):
        return self.tokenizer

    def stats(self) -> SchedulerStats:
        return self.scheduler.stats()

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = [sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams) \
            else list(sampling_params)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        # Every prompt is checked before any is queued: a bad one leaves nothing behind.
        items = [(self._prompt(p), sp) for p, sp in zip(prompts, params)]
        reqs = []
        for (text, ids), sp in items:
            reqs.append(EngineRequest(str(next(self._ids)), ids, sampling=sp, eos_token_ids=self.eos_token_ids,
                                      prompt=text, detok=IncrementalDetokenizer(self.tokenizer, ids,
                                                                                sp.skip_special_tokens),
                                      logprobs=[] if sp.logprobs is not None else None))
        for req in reqs:
            self.scheduler.add_request(req)
        try:
            self._run(reqs, use_tqdm)
        except BaseException:
            for req in reqs:
                self.scheduler.abort(req.request_id)
            raise
        return [self._output(r) for r in reqs]

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams | None = None,
             use_tqdm: bool = True) -> list[RequestOutput]:
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("chat() needs a tokenizer with a chat template")
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in convs]
        return self.generate(prompts, sampling_params, use_tqdm)

    def shutdown(self) -> None:
        self.executor.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # ---- internals -----------------------------------------------------------------------
    def _prompt(self, p: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(p, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: give prompts as {'prompt_token_ids': [...]}")
            text, ids = p, self.tokenizer(p)["input_ids"]
        elif isinstance(p, dict) and "prompt_token_ids" in p:
            text, ids = p.get("prompt"), [int(t) for t in p["prompt_token_ids"]]
        else:
            raise ValueError(f"a prompt is a string or a dict with 'prompt_token_ids', got {type(p).__name__}")
        if not ids:
            raise ValueError("the prompt is empty")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"the prompt is {len(ids)} tokens long but max_model_len is {self.max_model_len}: "
                             f"at most {self.max_model_len - 1} prompt tokens fit")
        return text, ids

    def _run(self, reqs: list[EngineRequest], use_tqdm: bool) -> None:
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm
            bar = tqdm(total=len(reqs), desc="Processed prompts", dynamic_ncols=True)
        pending = {r.request_id for r in reqs}
        start, out_tokens = time.perf_counter(), 0
        sched = self.scheduler
        while pending:
            step, scheduled = sched.schedule()
            if not scheduled:
                if not sched.running and sched.waiting:
                    head = sched.waiting[0]
                    raise RuntimeError(f"request {head.request_id} ({head.num_tokens} tokens) cannot fit in the KV "
                                       f"cache ({sched.manager.pool.num_blocks - 1} blocks)")
                if not sched.has_unfinished():
                    break
            result = self.executor.execute(step)
            tokens = result.get("token_ids", [])
            samplers = [req for req, n in scheduled if req.num_computed_tokens + n == req.num_tokens]
            logprobs, top_lp, top_ids = result.get("logprobs"), result.get("top_logprobs"), result.get("top_token_ids")
            finished = sched.update(scheduled, tokens)
            for k, (req, token) in enumerate(zip(samplers, tokens)):
                out_tokens += 1
                if req.logprobs is not None and logprobs is not None:
                    # vLLM's shape: per position, the sampled token and the top-k, token -> logprob.
                    entry = {token: logprobs[k]}
                    if top_ids is not None and req.sampling.logprobs:
                        entry.update(zip(top_ids[k][:req.sampling.logprobs], top_lp[k][:req.sampling.logprobs]))
                    req.logprobs.append(entry)
                new_text = req.detok.append([token])
                req.text += new_text
                sp = req.sampling
                if sp.stop and req.finish_reason in (None, "length") and req.num_output_tokens >= sp.min_tokens:
                    text, matched = check_stop_strings(req.text, len(new_text), sp.stop, sp.include_stop_str_in_output)
                    if matched is not None:
                        req.text = text
                        if req.finish_reason is None:
                            sched.finish_request(req.request_id, "stop", matched)
                            finished.append(req)
                        else:  # the stop string came with the last allowed token: it is a stop
                            req.finish_reason, req.stop_reason = "stop", matched
            for req in finished:
                if req.stop_reason is None or not isinstance(req.stop_reason, str):
                    req.text += req.detok.flush()  # a held-back partial character, if any
                if req.request_id in pending:
                    pending.discard(req.request_id)
                    if bar is not None:
                        bar.update(1)
                        bar.set_postfix(out_tok_s=f"{out_tokens / (time.perf_counter() - start):.1f}")
        if bar is not None:
            bar.close()

    @staticmethod
    def _output(req: EngineRequest) -> RequestOutput:
        reason = req.finish_reason if req.finish_reason != "abort" else None
        comp = CompletionOutput(index=0, text=req.text, token_ids=req.output_token_ids, finish_reason=reason,
                                stop_reason=req.stop_reason, logprobs=req.logprobs, cumulative_logprob=None)
        return RequestOutput(request_id=req.request_id, prompt=req.prompt, prompt_token_ids=req.prompt_token_ids,
                             num_cached_tokens=max(req.num_cached_tokens, 0), finished=req.finish_reason is not None,
                             outputs=[comp])
