"""The Gated DeltaNet mixer (the linear-attention layers of Qwen3-Next and Qwen3.5) over its state
pages in the shared KV cache pool.

Per token: one projection gives q, k (key heads of K), v, z (value heads of V), b and a (one per
value head); the causal depthwise conv (silu, no bias) runs over the q, k and v channels with its
conv state; the delta rule (`kernels/gated_delta.py`: q and k L2-normalised, g = -exp(A_log) *
softplus(a + dt_bias), beta = sigmoid(b)) updates the recurrent state [value heads, K, V] and
reads it; the gated RMSNorm (per value head over V, one weight [V] shared by the heads, then
times silu(z)); `out_proj`. Each key head serves Hv / Hk consecutive value heads.

Checkpoints split the projection two ways: Qwen3.5's `in_proj_qkv` [q | k | v], `in_proj_z`,
`in_proj_b`, `in_proj_a`; Qwen3-Next's `in_proj_qkvz` and `in_proj_ba`, interleaved per key head
group (each group [q | k | its value heads' v | their z], and [their b | their a]: transformers'
`fix_query_key_value_ordering`). Both are reordered at load time into one matrix per rank,
[q | k | v | z | b | a], so one GEMM and one runtime path serve both.

Tensor parallel: the key heads and the value heads split across ranks (a rank's value heads are
those its key heads serve), and with them the rows of the projection, the conv channels, A_log
and dt_bias; the norm's weight is replicated and `out_proj` row-parallel.

The state: `bind_state` gives the layer its pages, as a Mamba layer's (`workers/layers/mamba.py`);
the conv state `[num_blocks, d_conv - 1, q + k + v channels]` (the model dtype) and the recurrent
state `[num_blocks, value heads, K, V]` (fp32) are views of them, laid out by
`DeltaNetShape.layout` (the plan's own function). The step's pages come in
`AttentionMetadata.mamba`, whose prefill chunks the host cuts at most SSD_MAX_CHUNK tokens long.
"""
from __future__ import annotations

import torch
from torch import nn

from distengine.model_config import DeltaNetShape, StateLayout
from kernels.fp8 import FP8_DTYPE, scale_shape
from kernels.gated_delta import GDN_MAX_CHUNK
from kernels.gated_rmsnorm import GatedRMSNorm
from kernels.mamba_conv import ConvStep
from kernels.mamba_ssd import SSD_MAX_CHUNK
from workers.layers.attention import AttentionMetadata
from workers.layers.linear import Fp8Layout, RowParallelLinear, block_rows, linear_quantization
from workers.layers.mamba import Segmented
from workers.layers.pooled_state import PooledStateLayer
from workers.ops import (causal_conv1d_varlen_op, fp8_linear_op, gated_delta_update_op, gated_delta_varlen_op,
                         linear_op)
from workers.parallel import TPGroup

# The host cuts one set of prefill chunks for every state layer (`workers/input_batch.py`, sized
# for the Mamba scan): the delta-rule kernel must take chunks that long.
assert SSD_MAX_CHUNK <= GDN_MAX_CHUNK, (SSD_MAX_CHUNK, GDN_MAX_CHUNK)

# The checkpoint's projection tensors, by layout: the part names are the tensors' names
# (`in_proj_<part>.weight`).
LAYOUTS = {"split": ("qkv", "z", "b", "a"), "interleaved": ("qkvz", "ba")}
TAIL_PARTS = ("b", "a", "ba")  # [b | a]: a matrix of their own beside FP8 [q | k | v | z]


