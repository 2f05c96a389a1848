"""The Mamba-2 mixer (Bamba, Nemotron-H, Falcon-H1, Granite-4.0-H) over its state pages in the
shared KV cache pool.

Tensor parallel: the heads are split across ranks, and with them the channels of z, x and dt,
the conv channels of x, A_log, D, dt_bias and the gated norm's weight; the B/C groups are split
when tp divides them, else each rank keeps the group its heads read. `in_proj` is thus
column-parallel by segment (z | x | B | C | dt, each sliced on its own) and `out_proj`
row-parallel. The gated RMSNorm normalises over groups of intermediate // n_groups channels: when
a group spans ranks (groups replicated), its sum of squares is all-reduced.

The state: `bind_state` gives the layer its pages (`[num_blocks, pages x page_bytes]` bytes of
the pool); the conv state `[num_blocks, d_conv - 1, conv channels]` and the SSM state
`[num_blocks, heads, head_dim, d_state]` are views of them, laid out by
`MambaShape.layout` (the plan's own function). The step's pages come in
`AttentionMetadata.mamba` (`workers.mamba_metadata`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from distengine.model_config import MambaShape, mamba_groups_per_rank
from kernels.fp8 import FP8_DTYPE, scale_shape
from kernels.gated_rmsnorm import GatedRMSNorm
from kernels.mamba_conv import ConvStep
from workers.layers.attention import AttentionMetadata
from workers.layers.linear import Fp8Layout, RowParallelLinear, block_rows, linear_quantization
from workers.layers.pooled_state import PooledStateLayer
from workers.ops import (causal_conv1d_update_op, causal_conv1d_varlen_op, fp8_linear_op, gated_norm_op, linear_op,
                         selective_state_update_op, ssd_scan_varlen_op)
from workers.parallel import TPGroup


class Segmented(nn.Module):
    """Parameters whose dim 0 concatenates segments each sliced on its own by the rank (in_proj's
    z | x | B | C | dt, the conv's x | B | C). `segments`: (full length, this rank's start, length).

    `linear`: a projection (its `matmul`), which an FP8 checkpoint may store in FP8 as it does
    the linear layers (`workers.layers.linear`): the weight as stored and its scale parameter,
    per-tensor or per-channel scales spread over the rows each segment takes, block scales with
    their blocks (a segment's slice that cuts a block is refused when the layer is built)."""

    def __init__(self, segments: list[tuple[int, int, int]], inner: tuple[int, ...], bias: bool, dtype, device,
                 name: str, linear: bool = False, tp_size: int = 1) -> None:
        super().__init__()
        self.segments, self.inner, self.name, self.tp_size = segments, inner, name, tp_size
        size = sum(n for _, _, n in segments)
        quant = linear_quantization() if linear else None
        self.fp8: Fp8Layout | None = None
        if quant is not None and quant.quantizes(name):
            self.fp8 = Fp8Layout.of(quant)
            self.weight = nn.Parameter(torch.empty(size, *inner, dtype=FP8_DTYPE, device=device), requires_grad=False)
            scale = torch.empty(scale_shape(size, inner[0], self.fp8.block), dtype=torch.float32, device=device)
            setattr(self, quant.scale_name, nn.Parameter(scale, requires_grad=False))
            if self.fp8.block is not None:
                self._block_maps()  # refused now, not at load
        else:
            self.weight = nn.Parameter(torch.empty(size, *inner, dtype=dtype, device=device), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(size, dtype=dtype, device=device), requires_grad=False) if bias else None

    @property
    def full_rows(self) -> int:
        return sum(full for full, _, _ in self.segments)

    @property
    def fp8_scale(self) -> torch.Tensor | None:
        return None if self.fp8 is None else getattr(self, self.fp8.scale_name)

    def full_shapes(self) -> dict[str, tuple[int, ...]]:
        out = {"weight": (self.full_rows, *self.inner)}
        if self.bias is not None:
            out["bias"] = (self.full_rows,)
        if self.fp8 is not None:
            out[self.fp8.scale_name] = self.fp8.checkpoint_shape(self.full_rows, self.inner[0])
        return out

    def _row_maps(self) -> list[tuple[int, torch.Tensor]]:
        """Each segment's (first row of ours it fills, the checkpoint rows it takes)."""
        out, src, dst = [], 0, 0
        for n_full, start, n in self.segments:
            out.append((dst, torch.arange(src + start, src + start + n)))
            src, dst = src + n_full, dst + n
        return out

    def _block_maps(self) -> list[tuple[int, torch.Tensor]]:
        assert self.fp8 is not None and self.fp8.block is not None
        return [block_rows(self.name, dst, rows, self.full_rows, self.weight.shape[0], self.fp8.block, self.tp_size)
                for dst, rows in self._row_maps()]

    def weight_loader(self, param: nn.Parameter, full: torch.Tensor, shard=None) -> None:
        if self.fp8 is not None and param is self.fp8_scale:
            want = self.full_shapes()[self.fp8.scale_name]
            if tuple(full.shape) != want and not (want == () and full.numel() == 1):
                raise ValueError(f"{self.name}: checkpoint scale tensor has shape {tuple(full.shape)}, expected {want}")
            if self.fp8.block is not None:
                for dst, blocks in self._block_maps():
                    param.data.narrow(0, dst, len(blocks)).copy_(full.index_select(0, blocks.to(full.device)))
                return
            per_row = full.reshape(-1).expand(self.full_rows)
            for dst, rows in self._row_maps():
                param.data.narrow(0, dst, len(rows)).copy_(per_row.index_select(0, rows.to(full.device)))
            return
        want = (self.full_rows, *param.shape[1:])
        if tuple(full.shape) != want:
            raise ValueError(f"{self.name}: checkpoint tensor has shape {tuple(full.shape)}, expected {want}")
        src = dst = 0
        for n_full, start, n in self.segments:
            param.data.narrow(0, dst, n).copy_(full.narrow(0, src + start, n))
            src, dst = src + n_full, dst + n

    def matmul(self, x: torch.Tensor, conv: ConvStep | None = None) -> torch.Tensor:
        """x W^T (+ b) of a `linear` one, through its FP8 weight where it has one."""
        if self.fp8 is None:
            return linear_op(x, self.weight, self.bias, conv=conv)
        return fp8_linear_op(x, self.weight, self.fp8_scale, self.fp8.block, self.bias, conv=conv)


class MambaMixer2(PooledStateLayer):
    def __init__(self, hidden_size: int, shape: MambaShape, tp: TPGroup, dtype: torch.dtype, device, prefix: str, *,
                 conv_bias: bool = True, proj_bias: bool = False, out_bias: bool | None = None, activation: str = "silu",
                 rms_norm: bool = True, norm_before_gate: bool = False, eps: float = 1e-6,
                 dt_limit: tuple[float, float] = (0.0, float("inf")), proj_scale: list[float] | None = None,
                 state_dtype_bytes: int | None = None) -> None:
        super().__init__()
        if shape.version != 2:
            raise ValueError(f"{prefix}: Mamba{shape.version} layers are not supported (Mamba-2 only)")
        if activation not in ("silu", "swish"):
            raise ValueError(f"{prefix}: Mamba activation {activation!r} is not supported (silu)")
        self.prefix, self.tp, self.shape = prefix, tp, shape
        H, P, G, N, K = shape.n_heads, shape.d_head, shape.n_groups, shape.d_state, shape.d_conv
        if H % tp.world_size:
            raise ValueError(f"{prefix}: {H} Mamba heads cannot be split across tensor-parallel size {tp.world_size}")
        self.G_local = mamba_groups_per_rank(G, H, tp.world_size)
        I = H * P  # noqa: E741
        self.H, self.P, self.N, self.K, self.I, self.n_groups = H // tp.world_size, P, N, K, I, G
        self.I_local = self.I // tp.world_size
        h0 = tp.rank * self.H
        g0 = tp.rank * self.G_local if G % tp.world_size == 0 else tp.rank // (tp.world_size // G)
        self.group0 = g0
        heads = (I, h0 * P, self.I_local)
        groups = (G * N, g0 * N, self.G_local * N)
        self.in_proj = Segmented([heads, heads, groups, groups, (H, h0, self.H)], (hidden_size,), proj_bias, dtype,
                                 device, f"{prefix}.in_proj", linear=True, tp_size=tp.world_size)
        self.conv1d = Segmented([heads, groups, groups], (1, K), conv_bias, dtype, device, f"{prefix}.conv1d")
        self.conv_dim = self.I_local + 2 * self.G_local * N
        f32 = {"dtype": torch.float32, "device": device}
        self.A_log = nn.Parameter(torch.empty(self.H, **f32), requires_grad=False)
        self.D = nn.Parameter(torch.empty(self.H, **f32), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.empty(self.H, **f32), requires_grad=False)
        self._A: torch.Tensor | None = None  # -exp(A_log): derived at the first forward, not every step
        self.head_slice = (H, h0, self.H)
        self.norm = GatedNorm(I, G, tp, self.I_local, h0 * P, eps, norm_before_gate, dtype, device,
                              f"{prefix}.norm") if rms_norm else None
        self.out_proj = RowParallelLinear(I, hidden_size, proj_bias if out_bias is None else out_bias, tp, dtype, device,
                                          f"{prefix}.out_proj")
        self.dt_limit = (float(dt_limit[0]), float(dt_limit[1]))
        self.proj_scale = None
        if proj_scale is not None:  # Falcon-H1's per-segment multipliers of the projection (z, x, B, C, dt)
            sizes = [self.I_local, self.I_local, self.G_local * N, self.G_local * N, self.H]
            self.proj_scale = torch.cat([torch.full((n,), float(m), dtype=dtype, device=device)
                                         for n, m in zip(sizes, proj_scale)])
        self.state_dtype_bytes = state_dtype_bytes

    # ---- weights -------------------------------------------------------------------------
    def full_shapes(self) -> dict[str, tuple[int, ...]]:
        full = self.head_slice[0]
        return {"A_log": (full,), "D": (full,), "dt_bias": (full,)}

    def weight_loader(self, param: nn.Parameter, full: torch.Tensor, shard=None) -> None:
        n_full, start, n = self.head_slice
        if tuple(full.shape) != (n_full,):
            raise ValueError(f"{self.prefix}: checkpoint tensor has shape {tuple(full.shape)}, expected ({n_full},)")
        param.data.copy_(full.narrow(0, start, n).to(param.dtype))
        if param is self.A_log:
            self._A = None

    # ---- forward -------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        m = meta.mamba
        if self.conv_state is None or m is None:
            raise RuntimeError(f"{self.prefix}: no Mamba state bound (allocate the cache before running)")
        T, j = x.shape[0], self.mamba_index
        w = self.conv1d.weight.view(self.conv_dim, self.K)
        # A decode step's conv runs on the projection's x, B and C columns (at one row inside its
        # GEMV), unless the projection is scaled first (Falcon-H1's multipliers).
        fuse = m.decode and self.proj_scale is None
        conv = ConvStep(w, self.conv1d.bias, self.conv_state, m.init_pages[j], m.write_pages[j],
                        start=self.I_local) if fuse else None
        proj = self.in_proj.matmul(x, conv=conv)
        if self.proj_scale is not None:
            proj = proj * self.proj_scale
        z, xbc, dt = proj.split([self.I_local, self.conv_dim, self.H], dim=-1)
        if m.decode:
            if not fuse:
                xbc = causal_conv1d_update_op(xbc, w, self.conv1d.bias, self.conv_state, m.init_pages[j],
                                              m.write_pages[j])
        else:
            xbc = causal_conv1d_varlen_op(xbc, w, self.conv1d.bias, self.conv_state, meta.query_start_loc,
                                          m.init_pages[j], m.chunk_start, m.chunk_seq, m.chunk_pages[j])
        GN = self.G_local * self.N
        xs, B, C = xbc.split([self.I_local, GN, GN], dim=-1)
        xs = xs.view(T, self.H, self.P)
        B, C = B.view(T, self.G_local, self.N), C.view(T, self.G_local, self.N)
        if self._A is None:
            self._A = -torch.exp(self.A_log)
        A = self._A
        if m.decode:
            y = selective_state_update_op(xs, dt, A, B, C, self.D, self.dt_bias, True, self.dt_limit, self.ssm_state,
                                          m.init_pages[j], m.write_pages[j])
        else:
            y = ssd_scan_varlen_op(xs, dt, A, B, C, self.D, self.dt_bias, True, self.dt_limit, self.ssm_state,
                                   meta.query_start_loc, m.init_pages[j], m.chunk_start, m.chunk_seq,
                                   m.chunk_pages[j])
        y = y.view(T, self.I_local)
        if self.norm is None:
            return self.out_proj((y.float() * F.silu(z.float())).to(y.dtype))
        if self.norm.cross_rank:
            return self.out_proj(self.norm(y, z))
        return self.out_proj(y, norm=self.norm.spec(z))


class GatedNorm(nn.Module):
    """RMSNorm over groups of intermediate // n_groups channels, gated by silu(z) (after the norm
    when `norm_before_gate`). Its weight is sliced like the heads."""

    def __init__(self, intermediate: int, n_groups: int, tp: TPGroup, size: int, start: int, eps: float,
                 norm_before_gate: bool, dtype, device, name: str) -> None:
        super().__init__()
        self.full, self.start, self.size, self.name = intermediate, start, size, name
        self.group_size = intermediate // n_groups
        self.eps, self.norm_before_gate, self.tp, self.n_groups = eps, norm_before_gate, tp, n_groups
        # A group spans ranks when the ranks outnumber... its channels are split across ranks.
        self.cross_rank = self.group_size > size
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype, device=device), requires_grad=False)

    def full_shapes(self) -> dict[str, tuple[int, ...]]:
        return {"weight": (self.full,)}

    def weight_loader(self, param: nn.Parameter, full: torch.Tensor, shard=None) -> None:
        if tuple(full.shape) != (self.full,):
            raise ValueError(f"{self.name}: checkpoint tensor has shape {tuple(full.shape)}, expected ({self.full},)")
        param.data.copy_(full.narrow(0, self.start, self.size))

    def spec(self, z: torch.Tensor) -> GatedRMSNorm:
        """This norm of a rank's own groups, gated by z, for the output projection to apply."""
        assert not self.cross_rank
        return GatedRMSNorm(z, self.weight, self.group_size, self.eps, self.norm_before_gate)

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        if not self.cross_rank:
            return gated_norm_op(y, self.spec(z))
        # The group this rank's channels belong to spans several ranks: sum the squares of every
        # rank's share (a [T, n_groups] all-reduce, each rank filling its group's column).
        acc = torch.promote_types(y.dtype, torch.float32)
        g = y.to(acc)
        gate = F.silu(z.to(acc))
        if not self.norm_before_gate:
            g = g * gate
        parts = torch.zeros(y.shape[0], self.n_groups, dtype=acc, device=y.device)
        group = self.start // self.group_size
        parts[:, group] = g.square().sum(-1)
        parts = self.tp.all_reduce(parts)
        out = g * torch.rsqrt(parts[:, group:group + 1] / self.group_size + self.eps)
        out = out.to(y.dtype).to(acc) * self.weight.to(acc)
        if self.norm_before_gate:
            out = out * gate
        return out.to(y.dtype)
