"""A whole model's row-parallel layers summed as N tensor-parallel ranks sum them (reduce_like_tp).

Each rank's partial product comes from its columns alone (the others zeroed: a kernel that sums K in a
fixed order adds exact zeros, so the partial is bitwise the rank's); the partials are added in rank
order, as the ranks' sum does. A tp_size=1 engine so built gives bitwise the outputs of tp_size=N.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.distributed.shard import column_cuts
from engine.linear.base import LinearLayer
from engine.model.config import ModelConfig


class ShardSumLinear(nn.Module):
    """inner(x) computed as the sum, in rank order, of inner on each rank's columns of x."""

    def __init__(self, inner: LinearLayer, cuts: list[range]) -> None:
        super().__init__()
        if getattr(inner, "bias", None) is not None:
            raise ValueError("reduce_like_tp: a row-parallel layer with a bias is not built")
        self.inner, self.cuts = inner, cuts
        self.in_features, self.out_features = inner.in_features, inner.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        total = None
        part_x = torch.zeros_like(x)
        for cut in self.cuts:
            part_x[..., cut.start : cut.stop] = x[..., cut.start : cut.stop]
            part = self.inner(part_x)
            part_x[..., cut.start : cut.stop] = 0
            total = part if total is None else total.add_(part)
        return total


def sum_like_ranks(model: nn.Module, cfg: ModelConfig, size: int) -> None:
    """The model's o_proj and down_proj wrapped in place to sum like `size` ranks."""
    for i, layer in enumerate(model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        attn.o_proj = ShardSumLinear(
            attn.o_proj, column_cuts(f"layers.{i}.self_attn.o_proj", cfg, size)
        )
        mlp.down_proj = ShardSumLinear(
            mlp.down_proj, column_cuts(f"layers.{i}.mlp.down_proj", cfg, size)
        )
