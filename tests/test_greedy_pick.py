"""The greedy pick-and-record kernel against its torch reference (torch's argmax and the batch's
index writes), on CPU under TRITON_INTERPRET=1 and natively on a GPU."""
from __future__ import annotations

import pytest
import torch

from kernels.greedy_pick import BLOCK_V, MAX_SPLITS, greedy_pick, greedy_pick_ref, greedy_splits
from workers.sampler import SamplingTensors
from distengine.step import RequestSampling

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ROWS = 12  # batch rows


def state(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """last_token poisoned, output counts random."""
    g = torch.Generator().manual_seed(seed)
    return (torch.full((ROWS,), -7, dtype=torch.int64, device=DEVICE),
            torch.randint(0, 100, (ROWS,), generator=g).to(DEVICE))


def both(logits: torch.Tensor, rows: torch.Tensor, seed: int = 0):
    """(tokens, last_token, counts) from the kernel and from the reference."""
    got = state(seed)
    want = state(seed)
    return ((greedy_pick(logits, rows, *got), *got), (greedy_pick_ref(logits, rows, *want), *want))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("n,vocab", [(1, 7), (1, 5 * BLOCK_V + 3), (3, 70_000), (ROWS, 2 * BLOCK_V)])
def test_greedy_pick_equals_argmax_and_records(dtype, n, vocab):
    """Random logits (ties likely in 16 bits), rows in random order: the tokens, every row's last
    token and count equal the reference's; rows that did not sample are left as they were."""
    g = torch.Generator().manual_seed(n * vocab)
    logits = (torch.randn(n, vocab, generator=g) * 3).to(DEVICE, dtype)
    rows = torch.randperm(ROWS, generator=g)[:n].to(DEVICE, torch.int32)
    (tok, last, count), (want_tok, want_last, want_count) = both(logits, rows, seed=n)
    assert torch.equal(tok, want_tok) and tok.dtype == torch.int64
    assert torch.equal(last, want_last) and torch.equal(count, want_count)
    untouched = torch.ones(ROWS, dtype=torch.bool)
    untouched[rows.long().cpu()] = False
    assert (last.cpu()[untouched] == -7).all()


def test_ties_nan_and_infinities():
    """Equal maxima in different ranges, in one lane on different tiles, and within a tile: the
    lowest position wins; a NaN is the largest (the first of several); a row of -inf names 0."""
    vocab = 9 * BLOCK_V + 5
    logits = torch.randn(6, vocab, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    logits[0, [8 * BLOCK_V + 1, 3 * BLOCK_V + 1, 7 * BLOCK_V]] = 50.0  # in different ranges
    logits[1, [2 * BLOCK_V + 5, BLOCK_V + 5]] = 50.0  # one lane, two tiles
    logits[2, [vocab - 1, 17, 16]] = 50.0
    logits[3, [40, 900, 5 * BLOCK_V]] = float("nan")
    logits[3, 41] = float("inf")
    logits[4] = float("-inf")
    logits[5, vocab - 1] = 50.0  # the last position, in a partial tile
    rows = torch.arange(6, dtype=torch.int32, device=DEVICE)
    (tok, last, count), (want_tok, _, want_count) = both(logits, rows)
    assert tok.tolist() == [3 * BLOCK_V + 1, BLOCK_V + 5, 16, 40, 0, vocab - 1] == want_tok.tolist()
    assert torch.equal(last[:6], tok) and torch.equal(count, want_count)


def test_splits_rule():
    for rows, vocab in [(1, 262_208), (1, 5), (64, 151_936), (1024, 248_320), (3, 10 * BLOCK_V)]:
        s = greedy_splits(rows, vocab, 132)
        assert s & (s - 1) == 0 and 1 <= s <= MAX_SPLITS
        assert s == 1 or (s // 2) * BLOCK_V < vocab, (rows, vocab, s)  # every range but the last has logits
    assert greedy_splits(1, 262_208, 132) == 256 and greedy_splits(1024, 248_320, 132) == 1


@pytest.mark.parametrize("impl", [greedy_pick, greedy_pick_ref], ids=["triton", "torch"])
def test_bad_arguments(impl):
    logits = torch.zeros(2, 10, device=DEVICE)
    last, count = state(0)
    rows = torch.tensor([0, 1], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="rows must be \\[2\\]"):
        impl(logits, rows[:1], last, count)
    with pytest.raises(TypeError, match="rows must be int32 or int64"):
        impl(logits, rows.float(), last, count)
    with pytest.raises(ValueError, match="logits must be \\[rows, vocab\\]"):
        impl(logits[0], rows, last, count)
    with pytest.raises(ValueError, match="one \\[R\\] each"):
        impl(logits, rows, last, count[:3])
    assert impl(logits[:0], rows[:0], last, count).shape == (0,)


def test_which_steps_take_the_pick():
    """Greedy rows with nothing else asked take it; logprobs, penalties or sampling do not."""
    def tensors(*params: RequestSampling) -> SamplingTensors:
        return SamplingTensors.build(list(params), [[1]] * len(params), [[]] * len(params), 16, DEVICE)
    greedy = RequestSampling(temperature=0.0)
    assert tensors(greedy, greedy).argmax_only
    assert not tensors(greedy, RequestSampling(temperature=0.0, logprobs=0)).argmax_only
    assert not tensors(greedy, RequestSampling(temperature=0.0, presence_penalty=0.5)).argmax_only
    assert not tensors(greedy, RequestSampling(temperature=1.0)).argmax_only
