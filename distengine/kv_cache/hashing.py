"""Chained 128-bit block hashes.

hash(block i) = xxh3_128(hash(block i-1) | token ids of block i | extra keys), full blocks only.
The seed and the root are constants, so the same tokens hash the same in every process, on every
rank and after a restart (Python's `hash()` is salted per process, so it cannot be used).
"""
from __future__ import annotations

from array import array
from collections.abc import Sequence

import xxhash

HASH_SEED = 0x6469_7374  # "dist"
ROOT_HASH = 0
_xxh3_128 = xxhash.xxh3_128_intdigest


def hash_block(parent: int, token_ids: Sequence[int], extra: bytes = b"") -> int:
    data = parent.to_bytes(16, "little") + array("q", token_ids).tobytes() + extra
    return _xxh3_128(data, seed=HASH_SEED)


def extra_key_bytes(cache_salt: str | None) -> bytes:
    # Tagged so that a salt can never collide with token bytes of an unsalted block.
    return b"" if cache_salt is None else b"\x00salt:" + cache_salt.encode()


def extend_block_hashes(hashes: list[int], token_ids: Sequence[int], block_size: int,
                        cache_salt: str | None = None, num_tokens: int | None = None) -> list[int]:
    """Append the hashes of the full blocks among the first `num_tokens` tokens (all by
    default) that are not hashed yet."""
    num_full = (len(token_ids) if num_tokens is None else num_tokens) // block_size
    parent = hashes[-1] if hashes else ROOT_HASH
    for i in range(len(hashes), num_full):
        # The salt enters the first block only: chaining carries it into every later block.
        extra = extra_key_bytes(cache_salt) if i == 0 else b""
        parent = hash_block(parent, token_ids[i * block_size:(i + 1) * block_size], extra)
        hashes.append(parent)
    return hashes
