"""`LLM`: offline generation, as vLLM's. The data path: request -> scheduler -> step plan ->
executor -> workers (Ray actors, or one in-process worker) -> model -> kernels, and back: sampled
tokens with their request ids -> stop rules (scheduler) -> detokenization and stop strings
(output processor) -> outputs. The loop itself is `EngineCore`'s."""
from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence

from distengine.beam_search import BeamSearch, BeamSearchOutput, BeamSearchParams
from distengine.config import EngineConfig
from distengine.engine_core import EngineCore
from distengine.inputs import InputProcessor, check_message_content
from distengine.outputs import RequestOutput
from distengine.output_processor import OutputProcessor
from distengine.parallel_sampling import child_params, choose, fork_point, prefix_params
from distengine.sampling_params import SamplingParams
from distengine.scheduler import EngineRequest, SchedulerStats
from distengine.hf_config import load_tokenizer_and_eos

PromptType = str | dict


class LLM:
    """`LLM(model, **options)`: the options are `EngineConfig`'s fields (vLLM's names:
    tensor_parallel_size, dtype, max_model_len, gpu_memory_utilization, enforce_eager, ...)."""

    def __init__(self, model: str, tensor_parallel_size: int = 1, **options) -> None:
        self.config = EngineConfig.create(model, tensor_parallel_size=tensor_parallel_size, **options)
        self.tokenizer, self.eos_token_ids = load_tokenizer_and_eos(self.config)
        self.engine = EngineCore(self.config)
        self.info = self.engine.info
        self.plan = self.engine.plan
        self.scheduler = self.engine.scheduler
        self.executor = self.engine.executor
        self.max_model_len = self.config.max_model_len
        self.inputs = InputProcessor(self.tokenizer, self.info.vocab_size, self.max_model_len,
                                     self.config.structured_outputs_backend)
        self.output_processor = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()

    # ---- API -----------------------------------------------------------------------------
    def get_tokenizer(self):
        return self.tokenizer

    def stats(self) -> SchedulerStats:
        return self.engine.stats()

    def collective_rpc(self, method: str | Callable, args: tuple = (), ranks: list[int] | None = None) -> list:
        """`Worker.method(*args)`, or `method(worker, *args)` for a function, on the given ranks
        (default: all), their results in rank order."""
        return self.executor.collective_rpc(method, args, ranks)

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Outputs in the order of `prompts`. Every prompt and its params are checked first
        (`distengine.inputs`): a bad one raises and nothing is queued."""
        requests = self.inputs.requests(prompts, sampling_params)
        ids: list[str] = []
        try:
            # The shared blocks of each prompt with several completions, computed once first.
            if self.config.enable_prefix_caching:
                prefixes = [tokens[:fork_point(len(tokens), self.plan.block_size)] for _, tokens, sp in requests
                            if sp.num_children > 1]
                hidden = [self._add(None, p, prefix_params(), ids) for p in prefixes if p]
                self._run(hidden, use_tqdm=False)
                for rid in hidden:
                    self.output_processor.pop(rid)
            groups = [[self._add(text, tokens, sp if sp.num_children == 1 else child_params(sp, i), ids)
                       for i in range(sp.num_children)] for text, tokens, sp in requests]
            self._run([rid for group in groups for rid in group], use_tqdm)
        except BaseException:  # Ctrl-C included (held until a step ends): this call's requests go
            self.engine.abort(ids)
            for rid in ids:
                self.output_processor.pop(rid)
            raise
        outputs = []
        for (_, _, sp), group in zip(requests, groups):
            out = [self.output_processor.pop(rid).output() for rid in group]
            if sp.num_children > 1:
                out[0].outputs = choose([o.outputs[0] for o in out], sp)
            outputs.append(out[0])
        return outputs

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams | None = None,
             use_tqdm: bool = True) -> list[RequestOutput]:
        if not isinstance(messages, list) or not messages:
            raise TypeError(f"messages must be a non-empty list of {{'role', 'content'}} dicts (one conversation) "
                            f"or a list of such lists, got {type(messages).__name__} {messages!r:.80}")
        convs = [messages] if isinstance(messages[0], dict) else messages
        for i, conv in enumerate(convs):
            if not isinstance(conv, list) or not conv or not all(
                    isinstance(m, dict) and isinstance(m.get("role"), str) and "content" in m for m in conv):
                raise TypeError(f"messages[{i}] must be a non-empty list of {{'role': str, 'content': ...}} dicts, "
                                f"got {conv!r:.80}")
            for j, m in enumerate(conv):
                check_message_content(m["content"], f"messages[{i}][{j}]['content']")
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("chat() needs a tokenizer with a chat template")
        prompts = [self.tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in convs]
        return self.generate(prompts, sampling_params, use_tqdm)

    def shutdown(self) -> None:
        self.engine.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def beam_search(self, prompts: PromptType | Sequence[PromptType], params: BeamSearchParams,
                    use_tqdm: bool = False) -> list[BeamSearchOutput]:
        """vLLM's beam search (`distengine.beam_search`): each step, one request per live beam
        of every prompt; the beams share their blocks through the prefix cache."""
        if not isinstance(params, BeamSearchParams):
            raise TypeError(f"params must be a BeamSearchParams, got {type(params).__name__}")
        step = params.step_params()
        searches = [BeamSearch(tokens, params, self.eos_token_ids, self.max_model_len)
                    for _, tokens, _ in self.inputs.requests(prompts, step)]
        while live := [s for s in searches if not s.done]:
            beams = [tokens for s in live for tokens in s.requests()]
            outs = iter(self.generate([{"prompt_token_ids": t} for t in beams], step, use_tqdm=use_tqdm))
            for s in live:
                s.advance([next(outs).outputs[0].logprobs[0] for _ in s.requests()])
        decode = self.tokenizer.decode if self.tokenizer is not None else None
        return [s.result(decode) for s in searches]

    # ---- internals -----------------------------------------------------------------------
    def _add(self, text: str | None, tokens: list[int], sp: SamplingParams, ids: list[str]) -> str:
        rid = str(next(self._ids))
        ids.append(rid)
        self.output_processor.add_request(rid, text, tokens, sp)
        self.engine.add_request(EngineRequest(rid, tokens, sampling=sp, eos_token_ids=self.eos_token_ids))
        return rid

    def _run(self, ids: list[str], use_tqdm: bool) -> None:
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm
            bar = tqdm(total=len(ids), desc="Processed prompts", dynamic_ncols=True)
        pending = set(ids)
        start, out_tokens = time.perf_counter(), 0
        while pending:
            updates = self.engine.step()
            out_tokens += len(updates)
            step = self.output_processor.process(updates)
            for rid, matched in step.stops:
                self.engine.finish_request(rid, "stop", matched)
            self.engine.abort(step.failed)  # failed on their way out: the engine drops them
            for st in step.finished:
                if st.req_id in pending:
                    pending.discard(st.req_id)
                    if bar is not None:
                        bar.update(1)
                        bar.set_postfix(out_tok_s=f"{out_tokens / (time.perf_counter() - start):.1f}")
            if pending and not updates and not self.engine.has_unfinished() \
                    and not self.scheduler.has_in_flight():
                raise RuntimeError(f"the engine stopped with {len(pending)} request(s) unfinished")
        # The overlapped loop may still run a step whose tokens nobody needs: finish it, so that
        # generate() returns with the workers idle.
        while not self.engine.has_unfinished() and self.scheduler.has_in_flight():
            self.engine.step()
        if bar is not None:
            bar.close()
