"""CPU backend: native C kernels that read the KV pool in place, for decode and for extend (prefill).

Against the torch backend's gather-then-SDPA, decode skips copying every request's K/V out of the
pool at every layer of every step (the dominant decode cost at batch 64 on this machine), and extend
replaces torch's CPU flash kernel, which is slow at head_dim 64 with GQA (about 45 GFLOP/s).
"""

from __future__ import annotations

import ctypes
from typing import Callable

import torch

from engine.model.forward_batch import ForwardBatch, ForwardMode
from engine.kernels.attention.torch_backend import TorchAttentionBackend


DECODE, EXTEND = 1, 2  # native_support() bits


def native_support(lib: ctypes.CDLL, num_heads: int, num_kv_heads: int, head_dim: int) -> int:
    """Which kernels this build computes for the shape (DECODE | EXTEND bits); asked once, at start."""
    return int(lib.native_support(num_heads, num_kv_heads, head_dim))


class CpuNativeAttentionBackend(TorchAttentionBackend):
    """Native decode; native extend where the build and head_dim allow (AVX-512 and head_dim a multiple of
    16, or AVX2 with FMA and a multiple of 8), torch's otherwise. Decided here, once: a kernel's
    non-zero code in a step is an error."""

    def __init__(self, lib: ctypes.CDLL, native_extend: bool = True, **kwargs) -> None:
        super().__init__(**kwargs)
        self.lib = lib
        self.num_threads = torch.get_num_threads()
        support = native_support(lib, self.num_heads, self.num_kv_heads, self.head_dim)
        if not support & DECODE:
            raise ValueError(
                f"the native kernels do not handle {self.num_heads} heads ({self.num_kv_heads} KV heads) of "
                f"head_dim {self.head_dim}"
            )
        self.native_extend = bool(support & EXTEND) and native_extend
        pool = self.kv_pool.k_buffers[
            0
        ].dtype  # the one-call decode's storage types: float32, bfloat16
        self._one_call_dtype = pool if pool in (torch.float32, torch.bfloat16) else None

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        self._slots = batch.req_slots.contiguous()
        if batch.mode is ForwardMode.DECODE:
            self._lens = batch.seq_lens.contiguous()
            self._out_loc = batch.out_cache_loc.to(torch.int64).contiguous()
            # what every layer's _decode_rows passes, looked up once a step
            table = self.req_to_token
            self._step_args = (
                self._out_loc.data_ptr(),
                table.data_ptr(),
                table.stride(0),
                self._slots.data_ptr(),
                self._lens.data_ptr(),
            )
        elif not self.native_extend:
            super().init_forward_metadata(batch)
        else:
            ext = torch.tensor(batch.extend_lens, dtype=torch.int64)
            self._prefix = torch.tensor(batch.prefix_lens, dtype=torch.int64)
            self._ext = ext
            self._q_start = torch.cumsum(ext, 0) - ext

    def forward(self, q, k, v, layer_id: int, batch: ForwardBatch) -> torch.Tensor:
        """Decode from the fused qkv rows as the model leaves them (q, k, v views of one row, rows of one
        stride): the K/V store and the attention in one C call, where the torch path makes two index_put
        and a copy of q a layer. Any other layout, and extend, goes the general way."""
        if batch.mode is not ForwardMode.DECODE or not self._one_row_layout(q, k, v):
            return super().forward(q, k, v, layer_id, batch)
        out = torch.empty(q.shape, dtype=q.dtype)
        self._store_and_decode(
            layer_id,
            q.data_ptr(),
            k.data_ptr(),
            v.data_ptr(),
            q.stride(0),
            out.data_ptr(),
            q.shape[0],
            int(q.dtype == torch.bfloat16),
        )
        return out

    def _one_row_layout(self, q, k, v) -> bool:
        return (
            q.dtype == k.dtype == v.dtype == self._one_call_dtype
            # one row: its stride is unused
            and (q.shape[0] == 1 or q.stride(0) == k.stride(0) == v.stride(0))
            and all(t.stride(-1) == 1 and t.stride(-2) == self.head_dim for t in (q, k, v))
        )

    def _extend(self, q, k, v, k_buf, v_buf) -> torch.Tensor:
        if not self.native_extend:
            return super()._extend(q, k, v, k_buf, v_buf)
        q = q.contiguous()
        out = torch.empty_like(q)
        table = self.req_to_token
        rc = self.lib.extend_attention(
            q.data_ptr(),
            k_buf.data_ptr(),
            v_buf.data_ptr(),
            out.data_ptr(),
            table.data_ptr(),
            table.stride(0),
            self._slots.data_ptr(),
            self._prefix.data_ptr(),
            self._ext.data_ptr(),
            self._q_start.data_ptr(),
            self._ext.shape[0],
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            self.scale,
            int(q.dtype == torch.bfloat16),
            self.num_threads,
        )
        if rc != 0:
            raise RuntimeError(f"native extend attention failed with code {rc}")
        return out

    def _decode(self, q, k_buf, v_buf) -> torch.Tensor:
        q = q.contiguous()
        out = torch.empty_like(q)
        table = self.req_to_token
        rc = self.lib.decode_attention(
            q.data_ptr(),
            k_buf.data_ptr(),
            v_buf.data_ptr(),
            out.data_ptr(),
            table.data_ptr(),
            table.stride(0),
            self._slots.data_ptr(),
            self._lens.data_ptr(),
            q.shape[0],
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            self.scale,
            int(q.dtype == torch.bfloat16),
            self.num_threads,
        )
        if rc != 0:
            raise RuntimeError(f"native decode attention failed with code {rc}")
        return out

    def rows_decoder(self) -> Callable[[int, int, int, int, int, int, int], None] | None:
        """For engine/model/fused_decode.py: f(layer_id, q, k, v, row_stride, out, rows) on the addresses of
        rows in the pool's dtype (the new K and V stored into the pool, q attended, [rows, H, D] written at
        out), one C call; None unless the pool is float32 or bfloat16."""
        if self._one_call_dtype is None:
            return None
        is_bf16 = int(self._one_call_dtype == torch.bfloat16)

        def decode_rows(
            layer_id: int, q: int, k: int, v: int, row_stride: int, out: int, rows: int
        ) -> None:
            self._store_and_decode(layer_id, q, k, v, row_stride, out, rows, is_bf16)

        return decode_rows

    def layers_decoder_args(self) -> dict | None:
        """For engine/model/decode_layers.py (a float32 decode step's layers in one C call,
        decode_attention_store among them): each layer's K and V buffer addresses (the pool's, fixed for its
        life), the threads and scale every layer's call passes; None unless the pool is float32."""
        if self._one_call_dtype != torch.float32:
            return None
        return {
            "k": [b.data_ptr() for b in self.kv_pool.k_buffers],
            "v": [b.data_ptr() for b in self.kv_pool.v_buffers],
            "threads": self.num_threads,
            "scale": self.scale,
        }

    def step_args(self) -> tuple[int, int, int, int, int]:
        """(out_loc, req_to_token, its row stride, slots, lens) of the decode step init_forward_metadata
        prepared, as the addresses decode_attention_store takes."""
        return self._step_args

    def _store_and_decode(
        self,
        layer_id: int,
        q: int,
        k: int,
        v: int,
        row_stride: int,
        out: int,
        rows: int,
        is_bf16: int,
    ) -> None:
        out_loc, table, stride, slots, lens = self._step_args
        rc = self.lib.decode_attention_store(
            q,
            k,
            v,
            row_stride,
            out_loc,
            self.kv_pool.k_buffers[layer_id].data_ptr(),
            self.kv_pool.v_buffers[layer_id].data_ptr(),
            out,
            table,
            stride,
            slots,
            lens,
            rows,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            self.scale,
            is_bf16,
            self.num_threads,
        )
        if rc != 0:
            raise RuntimeError(f"native decode attention failed with code {rc}")
