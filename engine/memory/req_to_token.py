"""Request slots: row r of `table` lists, position by position, the KV-pool index of request r's tokens."""

from __future__ import annotations

import torch

from engine.memory.kv_pool import lazy_zeros


class ReqToTokenPool:
    def __init__(self, size: int, max_context_len: int, device: str) -> None:
        self.size = size
        self.max_context_len = max_context_len
        # 16 MB, mostly never written
        self.table = lazy_zeros((size, max_context_len), torch.int64, device)
        self._free: list[int] = list(range(size))

    @property
    def available(self) -> int:
        return len(self._free)

    def alloc(self) -> int | None:
        return self._free.pop() if self._free else None

    def free(self, slot: int) -> None:
        self._free.append(slot)
