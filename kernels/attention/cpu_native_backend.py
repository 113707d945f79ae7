"""CPU backend: decode attention by the native C kernel reading the KV pool in place; extend as in torch.

Against the torch backend's gather-then-SDPA, this skips copying every request's K/V out of the pool at
every layer of every step (the dominant decode cost at batch 64 on this machine).
"""

from __future__ import annotations

import ctypes

import torch

from kernels.attention.base import ForwardBatch, ForwardMode
from kernels.attention.torch_backend import TorchAttentionBackend


class CpuNativeAttentionBackend(TorchAttentionBackend):
    def __init__(self, lib: ctypes.CDLL, **kwargs) -> None:
        super().__init__(**kwargs)
        self.lib = lib
        self.num_threads = torch.get_num_threads()

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        if batch.mode is ForwardMode.DECODE:
            self._slots = batch.req_slots.contiguous()
            self._lens = batch.seq_lens.contiguous()
        else:
            super().init_forward_metadata(batch)

    def _decode(self, q, k_buf, v_buf) -> torch.Tensor:
        q = q.contiguous()
        out = torch.empty_like(q)
        table = self.req_to_token
        rc = self.lib.decode_attention(
            q.data_ptr(), k_buf.data_ptr(), v_buf.data_ptr(), out.data_ptr(), table.data_ptr(), table.stride(0),
            self._slots.data_ptr(), self._lens.data_ptr(), q.shape[0], self.num_heads, self.num_kv_heads,
            self.head_dim, self.scale, int(q.dtype == torch.bfloat16), self.num_threads,
        )
        if rc != 0:
            raise RuntimeError(f"native decode attention failed with code {rc}")
        return out