class DeltaNetProjection(nn.Module):
    """This rank's rows of [q | k | v | z | b | a] in one matrix `weight`, filled from the
    checkpoint's tensors of its `layout` (`parts`; `weight_loader`'s shard: the part name).

    From an FP8 checkpoint (Qwen's store in_proj_qkv / in_proj_z / in_proj_qkvz in FP8 and
    in_proj_b / in_proj_a / in_proj_ba in bf16) `weight` holds [q | k | v | z] in FP8 with its
    scales (the checkpoint's `scale_name`, as `workers.layers.linear`'s FP8 layers keep them:
    blocks, or one per row) and `tail` [b | a] in the model's dtype: two products a step. b and a
    are served in the model's dtype only (their few rows are no whole FP8 block)."""

    def __init__(self, hidden: int, shape: DeltaNetShape, tp: TPGroup, dtype, device, name: str,
                 layout: str = "split") -> None:
        super().__init__()
        if layout not in LAYOUTS:
            raise ValueError(f"{name}: projection layout {layout!r} is not one of {', '.join(LAYOUTS)}")
        self.hidden, self.name, self.parts, self.tp = hidden, name, LAYOUTS[layout], tp
        self.Hk, self.Hv, self.K, self.V = shape.num_k_heads, shape.num_v_heads, shape.k_dim, shape.v_dim
        self.hk, self.hv = shape.heads_per_rank(tp.world_size)
        self.k0, self.v0 = tp.rank * self.hk, tp.rank * self.hv  # this rank's first key / value head
        self.sizes = [self.hk * self.K, self.hk * self.K, self.hv * self.V, self.hv * self.V, self.hv, self.hv]
        self.fp8 = self._fp8_layout()
        main = sum(self.sizes[:4]) if self.fp8 is not None else sum(self.sizes)
        self.weight = nn.Parameter(torch.empty(main, hidden, dtype=FP8_DTYPE if self.fp8 else dtype, device=device),
                                   requires_grad=False)
        self.tail = None
        if self.fp8 is not None:
            self.tail = nn.Parameter(torch.empty(2 * self.hv, hidden, dtype=dtype, device=device), requires_grad=False)
            scale = torch.empty(scale_shape(main, hidden, self.fp8.block), dtype=torch.float32, device=device)
            setattr(self, self.fp8.scale_name, nn.Parameter(scale, requires_grad=False))
            for part in self.main_parts() if self.fp8.block is not None else ():
                self._block_rows(part)  # a tensor-parallel share that cuts a scale block: refused now

    def main_parts(self) -> tuple[str, ...]:
        return tuple(p for p in self.parts if p not in TAIL_PARTS)

    def _fp8_layout(self) -> Fp8Layout | None:
        quant = linear_quantization()
        if quant is None:
            return None
        quantized = {p: quant.quantizes(f"{self.name}_{p}") for p in self.main_parts()}
        if any(quantized.values()) and not all(quantized.values()):
            raise ValueError(f"{self.name}: the quantization_config quantizes {[p for p, q in quantized.items() if q]} "
                             f"but not {[p for p, q in quantized.items() if not q]}; they are one matrix here")
        if not any(quantized.values()):
            return None
        return Fp8Layout.of(quant)

    @property
    def fp8_scale(self) -> torch.Tensor | None:
        return None if self.fp8 is None else getattr(self, self.fp8.scale_name)

    def param_of(self, part: str, scale: bool) -> str:
        """Our parameter that checkpoint tensor in_proj_<part>.weight (or its scale) fills."""
        if self.fp8 is not None and part in TAIL_PARTS:
            return "tail"  # (a scale of b / a has no place: the dtype check refuses FP8 there)
        return self.fp8.scale_name if scale and self.fp8 is not None else "weight"

    def part_shapes(self, part: str) -> tuple[int, int]:
        """The full (unsharded) shape of the checkpoint tensor `in_proj_<part>`."""
        Hk, Hv, K, V = self.Hk, self.Hv, self.K, self.V
        rows = {"qkv": 2 * Hk * K + Hv * V, "z": Hv * V, "b": Hv, "a": Hv,
                "qkvz": 2 * Hk * K + 2 * Hv * V, "ba": 2 * Hv}[part]
        return (rows, self.hidden)

    def checkpoint_tensors(self) -> dict[str, tuple[int, ...]]:
        """The checkpoint tensors (names after `in_proj`) that fill this projection, with their shapes."""
        out: dict[str, tuple[int, ...]] = {}
        for part in self.parts:
            rows, cols = self.part_shapes(part)
            out[f"_{part}.weight"] = (rows, cols)
            if self.fp8 is not None and part not in TAIL_PARTS:
                out[f"_{part}.{self.fp8.scale_name}"] = self.fp8.checkpoint_shape(rows, cols)
        return out

    def row_map(self, part: str) -> tuple[int, torch.Tensor]:
        """(the first row of its parameter that the part fills, the part's rows it takes, in order)."""
        K, V, hk, hv, k0, v0 = self.K, self.V, self.hk, self.hv, self.k0, self.v0
        kv, r = self.Hk * K, self.Hv // self.Hk

        def span(start: int, n: int) -> torch.Tensor:
            return torch.arange(start, start + n)

        tail = 0 if self.fp8 is not None else sum(self.sizes[:4])
        if part == "qkv":
            return 0, torch.cat([span(k0 * K, hk * K), span(kv + k0 * K, hk * K), span(2 * kv + v0 * V, hv * V)])
        if part == "z":
            return sum(self.sizes[:3]), span(v0 * V, hv * V)
        if part in ("b", "a"):
            return tail + (0 if part == "b" else hv), span(v0, hv)
        groups = torch.arange(k0, k0 + hk)[:, None]
        if part == "qkvz":  # per key head group: [q (K) | k (K) | v (r V) | z (r V)]
            dst, g = 0, groups * (2 * K + 2 * r * V)
            segments = [(0, K), (K, K), (2 * K, r * V), (2 * K + r * V, r * V)]
        else:  # "ba", per key head group: [b (r) | a (r)]
            dst, g, segments = tail, groups * 2 * r, [(0, r), (r, r)]
        return dst, torch.cat([(g + torch.arange(o, o + n)).flatten() for o, n in segments])

    def _block_rows(self, part: str) -> tuple[int, torch.Tensor]:
        dst, src = self.row_map(part)
        return block_rows(f"{self.name}_{part}", dst, src, self.part_shapes(part)[0], self.weight.shape[0],
                          self.fp8.block, self.tp.world_size)

    def weight_loader(self, param: nn.Parameter, full: torch.Tensor, shard: str | None = None) -> None:
        if shard not in self.parts:
            raise ValueError(f"{self.name}: no projection part {shard!r} (this layout's: {', '.join(self.parts)})")
        label = f"{self.name}_{shard}"
        if self.fp8 is not None and param is self.fp8_scale:
            want = self.checkpoint_tensors()[f"_{shard}.{self.fp8.scale_name}"]
            if tuple(full.shape) != want and not (want == () and full.numel() == 1):
                raise ValueError(f"{label}: scale tensor has shape {tuple(full.shape)}, expected {want}")
            if self.fp8.block is not None:
                dst, src = self._block_rows(shard)
            else:
                dst, src = self.row_map(shard)
                full = full.reshape(-1).expand(self.part_shapes(shard)[0]) if full.numel() == 1 else full.reshape(-1)
            param.data.narrow(0, dst, len(src)).copy_(full.index_select(0, src))
            return
        want = self.part_shapes(shard)
        if tuple(full.shape) != want:
            raise ValueError(f"{label}: checkpoint tensor has shape {tuple(full.shape)}, expected {want}")
        dst, src = self.row_map(shard)
        param.data.narrow(0, dst, len(src)).copy_(full.index_select(0, src))

    def forward(self, x: torch.Tensor, conv: ConvStep | None) -> tuple[torch.Tensor, ...]:
        """(q|k|v, z, b, a) of x, the conv's columns through `conv` when given (a decode step)."""
        hv, V = self.hv, self.V
        conv_dim = sum(self.sizes[:3])
        if self.fp8 is None:
            return linear_op(x, self.weight, conv=conv).split([conv_dim, hv * V, hv, hv], dim=-1)
        main = fp8_linear_op(x, self.weight, self.fp8_scale, self.fp8.block, conv=conv)
        return (*main.split([conv_dim, hv * V], dim=-1), *linear_op(x, self.tail).split([hv, hv], dim=-1))


