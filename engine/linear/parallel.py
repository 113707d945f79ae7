"""Tensor-parallel wrappers around a rank's shard of a layer (engine/distributed/shard.py cuts it).

A column-parallel layer needs none: its rows are the rank's own outputs (its heads, its intermediate
rows). A row-parallel layer's partial products are summed over the ranks after it; the lm_head's
vocabulary shards are gathered, so every rank holds the same whole logits and samples alike.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from engine.linear.base import LinearLayer


class Collectives(Protocol):
    """What the wrappers need of a tensor-parallel group (engine/distributed/group.py's TPGroup)."""

    rank: int
    size: int

    def all_reduce_(self, t: torch.Tensor) -> torch.Tensor: ...

    def ordered_sum(self, t: torch.Tensor) -> torch.Tensor: ...

    def gather_columns(self, t: torch.Tensor, widths: list[int]) -> torch.Tensor: ...


class RowParallelLinear(nn.Module):
    """A layer whose input columns are split over the ranks: its shard's product, summed over all
    (ordered: in rank order, as reduce_like_tp asks)."""

    def __init__(
        self, inner: LinearLayer, out_features: int, group: Collectives, ordered: bool = False
    ) -> None:
        super().__init__()
        self.inner, self.group = inner, group
        self.in_features, self.out_features = inner.in_features, out_features
        self._sum = group.ordered_sum if ordered else group.all_reduce_  # chosen once, not per call

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._sum(self.inner(x))


class VocabParallelHead(nn.Module):
    """The lm_head with its vocabulary rows split over the ranks: every rank's logits, gathered."""

    def __init__(self, inner: LinearLayer, widths: tuple[int, ...], group: Collectives) -> None:
        super().__init__()
        self.inner, self.group, self.widths = inner, group, list(widths)
        self.in_features, self.out_features = inner.in_features, sum(widths)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.gather_columns(self.inner(x), self.widths)


def wrap_model(
    model: nn.Module, widths: tuple[int, ...], group: Collectives, ordered: bool = False
) -> None:
    """The row-parallel layers (o_proj, down_proj) and the lm_head of a sharded model wrapped in place."""
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        attn.o_proj = RowParallelLinear(attn.o_proj, attn.o_proj.out_features, group, ordered)
        mlp.down_proj = RowParallelLinear(mlp.down_proj, mlp.down_proj.out_features, group, ordered)
    model.lm_head = VocabParallelHead(model.lm_head, widths, group)
