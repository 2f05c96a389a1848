"""A request as the scheduler and the KV cache manager see it."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    cache_salt: str | None = None
    # Encoder-decoder models: tokens that the cross-attention layers keep per request.
    num_encoder_tokens: int = 0
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    # Chained hashes of the full blocks of all_token_ids, filled in by the KV cache manager.
    block_hashes: list[int] = field(default_factory=list)
    # Tokens sampled in steps still running (overlapped scheduling): their positions may be
    # computed in the next step before their values reach the host; they are never hashed.
    num_output_placeholders: int = 0

    def __post_init__(self) -> None:
        if not self.all_token_ids:
            self.all_token_ids = list(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_known_computed_tokens(self) -> int:
        """Computed tokens whose values are known (what may be hashed and cached)."""
        return min(self.num_computed_tokens, len(self.all_token_ids))

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[len(self.prompt_token_ids):]

    def append_output_token(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)