class HeadGatedRMSNorm(nn.Module):
    """Qwen3NextRMSNormGated over each value head: y * rsqrt(mean(y^2) + eps), rounded to y's
    dtype, times the weight [V] (shared by the heads), times silu(z)."""

    def __init__(self, v_dim: int, heads: int, eps: float, dtype, device, name: str) -> None:
        super().__init__()
        self.v_dim, self.heads, self.eps, self.name = v_dim, heads, eps, name
        self.weight = nn.Parameter(torch.ones(v_dim, dtype=dtype, device=device), requires_grad=False)
        self._per_channel: torch.Tensor | None = None  # the weight repeated per head: built once

    def weight_loader(self, param: nn.Parameter, full: torch.Tensor, shard=None) -> None:
        if tuple(full.shape) != (self.v_dim,):
            raise ValueError(f"{self.name}: checkpoint tensor has shape {tuple(full.shape)}, expected ({self.v_dim},)")
        param.data.copy_(full)
        self._per_channel = None

    def spec(self, z: torch.Tensor) -> GatedRMSNorm:
        """The norm gated by z `[T, heads * V]` (a strided view allowed), for the output
        projection to apply (or `.apply(y)`)."""
        if self._per_channel is None:
            self._per_channel = self.weight.repeat(self.heads)
        # transformers rounds the normalised value to y's dtype before the weight.
        return GatedRMSNorm(z, self._per_channel, self.v_dim, self.eps, norm_before_gate=True, round_before_weight=True)


