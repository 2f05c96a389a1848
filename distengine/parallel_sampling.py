"""Several completions of one prompt (`n`, `best_of`) on the prompt's shared blocks.

A front end (`LLM`, `AsyncLLM`) turns such a request into plain ones: first a hidden request
computes the prompt's whole blocks up to the fork point (`fork_point`: every child keeps at
least its last prompt token, whose logits it samples), once; then `best_of` children, each the
whole prompt with its own seed, find those blocks in the prefix cache (the attention groups'
pages, and a Mamba or Gated DeltaNet state kept at that block boundary, which a child's first
step copies into a page of its own) and compute only the prompt's tail. So the prompt's blocks
are shared by reference counts, as forked block tables would share them, and each child writes
only pages of its own; where a copy-on-write fork would copy the last partial block, a child
recomputes those few tokens (fewer than a block), through the same prefix-hit path every
request takes. Aborting the request aborts every child; each child's blocks are its own to free.

With prefix caching off the children compute the whole prompt each. With `best_of` > n the
children's cumulative logprobs (taken even when the caller asked for none) pick the n returned,
highest first, as vLLM does.
"""
from __future__ import annotations

from dataclasses import replace

from distengine.outputs import CompletionOutput
from distengine.sampling_params import SamplingParams

__all__ = ["fork_point", "prefix_params", "child_params", "choose"]


def fork_point(num_prompt_tokens: int, block_size: int) -> int:
    """Tokens the hidden request computes: the whole blocks before the prompt's last token."""
    return (num_prompt_tokens - 1) // block_size * block_size


def prefix_params() -> SamplingParams:
    """The hidden request's: its one sampled token is dropped."""
    return SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


def child_params(sp: SamplingParams, index: int) -> SamplingParams:
    """The `index`-th child's: one completion, its own seed (the request's + index, as vLLM's),
    and the sampled tokens' logprobs when `best_of` ranks the children."""
    child = replace(sp.clone(), n=1, best_of=None)
    child.bad_words_token_ids = sp.bad_words_token_ids  # (the front end's, not a field replace copies)
    if sp.seed is not None:
        child.seed = sp.seed + index
    if sp.ranks_children and sp.logprobs is None:
        child.logprobs = 0
    return child


def choose(outputs: list[CompletionOutput], sp: SamplingParams) -> list[CompletionOutput]:
    """The request's n completions out of its children's (in child order, or the n of highest
    cumulative logprob when best_of > n), indexed 0 .. n-1; logprobs only if the caller asked."""
    if sp.ranks_children:
        outputs = sorted(outputs, key=_cumulative_logprob, reverse=True)[:sp.n]
    out = []
    for i, c in enumerate(outputs):
        c = replace(c, index=i)
        if sp.logprobs is None:
            c = replace(c, logprobs=None, cumulative_logprob=None)
        out.append(c)
    return out


def _cumulative_logprob(c: CompletionOutput) -> float:
    """Its sampled tokens' logprobs summed (a streamed completion's deltas carry no sum)."""
    if c.cumulative_logprob is not None:
        return c.cumulative_logprob
    if c.logprobs is None:  # aborted before it started
        return float("-inf")
    return sum(d[t] for d, t in zip(c.logprobs, c.token_ids))
