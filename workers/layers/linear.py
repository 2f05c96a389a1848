"""Column- and row-parallel linear layers.

Each parameter carries a `weight_loader(param, full_tensor, shard=None)` that takes the
checkpoint's full tensor and copies only this rank's slice, so no rank holds the whole model.
Fused layers (QKV, gate/up) take each checkpoint tensor with the name of the part it fills.

FP8 checkpoints (`distengine.quantization`): a linear the checkpoint quantizes holds its weight
as stored (float8_e4m3fn) and an fp32 scale parameter under the checkpoint's name
(`weight_scale_inv` or `weight_scale`), which shards with the weight: block scales with their
blocks (a split that cuts a block is refused when the layer is built), per-channel scales with
the output rows. Per-tensor scales become per-row ones, each part of a fused layer keeping its
own: exact, where taking the parts' largest scale (vLLM) would requantize the others; it costs
4 bytes per output row. The loader builds a model inside `quantized_linears(config)`.
"""
from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch
from torch import nn

from distengine.quantization import BLOCK, CHANNEL, QuantizationConfig
from kernels.fp8 import FP8_DTYPE, scale_shape
from kernels.gated_rmsnorm import GatedRMSNorm
from workers.ops import fp8_linear_op, linear_op
from workers.parallel import TPGroup, kv_head_share, split_evenly

_QUANTIZATION: ContextVar[QuantizationConfig | None] = ContextVar("linear_quantization", default=None)
# A merged layer's checkpoint parts, by the fused name's last component (QKV names its own).
_PARTS = {"gate_up_proj": ("gate_proj", "up_proj")}


@contextmanager
def quantized_linears(quant: QuantizationConfig | None):
    """Linear layers built inside take their FP8 layout from `quant` (None: unquantized)."""
    token = _QUANTIZATION.set(quant)
    try:
        yield
    finally:
        _QUANTIZATION.reset(token)


def linear_quantization() -> QuantizationConfig | None:
    """The quantization that linear layers built now take (models that reorder weight rows
    refuse FP8 with it)."""
    return _QUANTIZATION.get()


def refuse_fp8(family: str, why: str) -> None:
    """A model family whose layers FP8 does not serve yet refuses an FP8 checkpoint, saying why
    (the other quantizations are refused before any model is built)."""
    if linear_quantization() is not None:
        raise ValueError(f"{family}: FP8 checkpoints are not supported yet ({why})")


@dataclass(frozen=True)
class Fp8Layout:
    """How an FP8 linear keeps its scales: `scale_name` (the checkpoint's tensor name), `block`
    (bn, bk) or None for one scale per output row, and the checkpoint's strategy (the shape of
    its scale tensors)."""
    scale_name: str
    block: tuple[int, int] | None
    strategy: str

    @classmethod
    def of(cls, quant: QuantizationConfig) -> "Fp8Layout":
        return cls(quant.scale_name, quant.block_size if quant.strategy == BLOCK else None, quant.strategy)

    def checkpoint_shape(self, rows: int, cols: int) -> tuple[int, ...]:
        """The checkpoint's scale tensor of one [rows, cols] weight: the block grid, [rows, 1] per
        channel, or [] per tensor."""
        if self.block is not None:
            return scale_shape(rows, cols, self.block)
        return (rows, 1) if self.strategy == CHANNEL else ()


def block_rows(label: str, dst: int, src: torch.Tensor, rows: int, weight_rows: int, block: tuple[int, int],
               tp_size: int) -> tuple[int, torch.Tensor]:
    """A row map (the first row `dst` of a weight of `weight_rows` that a checkpoint part of `rows`
    rows fills, from its rows `src`, in order) in scale blocks: (the first block row it fills,
    the part's block rows it takes). The rows taken must be whole aligned blocks (a part's last,
    partial block may end the weight), else a ValueError naming `label`."""
    bn = block[0]
    n = len(src)
    starts = src[::bn]
    whole = (dst % bn == 0 and bool((starts % bn == 0).all())
             and torch.equal(src, (starts[:, None] + torch.arange(bn)).flatten()[:n])
             and (n % bn == 0 or (int(src[-1]) == rows - 1 and dst + n == weight_rows)))
    if not whole:
        raise ValueError(f"{label}: this rank's {n} of {rows} output rows cut the checkpoint's {block} FP8 scale "
                         f"blocks (tensor-parallel size {tp_size}); use a tensor-parallel size whose share is whole "
                         f"blocks")
    return dst // bn, starts // bn


