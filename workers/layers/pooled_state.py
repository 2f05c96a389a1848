"""A layer whose recurrent state lives in the KV pool's pages (Mamba-1, Mamba-2, Gated DeltaNet):
the plan's layout of the state, and the views of every block's pages that the layer reads and
writes in place."""
from __future__ import annotations

import torch
from torch import nn

from distengine.model_config import StateLayout


def state_views(pages: torch.Tensor, lay: StateLayout, dtype: torch.dtype,
                name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The conv state `[num_blocks, *conv_shape]` (in `dtype`) and the SSM state `[num_blocks,
    *ssm_shape]` (in `dtype`, or fp32 where the layout keeps it so) of a state layer's pages
    `[num_blocks, bytes]` (uint8), as the plan lays them out (`StateLayout`)."""
    esize = torch.empty((), dtype=dtype).element_size()
    if pages.shape[1] < lay.nbytes:
        raise ValueError(f"{name}: its pages hold {pages.shape[1]} bytes, the state needs {lay.nbytes}")
    n = pages.shape[0]
    conv_bytes = lay.conv_shape[0] * lay.conv_shape[1] * esize
    ssm_dtype = dtype if lay.ssm_dtype_bytes == esize else torch.float32
    ssm_bytes = lay.ssm_shape[0] * lay.ssm_shape[1] * lay.ssm_shape[2] * lay.ssm_dtype_bytes
    return (pages[:, :conv_bytes].view(dtype).view(n, *lay.conv_shape),
            pages[:, lay.ssm_offset:lay.ssm_offset + ssm_bytes].view(ssm_dtype).view(n, *lay.ssm_shape))


class PooledStateLayer(nn.Module):
    """Subclasses set `shape` (the plan's state shape, with `layout(tp_size, dtype_bytes)`), `tp`
    and `prefix`. Until `bind_state` the layer has no state and refuses to run."""

    def __init__(self) -> None:
        super().__init__()
        self.conv_state: torch.Tensor | None = None
        self.ssm_state: torch.Tensor | None = None
        self.mamba_index = -1

    def state_layout(self, dtype_bytes: int) -> StateLayout:
        return self.shape.layout(self.tp.world_size, dtype_bytes)

    def bind_state(self, pages: torch.Tensor, mamba_index: int, dtype: torch.dtype) -> None:
        """`pages`: `[num_blocks, bytes]` uint8, this layer's pages of every block."""
        lay = self.state_layout(torch.empty((), dtype=dtype).element_size())
        self.conv_state, self.ssm_state = self.state_views(pages, lay, dtype)
        self.mamba_index = mamba_index

    def state_views(self, pages: torch.Tensor, lay: StateLayout,
                    dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The conv and SSM state views this layer works on (a layer may check or reshape them)."""
        return state_views(pages, lay, dtype, self.prefix)

    def unbind(self) -> None:
        self.conv_state = self.ssm_state = None
        self.mamba_index = -1
