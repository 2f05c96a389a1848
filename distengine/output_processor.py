"""From the engine core's per-step tokens to what users see: incremental detokenization, stop
strings (the one stop condition that needs text; token stops are the scheduler's), logprobs
gathered per position, and `RequestOutput`s."""
from __future__ import annotations

from dataclasses import dataclass, field

from distengine.detokenizer import IncrementalDetokenizer, check_stop_strings
from distengine.outputs import CompletionOutput, RequestOutput
from distengine.sampling_params import SamplingParams
from distengine.scheduler import RequestUpdate


@dataclass
class RequestState:
    req_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    sampling: SamplingParams
    detok: IncrementalDetokenizer
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def output(self) -> RequestOutput:
        reason = self.finish_reason if self.finish_reason != "abort" else None
        comp = CompletionOutput(index=0, text=self.text, token_ids=list(self.token_ids), finish_reason=reason,
                                stop_reason=self.stop_reason, logprobs=self.logprobs,
                                cumulative_logprob=(sum(d[t] for d, t in zip(self.logprobs, self.token_ids))
                                                    if self.logprobs is not None else None))
        return RequestOutput(request_id=self.req_id, prompt=self.prompt, prompt_token_ids=self.prompt_token_ids,
                             num_cached_tokens=self.num_cached_tokens, finished=self.finished, outputs=[comp])


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, RequestState] = {}

    def add_request(self, req_id: str, prompt: str | None, prompt_token_ids: list[int],
                    sampling: SamplingParams) -> None:
        self.requests[req_id] = RequestState(
            req_id, prompt, prompt_token_ids, sampling,
            IncrementalDetokenizer(self.tokenizer, prompt_token_ids, sampling.skip_special_tokens),
            logprobs=[] if sampling.logprobs is not None else None)

    def process(self, updates: list[RequestUpdate]) -> tuple[list[RequestState], list[tuple[str, str]]]:
        """Apply one step's updates. Returns (the requests that finished, the (request id, stop
        string) pairs the engine core must finish: a stop string matched)."""
        finished, stops = [], []
        for u in updates:
            st = self.requests.get(u.req_id)
            if st is None or st.finished:
                continue
            st.token_ids.append(u.token_id)
            st.num_cached_tokens = u.num_cached_tokens
            if st.logprobs is not None and u.logprobs is not None:
                st.logprobs.append(u.logprobs)
            new_text = st.detok.append([u.token_id])
            st.text += new_text
            st.finish_reason, st.stop_reason = u.finish_reason, u.stop_reason
            sp = st.sampling
            if sp.stop and st.finish_reason in (None, "length") and len(st.token_ids) >= sp.min_tokens:
                text, matched = check_stop_strings(st.text, len(new_text), sp.stop, sp.include_stop_str_in_output)
                if matched is not None:
                    st.text = text
                    if st.finish_reason is None:
                        stops.append((st.req_id, matched))
                    # (with the last allowed token the stop string still makes it a stop)
                    st.finish_reason, st.stop_reason = "stop", matched
            if st.finished:
                if not isinstance(st.stop_reason, str):
                    st.text += st.detok.flush()  # a held-back partial character, if any
                finished.append(st)
        return finished, stops

    def abort(self, req_id: str) -> None:
        st = self.requests.get(req_id)
        if st is not None and not st.finished:
            st.finish_reason = "abort"

    def pop(self, req_id: str) -> RequestState | None:
        return self.requests.pop(req_id, None)
