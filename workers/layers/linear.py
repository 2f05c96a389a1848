"""Column- and row-parallel linear layers.

Each parameter carries a `weight_loader(param, full_tensor, shard=None)` that takes the
checkpoint's full tensor and copies only this rank's slice, so no rank holds the whole model.
Fused layers (QKV, gate/up) take each checkpoint tensor with the name of the part it fills.
"""
from __future__ import annotations

import torch
from torch import nn

from workers.ops import linear_op
from workers.parallel import TPGroup, kv_head_share, split_evenly


def _check_shape(name: str, got: torch.Size, want: tuple[int, ...]) -> None:
    if tuple(got) != tuple(want):
        raise ValueError(f"{name}: checkpoint tensor has shape {tuple(got)}, expected {tuple(want)}")


class _ParallelLinear(nn.Module):
    in_features: int
    out_features: int
    bias: nn.Parameter | None

    def full_shapes(self) -> dict[str, tuple[int, ...]]:
        """Shapes of the unsharded checkpoint tensors."""
        out = {"weight": (self.out_features, self.in_features)}
        if self.bias is not None:
            out["bias"] = (self.out_features,)
        return out


class ColumnParallelLinear(_ParallelLinear):
    """y = x W^T, W split by output rows; each rank keeps its slice of the output."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPGroup, dtype: torch.dtype,
                 device: torch.device, name: str = "") -> None:
        super().__init__()
        self.tp, self.name, self.in_features, self.out_features = tp, name, in_features, out_features
        start, size = split_evenly(out_features, tp, f"{name} output features")
        self.out_start, self.out_size = start, size
        self.weight = nn.Parameter(torch.empty(size, in_features, dtype=dtype, device=device), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(size, dtype=dtype, device=device), requires_grad=False) if bias else None

    def weight_loader(self, param: nn.Parameter, full: torch.Tensor, shard: str | None = None) -> None:
        _check_shape(self.name, full.shape, (self.out_features,) + tuple(param.shape[1:]))
        param.data.copy_(full.narrow(0, self.out_start, self.out_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear_op(x, self.weight, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs in one matrix (gate and up): each part is split on its own,
    so rank r holds [gate_r | up_r]."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool, tp: TPGroup, dtype: torch.dtype,
                 device: torch.device, name: str = "") -> None:
        for i, n in enumerate(output_sizes):
            split_evenly(n, tp, f"{name} part {i}")
        super().__init__(in_features, sum(output_sizes), bias, tp, dtype, device, name)
        self.output_sizes = output_sizes

    def part_shapes(self, shard: int) -> tuple[int, ...]:
        return (self.output_sizes[shard], self.in_features)

    def weight_loader(self, param, full, shard=None):
        idx = int(shard)
        n = self.output_sizes[idx]
        _check_shape(f"{self.name}[{idx}]", full.shape, (n,) + tuple(param.shape[1:]))
        size = n // self.tp.world_size
        offset = sum(s // self.tp.world_size for s in self.output_sizes[:idx])
        param.data.narrow(0, offset, size).copy_(full.narrow(0, self.tp.rank * size, size))


class QKVParallelLinear(ColumnParallelLinear):
    """Q, K and V projections in one matrix: query heads split across ranks, KV heads split or,
    when tp exceeds them, replicated (ranks r*tp/heads .. share head r).

    `q_gate` (Qwen3-Next's gated attention): the checkpoint's q_proj gives each head [query |
    gate]; a rank's rows are laid out [its queries | its gates], so that the query and the gate
    are each one slice of the output (`split` returns the gates as a fourth part).

    `kv_parts`: 2 (K and V), 1 (K only: the values are the keys' projection, Gemma 4's
    `attention_k_eq_v`; `split` returns k as v too) or 0 (queries only: a layer reading another
    layer's K/V; `split` returns None for k and v). A part the layer lacks has no checkpoint shape."""

    def __init__(self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool, tp: TPGroup,
                 dtype: torch.dtype, device: torch.device, name: str = "", q_gate: bool = False,
                 kv_parts: int = 2) -> None:
        q_start, q_heads = split_evenly(num_heads, tp, f"{name} query heads")
        kv_start, kv_heads = kv_head_share(num_kv_heads, tp)
        self.head_dim, self.num_heads, self.num_kv_heads = head_dim, num_heads, num_kv_heads
        self.q_start, self.q_heads, self.kv_start, self.kv_heads = q_start, q_heads, kv_start, kv_heads
        self.q_parts = 2 if q_gate else 1  # rows per query head, in head_dim units
        assert kv_parts in (0, 1, 2), kv_parts
        self.kv_parts = kv_parts
        nn.Module.__init__(self)
        self.tp, self.name, self.in_features = tp, name, hidden
        self.out_features = (self.q_parts * num_heads + kv_parts * num_kv_heads) * head_dim
        size = (self.q_parts * q_heads + kv_parts * kv_heads) * head_dim
        self.weight = nn.Parameter(torch.empty(size, hidden, dtype=dtype, device=device), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(size, dtype=dtype, device=device), requires_grad=False) if bias else None

    def has_part(self, shard: str) -> bool:
        return {"q": True, "k": self.kv_parts >= 1, "v": self.kv_parts == 2}[shard]

    def part_shapes(self, shard: str) -> tuple[int, ...] | None:
        if not self.has_part(shard):
            return None
        heads = self.q_parts * self.num_heads if shard == "q" else self.num_kv_heads
        return (heads * self.head_dim, self.in_features)

    def weight_loader(self, param, full, shard=None):
        d = self.head_dim
        q_rows = self.q_parts * self.q_heads
        heads, start, count, offset = {
            "q": (self.q_parts * self.num_heads, self.q_start, self.q_heads, 0),
            "k": (self.num_kv_heads, self.kv_start, self.kv_heads, q_rows),
            "v": (self.num_kv_heads, self.kv_start, self.kv_heads, q_rows + self.kv_heads),
        }[shard]
        if not self.has_part(shard):
            raise ValueError(f"{self.name}: this layer has no {shard}_proj (its checkpoint should not have one)")
        _check_shape(f"{self.name}[{shard}]", full.shape, (heads * d,) + tuple(param.shape[1:]))
        if shard == "q" and self.q_parts == 2:
            # [query | gate] per head in the checkpoint -> [queries | gates] on this rank.
            mine = full.unflatten(0, (self.num_heads, 2, d)).narrow(0, start, count)
            param.data.narrow(0, 0, 2 * count * d).copy_(mine.transpose(0, 1).flatten(0, 2))
            return
        param.data.narrow(0, offset * d, count * d).copy_(full.narrow(0, start * d, count * d))

    def split(self, qkv: torch.Tensor):
        """(q, k, v), or (q, k, v, gate) with `q_gate`."""
        d = self.head_dim
        n = self.q_heads * d
        if self.q_parts == 2:
            q, gate, k, v = qkv.split([n, n, self.kv_heads * d, self.kv_heads * d], dim=-1)
            return q, k, v, gate
        if self.kv_parts == 0:
            return qkv, None, None
        if self.kv_parts == 1:
            q, k = qkv.split([n, self.kv_heads * d], dim=-1)
            return q, k, k
        return qkv.split([n, self.kv_heads * d, self.kv_heads * d], dim=-1)


class RowParallelLinear(_ParallelLinear):
    """y = x W^T with W split by input columns: partial sums all-reduced across ranks (the one
    collective after attention and after the MLP); the bias is added once, after the sum."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPGroup, dtype: torch.dtype,
                 device: torch.device, name: str = "", reduce: bool = True) -> None:
        super().__init__()
        self.tp, self.name, self.in_features, self.out_features, self.reduce = tp, name, in_features, out_features, reduce
        self.in_start, self.in_size = split_evenly(in_features, tp, f"{name} input features")
        self.weight = nn.Parameter(torch.empty(out_features, self.in_size, dtype=dtype, device=device),
                                   requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype, device=device), requires_grad=False) \
            if bias else None

    def weight_loader(self, param: nn.Parameter, full: torch.Tensor, shard: str | None = None) -> None:
        if param.dim() == 1:  # bias: replicated
            _check_shape(self.name, full.shape, (self.out_features,))
            param.data.copy_(full)
            return
        _check_shape(self.name, full.shape, (self.out_features, self.in_features))
        param.data.copy_(full.narrow(1, self.in_start, self.in_size))

    def defer_reduce(self) -> None:
        """The caller all-reduces the output itself, at once (fused with what follows): the
        product is still written where the all-reduce reads it."""
        if self.bias is not None:
            raise ValueError(f"{self.name}: a bias is added after the all-reduce; it cannot be deferred")
        self.reduce, self.deferred = False, True

    deferred = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = None
        if (self.reduce or self.deferred) and x.dim() == 2:
            out = self.tp.reduce_buffer(x.shape[0], self.out_features, x.dtype, x.device)
        y = linear_op(x, self.weight, out=out)
        if self.reduce:
            y = self.tp.all_reduce(y)
        return y + self.bias if self.bias is not None else y
