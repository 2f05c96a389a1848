"""The server's log (logger `distengine.serve`, INFO, on stdout under `distengine serve`), and in
it vLLM's `--enable-log-requests` line: one per request the engine gets, with its id, its prompt
and prompt token ids cut to `--max-log-len`, and its sampling params."""
from __future__ import annotations

import logging
from dataclasses import dataclass

LOGGER = logging.getLogger("distengine.serve")


@dataclass(frozen=True)
class RequestLogger:
    max_log_len: int | None = None  # None: the whole prompt

    def log(self, request_id: str, prompt: str | None, token_ids: list[int], params) -> None:
        n = self.max_log_len
        if n is not None:
            prompt = None if prompt is None else prompt[:n]
            token_ids = token_ids[:n]
        LOGGER.info("Received request %s: prompt: %r, params: %s, prompt_token_ids: %s.", request_id, prompt, params,
                    token_ids)