class GatedDeltaNet(PooledStateLayer):
    def __init__(self, hidden_size: int, shape: DeltaNetShape, tp: TPGroup, dtype: torch.dtype, device, prefix: str,
                 *, eps: float, activation: str = "silu", layout: str = "split") -> None:
        super().__init__()
        if activation not in ("silu", "swish"):
            raise ValueError(f"{prefix}: Gated DeltaNet conv activation {activation!r} is not supported (silu)")
        if shape.state_dtype_bytes != 4:
            raise ValueError(f"{prefix}: a Gated DeltaNet state of {shape.state_dtype_bytes}-byte elements is not "
                             f"supported (the delta rule keeps it in float32: mamba_ssm_dtype float32)")
        self.prefix, self.tp, self.shape = prefix, tp, shape
        Hk, Hv, K, V = shape.num_k_heads, shape.num_v_heads, shape.k_dim, shape.v_dim
        self.hk, self.hv = shape.heads_per_rank(tp.world_size)
        self.K, self.V, self.d_conv = K, V, shape.d_conv
        self.conv_dim = 2 * self.hk * K + self.hv * V
        self.in_proj = DeltaNetProjection(hidden_size, shape, tp, dtype, device, f"{prefix}.in_proj", layout)
        keys = (Hk * K, tp.rank * self.hk * K, self.hk * K)
        self.conv1d = Segmented([keys, keys, (Hv * V, tp.rank * self.hv * V, self.hv * V)], (1, shape.d_conv), False,
                                dtype, device, f"{prefix}.conv1d")
        f32 = {"dtype": torch.float32, "device": device}
        self.A_log = nn.Parameter(torch.empty(self.hv, **f32), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.empty(self.hv, **f32), requires_grad=False)
        self.head_slice = (Hv, tp.rank * self.hv, self.hv)
        self.norm = HeadGatedRMSNorm(V, self.hv, eps, dtype, device, f"{prefix}.norm")
        self.out_proj = RowParallelLinear(Hv * V, hidden_size, False, tp, dtype, device, f"{prefix}.out_proj")

    # ---- weights -------------------------------------------------------------------------
    def full_shapes(self) -> dict[str, tuple[int, ...]]:
        full = self.head_slice[0]
        return {"A_log": (full,), "dt_bias": (full,)}

    def weight_loader(self, param: nn.Parameter, full: torch.Tensor, shard=None) -> None:
        n_full, start, n = self.head_slice
        if tuple(full.shape) != (n_full,):
            raise ValueError(f"{self.prefix}: checkpoint tensor has shape {tuple(full.shape)}, expected ({n_full},)")
        param.data.copy_(full.narrow(0, start, n).to(param.dtype))

    # ---- state ---------------------------------------------------------------------------
    def state_views(self, pages: torch.Tensor, lay: StateLayout,
                    dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if tuple(lay.conv_shape) != (self.d_conv - 1, self.conv_dim):
            raise ValueError(f"{self.prefix}: the plan's conv state {lay.conv_shape} is not this layer's "
                             f"{(self.d_conv - 1, self.conv_dim)}")
        return super().state_views(pages, lay, dtype)

    # ---- forward -------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        m = meta.mamba
        if self.conv_state is None or m is None:
            raise RuntimeError(f"{self.prefix}: no Gated DeltaNet state bound (allocate the cache before running)")
        T, j = x.shape[0], self.mamba_index
        hk, hv, K, V = self.hk, self.hv, self.K, self.V
        w = self.conv1d.weight.view(self.conv_dim, self.d_conv)
        # A decode step's conv runs on the projection's q, k and v columns (at one row inside its GEMV).
        conv = ConvStep(w, None, self.conv_state, m.init_pages[j], m.write_pages[j]) if m.decode else None
        qkv, z, b, a = self.in_proj(x, conv)
        if not m.decode:
            qkv = causal_conv1d_varlen_op(qkv, w, None, self.conv_state, meta.query_start_loc, m.init_pages[j],
                                          m.chunk_start, m.chunk_seq, m.chunk_pages[j])
        q, k, v = qkv.split([hk * K, hk * K, hv * V], dim=-1)
        q, k, v = q.view(T, hk, K), k.view(T, hk, K), v.view(T, hv, V)
        norm = self.norm.spec(z)
        if m.decode:
            y = gated_delta_update_op(q, k, v, a, b, self.A_log, self.dt_bias, self.ssm_state, m.init_pages[j],
                                      m.write_pages[j])
            return self.out_proj(y.view(T, hv * V), norm=norm)
        # a prefill's norm runs in the rule's output launch
        y = gated_delta_varlen_op(q, k, v, a, b, self.A_log, self.dt_bias, self.ssm_state, meta.query_start_loc,
                                  m.init_pages[j], m.chunk_start, m.chunk_seq, m.chunk_pages[j], norm=norm)
        return self.out_proj(y.view(T, hv * V))
