"""The Mamba-1 mixer (Jamba's Mamba layers) over its state pages in the shared KV cache pool, as
transformers' JambaMambaMixer:

    x | z = in_proj(h)                       (intermediate channels each)
    x     = silu(causal_conv1d(x))           (depthwise, d_conv taps, with its conv state)
    dt | B | C = x_proj(x)                   (dt_rank, d_state, d_state)
    dt, B, C   = dt_layernorm(dt), b_layernorm(B), c_layernorm(C)   (RMSNorms: Jamba's, not Mamba's)
    dt    = dt_proj.weight dt                (its bias is added inside the scan, in fp32)
    y     = selective_scan(x, dt, A = -exp(A_log), B, C, D, dt_bias) * silu(z)
    out   = out_proj(y)

Tensor parallel: the intermediate channels split across ranks, and with them in_proj's x and z
rows (each part sliced on its own), the conv's channels, dt_proj's rows and bias, A_log's rows and
D; x_proj's input is those channels, so it is row-parallel and its small output (dt_rank + 2
d_state per token) is all-reduced before the norms, which then run replicated on every rank;
out_proj is row-parallel.

The state: `bind_state` gives the layer its pages, as a Mamba-2 layer's (`workers/layers/mamba.py`);
the conv state `[num_blocks, d_conv - 1, channels]` and the SSM state `[num_blocks, 1, channels,
d_state]` are views of them, laid out by `MambaShape.layout` (the plan's own function: Mamba-1 as
one head of all channels). The step's pages come in `AttentionMetadata.mamba`
(`workers.mamba_metadata`), as for Mamba-2; the scan writes the checkpoints the chunks ask for
(`kernels/mamba1_scan.py`).
"""
from __future__ import annotations

import torch
from torch import nn

from distengine.model_config import MambaShape, StateLayout
from workers.layers.attention import AttentionMetadata
from workers.layers.linear import ColumnParallelLinear, RowParallelLinear
from workers.layers.mamba import Segmented
from workers.layers.pooled_state import PooledStateLayer
from workers.ops import (causal_conv1d_update_op, causal_conv1d_varlen_op, linear_op, rms_norm_op,
                         selective_scan_update_op, selective_scan_varlen_op)
from workers.parallel import TPGroup, split_evenly


class SmallNorm(nn.Module):
    """A replicated RMSNorm over the all-reduced x_proj output's parts (dt, B, C)."""

    def __init__(self, size: int, eps: float, dtype, device) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype, device=device), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm_op(x.contiguous(), self.weight, self.eps)


class MambaMixer1(PooledStateLayer):
    def __init__(self, hidden_size: int, shape: MambaShape, dt_rank: int, tp: TPGroup, dtype: torch.dtype, device,
                 prefix: str, *, conv_bias: bool = True, proj_bias: bool = False, activation: str = "silu",
                 eps: float = 1e-6) -> None:
        super().__init__()
        if shape.version != 1:
            raise ValueError(f"{prefix}: a Mamba{shape.version} shape given to the Mamba-1 mixer")
        if activation not in ("silu", "swish"):
            raise ValueError(f"{prefix}: Mamba activation {activation!r} is not supported (silu)")
        self.prefix, self.tp, self.shape = prefix, tp, shape
        I, N, K = shape.intermediate, shape.d_state, shape.d_conv  # noqa: E741
        start, size = split_evenly(I, tp, f"{prefix} intermediate channels")
        self.I, self.I_local, self.N, self.K, self.R = I, size, N, K, int(dt_rank)
        self.channel_slice = (I, start, size)
        self.in_proj = Segmented([self.channel_slice, self.channel_slice], (hidden_size,), proj_bias, dtype, device,
                                 f"{prefix}.in_proj")
        self.conv1d = Segmented([self.channel_slice], (1, K), conv_bias, dtype, device, f"{prefix}.conv1d")
        self.x_proj = RowParallelLinear(I, self.R + 2 * N, False, tp, dtype, device, f"{prefix}.x_proj")
        self.dt_proj = ColumnParallelLinear(self.R, I, True, tp, dtype, device, f"{prefix}.dt_proj")
        self.dt_layernorm = SmallNorm(self.R, eps, dtype, device)
        self.b_layernorm = SmallNorm(N, eps, dtype, device)
        self.c_layernorm = SmallNorm(N, eps, dtype, device)
        f32 = {"dtype": torch.float32, "device": device}
        self.A_log = nn.Parameter(torch.empty(size, N, **f32), requires_grad=False)
        self.D = nn.Parameter(torch.empty(size, **f32), requires_grad=False)
        self._A: torch.Tensor | None = None  # -exp(A_log): derived at the first forward, not every step
        self.out_proj = RowParallelLinear(I, hidden_size, proj_bias, tp, dtype, device, f"{prefix}.out_proj")

    # ---- weights -------------------------------------------------------------------------
    def full_shapes(self) -> dict[str, tuple[int, ...]]:
        return {"A_log": (self.I, self.N), "D": (self.I,)}

    def weight_loader(self, param: nn.Parameter, full: torch.Tensor, shard=None) -> None:
        want = self.full_shapes()["A_log" if param is self.A_log else "D"]
        if tuple(full.shape) != want:
            raise ValueError(f"{self.prefix}: checkpoint tensor has shape {tuple(full.shape)}, expected {want}")
        _, start, size = self.channel_slice
        param.data.copy_(full.narrow(0, start, size).to(param.dtype))
        if param is self.A_log:
            self._A = None

    # ---- state ---------------------------------------------------------------------------
    def state_views(self, pages: torch.Tensor, lay: StateLayout,
                    dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        conv, ssm = super().state_views(pages, lay, dtype)
        return conv, ssm[:, 0]  # [num_blocks, channels, d_state]: Mamba-1 is one head

    # ---- forward -------------------------------------------------------------------------
    def forward(self, h: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        m = meta.mamba
        if self.conv_state is None or m is None:
            raise RuntimeError(f"{self.prefix}: no Mamba state bound (allocate the cache before running)")
        j = self.mamba_index
        x, z = linear_op(h, self.in_proj.weight, self.in_proj.bias).split([self.I_local, self.I_local], dim=-1)
        w = self.conv1d.weight.view(self.I_local, self.K)
        if m.decode:
            x = causal_conv1d_update_op(x, w, self.conv1d.bias, self.conv_state, m.init_pages[j], m.write_pages[j])
        else:
            x = causal_conv1d_varlen_op(x, w, self.conv1d.bias, self.conv_state, meta.query_start_loc,
                                        m.init_pages[j], m.chunk_start, m.chunk_seq, m.chunk_pages[j])
        dt, B, C = self.x_proj(x).split([self.R, self.N, self.N], dim=-1)
        dt = linear_op(self.dt_layernorm(dt), self.dt_proj.weight)
        B, C = self.b_layernorm(B), self.c_layernorm(C)
        if self._A is None:
            self._A = -torch.exp(self.A_log)
        if m.decode:
            y = selective_scan_update_op(x, dt, self._A, B, C, self.D, self.dt_proj.bias, self.ssm_state,
                                         m.init_pages[j], m.write_pages[j], z=z)
        else:
            y = selective_scan_varlen_op(x, dt, self._A, B, C, self.D, self.dt_proj.bias, self.ssm_state,
                                         meta.query_start_loc, m.init_pages[j], m.chunk_start, m.chunk_seq,
                                         m.chunk_pages[j], z=z)
        return self.out_proj(y)
