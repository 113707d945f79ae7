"""Each batch row's stop token ids, held flat: one (row, token id) pair per stop id.

A table padded to the widest row made one request's long list cost every row of the batch each decode
step; flat, a step's check costs the stop ids there are: one gather, one comparison, one scatter.
Building it walks the requests in Python, but only when rows join; a step never does.
"""

from __future__ import annotations

from typing import Sequence

import torch


class StopTable:
    __slots__ = ("rows", "ids", "size")

    def __init__(self, rows: torch.Tensor, ids: torch.Tensor, size: int) -> None:
        self.rows = rows  # [N] int64: the batch row of each pair, ascending
        self.ids = ids  # [N] int64: its stop token id
        self.size = size  # rows in the batch, some of which may have no stop id

    @classmethod
    def build(cls, lists: Sequence[Sequence[int]], device) -> "StopTable":
        """One list of stop ids per row."""
        lengths = torch.tensor([len(ids) for ids in lists], dtype=torch.int64)
        rows = torch.repeat_interleave(torch.arange(len(lists), dtype=torch.int64), lengths)
        ids = torch.tensor([t for ids in lists for t in ids], dtype=torch.int64)
        return cls(rows.to(device), ids.to(device), len(lists))

    def numel(self) -> int:
        """The (row, id) pairs held: what a step's check costs."""
        return int(self.ids.numel())

    def hits(self, next_ids: torch.Tensor) -> torch.Tensor:
        """[size] bool: whether each row's token is one of its stop ids."""
        match = next_ids.index_select(0, self.rows) == self.ids
        out = torch.zeros(self.size, dtype=torch.bool, device=next_ids.device)
        out[self.rows[match]] = True
        return out

    def where(self, rows_wanted: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows, ids) of the pairs whose row is marked in the [size] bool mask."""
        chosen = rows_wanted[self.rows]
        return self.rows[chosen], self.ids[chosen]

    def filter(self, keep: torch.Tensor, kept: int) -> "StopTable":
        """The rows marked in the [size] bool mask `keep` (`kept` of them), renumbered in order."""
        new_row = torch.cumsum(keep, 0) - 1
        chosen = keep[self.rows]
        return StopTable(new_row[self.rows[chosen]], self.ids[chosen], kept)

    def cat(self, other: "StopTable") -> "StopTable":
        """This table's rows, then the other's."""
        return StopTable(
            torch.cat([self.rows, other.rows + self.size]),
            torch.cat([self.ids, other.ids]),
            self.size + other.size,
        )
