"""Token-granular KV pool: per layer one K and one V buffer of [size + 1, kv_heads, head_dim].

Index 0 is a padding slot that is never handed out, so padded gathers read harmless memory.
Free indices live in one tensor, so allocating and freeing many tokens is a single slice or cat.
"""

from __future__ import annotations

import torch


class TokenKVPool:
    def __init__(self, size: int, num_layers: int, num_kv_heads: int, head_dim: int, dtype, device: str) -> None:
        self.size = size
        self.device = device
        shape = (size + 1, num_kv_heads, head_dim)
        self.k_buffers = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v_buffers = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self._free = torch.arange(1, size + 1, dtype=torch.int64, device=device)
        self._num_free = size

    @property
    def available(self) -> int:
        return self._num_free

    def alloc(self, n: int) -> torch.Tensor | None:
        """n pool indices, or None when the pool has fewer free (the caller queues instead)."""
        if n > self._num_free:
            return None
        out = self._free[:n]
        self._free = self._free[n:]
        self._num_free -= n
        return out

    def free(self, indices: torch.Tensor) -> None:
        if indices.numel():
            self._free = torch.cat([self._free, indices.to(torch.int64)])
            self._num_free += int(indices.numel())

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
