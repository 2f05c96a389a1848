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
    req_id: str  # the engine's id of the request
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
    # Streaming: what earlier deltas carried; the times the latency metrics need.
    sent_text: int = 0
    sent_tokens: int = 0
    arrival_time: float = 0.0
    first_token_time: float | None = None
    last_token_time: float | None = None
    last_gap: float | None = None  # seconds between its last two tokens
    output_id: str | None = None  # the id its outputs carry, when not req_id (AsyncLLM: the caller's)
    prompt_logprobs: list[dict[int, float] | None] | None = None
    prompt_ranks: list[int | None] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def delta(self) -> RequestOutput:
        """What came since the last delta (vLLM's RequestOutputKind.DELTA). While running, the text
        keeps back as many characters as a stop string could still need (so a stop string never
        reaches the client), and the held-back text follows later."""
        end = len(self.text) if self.finished else max(self.sent_text,
                                                         len(self.text) - self.sampling.output_text_buffer_length)
        text, tokens = self.text[self.sent_text:end], self.token_ids[self.sent_tokens:]
        lps = self.logprobs[self.sent_tokens:] if self.logprobs is not None else None
        first = self.sent_tokens == 0
        self.sent_text, self.sent_tokens = end, len(self.token_ids)
        comp = CompletionOutput(index=0, text=text, token_ids=tokens, finish_reason=self.finish_reason,
                                stop_reason=self.stop_reason, logprobs=lps)
        return RequestOutput(request_id=self.output_id or self.req_id, prompt=self.prompt, prompt_token_ids=self.prompt_token_ids,
                             num_cached_tokens=self.num_cached_tokens, finished=self.finished, outputs=[comp],
                             prompt_logprobs=self.prompt_logprobs if first else None,
                             prompt_logprob_ranks=self.prompt_ranks if first else None)

    def output(self) -> RequestOutput:
        comp = CompletionOutput(index=0, text=self.text, token_ids=list(self.token_ids), finish_reason=self.finish_reason,
                                stop_reason=self.stop_reason, logprobs=self.logprobs,
                                cumulative_logprob=(sum(d[t] for d, t in zip(self.logprobs, self.token_ids))
                                                    if self.logprobs is not None else None))
        return RequestOutput(request_id=self.output_id or self.req_id, prompt=self.prompt, prompt_token_ids=self.prompt_token_ids,
                             num_cached_tokens=self.num_cached_tokens, finished=self.finished, outputs=[comp],
                             prompt_logprobs=self.prompt_logprobs, prompt_logprob_ranks=self.prompt_ranks)


@dataclass
class ProcessedStep:
    """What a step's updates did to the requests: those that finished, the (request id, stop
    string) pairs the engine must finish, those that failed here (the engine must abort them),
    and every request updated."""
    finished: list[RequestState] = field(default_factory=list)
    stops: list[tuple[str, str]] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    touched: list[RequestState] = field(default_factory=list)


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, RequestState] = {}

    def add_request(self, req_id: str, prompt: str | None, prompt_token_ids: list[int],
                    sampling: SamplingParams, arrival_time: float = 0.0, output_id: str | None = None) -> RequestState:
        st = RequestState(req_id, prompt, prompt_token_ids, sampling,
                          IncrementalDetokenizer(self.tokenizer, prompt_token_ids, sampling.skip_special_tokens),
                          logprobs=[] if sampling.logprobs is not None else None, arrival_time=arrival_time,
                          output_id=output_id)
        self.requests[req_id] = st
        return st

    def process(self, updates: list[RequestUpdate], now: float = 0.0) -> ProcessedStep:
        """Apply one step's updates. A request whose update cannot be applied here (its text
        cannot be decoded, ...) ends with finish_reason "error"; the others go on."""
        out = ProcessedStep()
        for u in updates:
            st = self.requests.get(u.req_id)
            if st is None or st.finished:
                continue
            out.touched.append(st)
            try:
                matched = self._apply(st, u, now)
            except Exception as e:  # noqa: BLE001 - this request fails, the step's others go on
                st.finish_reason, st.stop_reason = "error", f"{type(e).__name__}: {e}"
                out.failed.append(st.req_id)
                matched = None
            if matched is not None:
                out.stops.append((st.req_id, matched))
            if st.finished:
                out.finished.append(st)
        return out

    def _apply(self, st: RequestState, u: RequestUpdate, now: float) -> str | None:
        """One update of one request; the stop string the engine must finish it for, if any."""
        if u.failed:  # the driver could not serve it: no token, the message in stop_reason
            st.finish_reason, st.stop_reason = u.finish_reason, u.stop_reason
            return None
        if st.last_token_time is None:
            st.first_token_time = now
        else:
            st.last_gap = now - st.last_token_time
        st.last_token_time = now
        st.token_ids.append(u.token_id)
        st.num_cached_tokens = u.num_cached_tokens
        if u.prompt_logprobs is not None:
            st.prompt_logprobs, st.prompt_ranks = u.prompt_logprobs, u.prompt_ranks
        if st.logprobs is not None and u.logprobs is not None:
            st.logprobs.append(u.logprobs)
        new_text = st.detok.append([u.token_id])
        st.text += new_text
        st.finish_reason, st.stop_reason = u.finish_reason, u.stop_reason
        sp, stop = st.sampling, None
        if sp.stop and st.finish_reason in (None, "length") and len(st.token_ids) >= sp.min_tokens:
            text, matched = check_stop_strings(st.text, len(new_text), sp.stop, sp.include_stop_str_in_output)
            if matched is not None:
                st.text = text
                if st.finish_reason is None:
                    stop = matched
                # (with the last allowed token the stop string still makes it a stop)
                st.finish_reason, st.stop_reason = "stop", matched
        if st.finished and not isinstance(st.stop_reason, str):
            st.text += st.detok.flush()  # a held-back partial character, if any
        return stop

    def abort(self, req_id: str) -> None:
        st = self.requests.get(req_id)
        if st is not None and not st.finished:
            st.finish_reason = "abort"

    def pop(self, req_id: str) -> RequestState | None:
        return self.requests.pop(req_id, None)
