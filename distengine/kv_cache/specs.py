"""What one layer keeps in the KV cache, and how much of it a request needs.

Every spec here answers two questions the rest of the manager asks: how many bytes one page of
this layer takes (`page_size_bytes`), and which block indices of a request's table must hold real
memory once `num_computed_tokens` tokens are computed (`first_needed_block`). Blocks before that
index can go back to the pool; their table entries become the null block.
"""
from __future__ import annotations

from dataclasses import dataclass


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class KVCacheSpec:
    """Base: paged attention K and V of one layer on one tensor-parallel rank."""

    block_size: int
    bytes_per_token: int  # K + V, this rank's KV heads, one layer

    kind = "abstract"
    # Whether blocks of this kind may be found again by their hash.
    cacheable = True

    @property
    def page_size_bytes(self) -> int:
        return self.block_size * self.bytes_per_token

    def first_needed_block(self, num_computed_tokens: int) -> int:
        """Index of the first block the next query still reads; earlier blocks may be freed."""
        return 0

    def next_skip_at(self, num_skipped: int) -> float:
        """The smallest number of computed tokens at which `first_needed_block` exceeds
        `num_skipped` (inf: never)."""
        return float("inf")

    def blocks_held(self, num_tokens: int, num_encoder_tokens: int = 0) -> int:
        """Real (non-null) blocks a request holds once `num_tokens` tokens are computed."""
        if num_tokens <= 0:
            return 0
        return (num_tokens - 1) // self.block_size + 1 - self.first_needed_block(num_tokens)

    def peak_blocks(self, max_len: int, chunk: int) -> int:
        """The most real blocks a request of up to `max_len` tokens holds at once when its prompt
        is computed in chunks of up to `chunk` tokens (a chunk's K/V are written before anything
        leaves a window)."""
        return self.blocks_held(max_len)

    def describe(self) -> str:
        return self.kind

    def with_block_size(self, block_size: int) -> "KVCacheSpec":
        return type(self)(**{**self.__dict__, "block_size": block_size})


@dataclass(frozen=True)
class FullAttentionSpec(KVCacheSpec):
    kind = "full_attention"


@dataclass(frozen=True)
class SlidingWindowSpec(KVCacheSpec):
    """A query at position p reads keys p-window+1 .. p."""

    window: int = 0
    kind = "sliding_window"

    def __post_init__(self) -> None:
        if self.window < 1:
            raise ValueError(f"sliding window must be >= 1, got {self.window}")

    def first_needed_block(self, num_computed_tokens: int) -> int:
        # The next query (position num_computed_tokens) reads the last window-1 computed tokens.
        return max(0, num_computed_tokens - self.window + 1) // self.block_size

    def next_skip_at(self, num_skipped: int) -> float:
        return (num_skipped + 1) * self.block_size + self.window - 1

    def peak_blocks(self, max_len: int, chunk: int) -> int:
        # The chunk's blocks and those its first query still reads (vLLM's bound).
        return min(cdiv(max_len, self.block_size), cdiv(self.window - 1 + min(chunk, max_len), self.block_size) + 1)

    def describe(self) -> str:
        return f"sliding_window(window={self.window})"


@dataclass(frozen=True)
class ChunkedLocalAttentionSpec(KVCacheSpec):
    """Llama-4's local layers: a query at position p reads keys of its own chunk, p // chunk."""

    chunk: int = 0
    kind = "chunked_local"

    def __post_init__(self) -> None:
        if self.chunk < 1:
            raise ValueError(f"attention chunk must be >= 1, got {self.chunk}")

    def first_needed_block(self, num_computed_tokens: int) -> int:
        return (num_computed_tokens // self.chunk) * self.chunk // self.block_size

    def next_skip_at(self, num_skipped: int) -> float:
        return cdiv((num_skipped + 1) * self.block_size, self.chunk) * self.chunk

    def peak_blocks(self, max_len: int, chunk: int) -> int:
        return min(cdiv(max_len, self.block_size), cdiv(self.chunk - 1 + min(chunk, max_len), self.block_size) + 1)

    def describe(self) -> str:
        return f"chunked_local(chunk={self.chunk})"


@dataclass(frozen=True)
class MambaSpec(KVCacheSpec):
    """A recurrent state of fixed size per request, whatever its length.

    A state fills `pages` consecutive pages (slots) of one block. A request's table has an entry
    per block of tokens: the entry of the block holding its last computed token keeps the
    running state; the entry of an earlier block, while not null, keeps the state at that
    block's end (a checkpoint), which a later prefix hit restores. Which block ends get a
    checkpoint is the manager's choice (`checkpoint_interval`, see MambaManager).
    """

    state_bytes: int = 0  # conv + SSM state of one layer on one rank
    page_bytes: int = 0  # one page (the attention page size)
    pages: int = 1  # pages one state spans
    checkpoint_interval: int = 0  # keep the state every this many tokens (0: only where needed)
    kind = "mamba"

    @property
    def page_size_bytes(self) -> int:
        return self.page_bytes or self.state_bytes

    def first_needed_block(self, num_computed_tokens: int) -> int:
        # Only the page holding the state after the last computed token is read.
        return max(0, num_computed_tokens - 1) // self.block_size

    def next_skip_at(self, num_skipped: int) -> float:
        return (num_skipped + 1) * self.block_size + 1

    def describe(self) -> str:
        pages = f", {self.pages} pages" if self.pages > 1 else ""
        return f"mamba(state={self.state_bytes}B{pages})"


@dataclass(frozen=True)
class CrossAttentionSpec(KVCacheSpec):
    """Encoder tokens' K and V, written once per request and never shared by prefix caching."""

    kind = "cross_attention"
    cacheable = False

    def blocks_held(self, num_tokens: int, num_encoder_tokens: int = 0) -> int:
        return cdiv(num_encoder_tokens, self.block_size)