def _check_shape(name: str, got: torch.Size, want: tuple[int, ...]) -> None:
    if tuple(got) != tuple(want) and not (want == () and got.numel() == 1):  # per-tensor scales: [] or [1]
        raise ValueError(f"{name}: checkpoint tensor has shape {tuple(got)}, expected {tuple(want)}")


class _ParallelLinear(nn.Module):
    in_features: int
    out_features: int
    bias: nn.Parameter | None
    fp8: Fp8Layout | None = None

    def _make_weight(self, rows: int, cols: int, dtype: torch.dtype, device: torch.device) -> None:
        """`weight` [rows, cols] in the model's dtype, or FP8 with its scale parameter when the
        checkpoint quantizes this layer (every part of a fused one, or none)."""
        quant = _QUANTIZATION.get()
        parts = self.part_names()
        quantized = [quant is not None and quant.quantizes(p) for p in parts]
        if any(quantized) and not all(quantized):
            raise ValueError(f"{self.name}: the quantization_config quantizes some of its parts "
                             f"({[p for p, q in zip(parts, quantized) if q]}) but not the others; "
                             f"they are one matrix here")
        if not any(quantized):
            self.weight = nn.Parameter(torch.empty(rows, cols, dtype=dtype, device=device), requires_grad=False)
            return
        assert quant is not None
        self.fp8 = Fp8Layout.of(quant)
        self.weight = nn.Parameter(torch.empty(rows, cols, dtype=FP8_DTYPE, device=device), requires_grad=False)
        scale = torch.empty(scale_shape(rows, cols, self.fp8.block), dtype=torch.float32, device=device)
        setattr(self, quant.scale_name, nn.Parameter(scale, requires_grad=False))

    def part_names(self) -> list[str]:
        """Our names of the checkpoint modules this layer holds."""
        head, _, last = self.name.rpartition(".")
        if last in _PARTS and self.n_parts() == len(_PARTS[last]):
            return [f"{head}.{p}" if head else p for p in _PARTS[last]]
        return [self.name]

    def n_parts(self) -> int:
        return 1

    @property
    def fp8_scale(self) -> torch.Tensor | None:
        return None if self.fp8 is None else getattr(self, self.fp8.scale_name)

    def _scale_shape(self, rows: int) -> tuple[int, ...]:
        """A checkpoint scale tensor of a part with `rows` output rows."""
        assert self.fp8 is not None
        return self.fp8.checkpoint_shape(rows, self.in_features)

    def _shapes(self, rows: int) -> dict[str, tuple[int, ...]]:
        out = {"weight": (rows, self.in_features)}
        if self.bias is not None:
            out["bias"] = (rows,)
        if self.fp8 is not None:
            out[self.fp8.scale_name] = self._scale_shape(rows)
        return out

    def full_shapes(self) -> dict[str, tuple[int, ...]]:
        """Shapes of the unsharded checkpoint tensors."""
        return self._shapes(self.out_features)

    def _matmul(self, x: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor | None = None,
                norm: GatedRMSNorm | None = None, gate: torch.Tensor | None = None, act=None) -> torch.Tensor:
        if self.fp8 is None:
            return linear_op(x, self.weight, bias, out=out, norm=norm, gate=gate, act=act)
        return fp8_linear_op(x, self.weight, self.fp8_scale, self.fp8.block, bias, out=out, norm=norm, gate=gate,
                             act=act)


