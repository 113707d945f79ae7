"""Token-granular KV pool: per layer one K and one V buffer of [size + 1, kv_heads, head_dim].

Index 0 is a padding slot that is never handed out, so padded gathers read harmless memory.
Free indices live in one tensor, so allocating and freeing many tokens is a single slice or cat.
On the CPU the buffers are the kernel's zero pages until first written (lazy_zeros): the pool is sized
from free memory, gigabytes, and filling it up front made the scheduler resident at its full size idle.
"""

from __future__ import annotations

import math
import mmap

import torch


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: str) -> torch.Tensor:
    """Zeros that take memory only as they are written: a private anonymous mapping of their own, whose
    pages are the kernel's shared zero page until first written and go back to the system when the
    tensor is freed. Not calloc (numpy's zeros): calloc maps fresh pages only when malloc has no freed
    heap memory to reuse, and reused memory it clears byte by byte, making a whole pool resident (seen in
    a test process whose earlier tests had freed hundreds of MB); torch.zeros writes every byte always."""
    nbytes = math.prod(shape) * dtype.itemsize
    if torch.device(device).type != "cpu" or not nbytes or not hasattr(mmap, "MAP_PRIVATE"):
        return torch.zeros(shape, dtype=dtype, device=device)
    pages = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(pages, dtype=dtype).view(shape)  # the tensor holds the mapping alive


class TokenKVPool:
    def __init__(
        self, size: int, num_layers: int, num_kv_heads: int, head_dim: int, dtype, device: str
    ) -> None:
        self.size = size
        self.device = device
        shape = (size + 1, num_kv_heads, head_dim)
        self.k_buffers = [lazy_zeros(shape, dtype, device) for _ in range(num_layers)]
        self.v_buffers = [lazy_zeros(shape, dtype, device) for _ in range(num_layers)]
        self._free = torch.arange(1, size + 1, dtype=torch.int64, device=device)
        self._num_free = size

    @property
    def available(self) -> int:
        return self._num_free

    def alloc(self, n: int) -> torch.Tensor | None:
        """n pool indices, or None when the pool has fewer free (the caller queues instead)."""
        if n > self._num_free:
            return None
        # not a view: held indices (a beam's, a step's) would keep a whole free list alive
        out = self._free[:n].clone()
        self._free = self._free[n:]
        self._num_free -= n
        return out

    def free(self, indices: torch.Tensor) -> None:
        """Freed indices go to the front: the next allocation reuses memory already touched (and likely in
        cache) rather than faulting in fresh pages of the pool."""
        if indices.numel():
            self._free = torch.cat([indices.to(torch.int64), self._free])
            self._num_free += int(indices.numel())

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype) -> int:
        return (
            2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
        )