class ColumnParallelLinear(_ParallelLinear):
    """y = x W^T, W split by output rows; each rank keeps its slice of the output.

    Subclasses say where each checkpoint part's rows go (`row_map`); one loader places the
    weight, the bias and the scales by it."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPGroup, dtype: torch.dtype,
                 device: torch.device, name: str = "") -> None:
        super().__init__()
        self.tp, self.name, self.in_features, self.out_features = tp, name, in_features, out_features
        start, size = split_evenly(out_features, tp, f"{name} output features")
        self.out_start, self.out_size = start, size
        self._build(size, bias, dtype, device)

    def _build(self, rows: int, bias: bool, dtype: torch.dtype, device: torch.device) -> None:
        self._make_weight(rows, self.in_features, dtype, device)
        self.bias = nn.Parameter(torch.empty(rows, dtype=dtype, device=device), requires_grad=False) if bias else None
        if self.fp8 is not None and self.fp8.block is not None:
            for shard in self.shards():  # a split that cuts a scale block is refused now, not at load
                self._block_rows(shard)

    def shards(self) -> list:
        return [None]

    def part_rows(self, shard) -> int:
        """Rows of a checkpoint part."""
        return self.out_features

    def row_map(self, shard) -> tuple[int, torch.Tensor]:
        """(first row of this rank's weight that the part fills, the part's rows it takes, in order)."""
        return 0, torch.arange(self.out_start, self.out_start + self.out_size)

    def _block_rows(self, shard) -> tuple[int, torch.Tensor]:
        dst, src = self.row_map(shard)
        return block_rows(f"{self.name}{'' if shard is None else f'[{shard}]'}", dst, src, self.part_rows(shard),
                          self.weight.shape[0], self.fp8.block, self.tp.world_size)

    def weight_loader(self, param: nn.Parameter, full: torch.Tensor, shard=None) -> None:
        rows = self.part_rows(shard)
        label = self.name if shard is None else f"{self.name}[{shard}]"
        if self.fp8 is not None and param is self.fp8_scale:
            _check_shape(label, full.shape, self._scale_shape(rows))
            if self.fp8.block is not None:
                dst, src = self._block_rows(shard)
                param.data.narrow(0, dst, len(src)).copy_(full.index_select(0, src.to(full.device)))
                return
            dst, src = self.row_map(shard)
            per_row = full.reshape(-1).expand(rows) if self.fp8.strategy != CHANNEL else full.reshape(-1)
            param.data.narrow(0, dst, len(src)).copy_(per_row.index_select(0, src.to(full.device)))
            return
        _check_shape(label, full.shape, (rows,) + tuple(param.shape[1:]))
        dst, src = self.row_map(shard)
        if torch.equal(src, torch.arange(int(src[0]), int(src[0]) + len(src))):
            param.data.narrow(0, dst, len(src)).copy_(full.narrow(0, int(src[0]), len(src)))
        else:
            param.data.narrow(0, dst, len(src)).copy_(full.index_select(0, src.to(full.device)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._matmul(x, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs in one matrix (gate and up): each part is split on its own,
    so rank r holds [gate_r | up_r]."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool, tp: TPGroup, dtype: torch.dtype,
                 device: torch.device, name: str = "") -> None:
        for i, n in enumerate(output_sizes):
            split_evenly(n, tp, f"{name} part {i}")
        self.output_sizes = output_sizes
        super().__init__(in_features, sum(output_sizes), bias, tp, dtype, device, name)

    def n_parts(self) -> int:
        return len(self.output_sizes)

    def shards(self) -> list:
        return list(range(len(self.output_sizes)))

    def part_shapes(self, shard: int) -> dict[str, tuple[int, ...]]:
        """Shapes of a part's checkpoint tensors (weight, bias, scales)."""
        return self._shapes(self.output_sizes[int(shard)])

    def part_rows(self, shard) -> int:
        return self.output_sizes[int(shard)]

    def row_map(self, shard) -> tuple[int, torch.Tensor]:
        idx = int(shard)
        size = self.output_sizes[idx] // self.tp.world_size
        offset = sum(s // self.tp.world_size for s in self.output_sizes[:idx])
        return offset, torch.arange(self.tp.rank * size, (self.tp.rank + 1) * size)


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
        self._build((self.q_parts * q_heads + kv_parts * kv_heads) * head_dim, bias, dtype, device)

    def has_part(self, shard: str) -> bool:
        return {"q": True, "k": self.kv_parts >= 1, "v": self.kv_parts == 2}[shard]

    def shards(self) -> list:
        return [shard for shard in ("q", "k", "v") if self.has_part(shard)]

    def part_names(self) -> list[str]:
        head = self.name.rpartition(".")[0]
        return [f"{head}.{shard}_proj" if head else f"{shard}_proj" for shard in self.shards()]

    def part_shapes(self, shard: str) -> dict[str, tuple[int, ...]] | None:
        """Shapes of a part's checkpoint tensors (weight, bias, scales); None for a part the layer lacks."""
        if not self.has_part(shard):
            return None
        return self._shapes(self.part_rows(shard))

    def part_rows(self, shard) -> int:
        if not self.has_part(shard):
            raise ValueError(f"{self.name}: this layer has no {shard}_proj (its checkpoint should not have one)")
        heads = self.q_parts * self.num_heads if shard == "q" else self.num_kv_heads
        return heads * self.head_dim

    def row_map(self, shard) -> tuple[int, torch.Tensor]:
        d = self.head_dim
        q_rows = self.q_parts * self.q_heads
        start, count, offset = {
            "q": (self.q_start, self.q_heads, 0),
            "k": (self.kv_start, self.kv_heads, q_rows),
            "v": (self.kv_start, self.kv_heads, q_rows + self.kv_heads),
        }[shard]
        if shard == "q" and self.q_parts == 2:
            # [query | gate] per head in the checkpoint -> [queries | gates] on this rank.
            heads = torch.arange(start, start + count)[:, None] * 2 * d
            within = torch.arange(d)[None, :]
            return 0, torch.cat([(heads + within).flatten(), (heads + d + within).flatten()])
        return offset * d, torch.arange(start * d, (start + count) * d)

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
    collective after attention and after the MLP). The bias joins the first rank's partial sum,
    inside its product (before the one rounding, as transformers' `F.linear`), so the sum holds
    it once and no launch adds it; the all-reduce can then be deferred as without one."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPGroup, dtype: torch.dtype,
                 device: torch.device, name: str = "", reduce: bool = True) -> None:
        super().__init__()
        self.tp, self.name, self.in_features, self.out_features, self.reduce = tp, name, in_features, out_features, reduce
        self.in_start, self.in_size = split_evenly(in_features, tp, f"{name} input features")
        self._make_weight(out_features, self.in_size, dtype, device)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype, device=device), requires_grad=False) \
            if bias else None
        if self.fp8 is not None and self.fp8.block is not None:
            bk = self.fp8.block[1]
            if self.in_start % bk or (self.in_size % bk and self.in_start + self.in_size != in_features):
                raise ValueError(f"{name}: this rank's {self.in_size} of {in_features} input columns cut the "
                                 f"checkpoint's {self.fp8.block} FP8 scale blocks (tensor-parallel size "
                                 f"{tp.world_size}); use a tensor-parallel size whose share is whole blocks")

    def weight_loader(self, param: nn.Parameter, full: torch.Tensor, shard: str | None = None) -> None:
        if self.fp8 is not None and param is self.fp8_scale:
            _check_shape(self.name, full.shape, self._scale_shape(self.out_features))
            if self.fp8.block is None:  # one per output row: the rows are not split
                param.data.copy_(full.reshape(-1).expand(self.out_features))
                return
            bk = self.fp8.block[1]
            param.data.copy_(full.narrow(1, self.in_start // bk, param.shape[1]))
            return
        if param.dim() == 1:  # bias: replicated
            _check_shape(self.name, full.shape, (self.out_features,))
            param.data.copy_(full)
            return
        _check_shape(self.name, full.shape, (self.out_features, self.in_features))
        param.data.copy_(full.narrow(1, self.in_start, self.in_size))

    def defer_reduce(self) -> None:
        """The caller all-reduces the output itself, at once (fused with what follows): the
        product is still written where the all-reduce reads it."""
        self.reduce, self.deferred = False, True

    deferred = False

    def forward(self, x: torch.Tensor, norm: GatedRMSNorm | None = None, gate: torch.Tensor | None = None,
                act=None) -> torch.Tensor:
        """x W^T, or with `norm` (this rank's columns of a gated RMSNorm) norm.apply(x) W^T, or with
        `gate` (x's shape) (x * sigmoid(gate)) W^T, or with `act` (an MLP's gated activation, x its
        gate | up) act(x) W^T."""
        out = None
        if (self.reduce or self.deferred) and x.dim() == 2:
            out = self.tp.reduce_buffer(x.shape[0], self.out_features, x.dtype, x.device)
        y = self._matmul(x, self.bias if self.tp.rank == 0 else None, out=out, norm=norm, gate=gate, act=act)
        return self.tp.all_reduce(y) if self.reduce else y
