"""Attention in plain torch (scaled_dot_product_attention): the CPU backend and the fallback everywhere.

Decode gathers every request's K/V from the token pool through req_to_token in one indexing op per
layer and runs one batched SDPA with a length mask. Extend (prefill) attends each request's new
tokens to its cached prefix (gathered from the pool) plus its fresh keys, causally.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.kernels.attention.base import AttentionBackend
from engine.model.forward_batch import ForwardBatch, ForwardMode


class TorchAttentionBackend(AttentionBackend):
    def __init__(
        self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, kv_pool, req_to_token
    ):
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.kv_pool = kv_pool
        self.req_to_token = req_to_token
        self._gather_idx: torch.Tensor | None = None
        self._mask: torch.Tensor | None = None
        self._segments: list[tuple[int, int, int, int]] = []

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        if batch.mode is ForwardMode.DECODE:
            max_len = batch.max_seq_len
            self._gather_idx = self.req_to_token[batch.req_slots, :max_len]  # [B, L]
            arange = torch.arange(max_len, device=batch.seq_lens.device)
            # [B, 1, 1, L]
            self._mask = (arange[None, :] < batch.seq_lens[:, None])[:, None, None, :]
        else:
            slots = batch.req_slots.tolist()
            start = 0
            self._segments = []
            for slot, prefix, ext in zip(slots, batch.prefix_lens, batch.extend_lens):
                self._segments.append((start, ext, prefix, slot))
                start += ext

    def forward(self, q, k, v, layer_id: int, batch: ForwardBatch) -> torch.Tensor:
        k_buf = self.kv_pool.k_buffers[layer_id]
        v_buf = self.kv_pool.v_buffers[layer_id]
        k_buf[batch.out_cache_loc] = k
        v_buf[batch.out_cache_loc] = v
        if batch.mode is ForwardMode.DECODE:
            return self._decode(q, k_buf, v_buf)
        return self._extend(q, k, v, k_buf, v_buf)

    def _decode(self, q, k_buf, v_buf) -> torch.Tensor:
        idx = self._gather_idx
        # CPU SDPA is several times slower in bfloat16 than in float32 for one query token: compute in float32
        compute = torch.float32 if q.device.type == "cpu" else q.dtype
        keys = k_buf[idx].transpose(1, 2).to(compute)  # [B, Hkv, L, D]
        values = v_buf[idx].transpose(1, 2).to(compute)
        # [B, H, 1, D]
        out = F.scaled_dot_product_attention(
            q.unsqueeze(2).to(compute),
            keys,
            values,
            attn_mask=self._mask,
            scale=self.scale,
            enable_gqa=True,
        )
        return out.squeeze(2).to(q.dtype)

    def _extend(self, q, k, v, k_buf, v_buf) -> torch.Tensor:
        out = torch.empty_like(q)
        for start, ext, prefix, slot in self._segments:
            qi = q[start : start + ext].transpose(0, 1).unsqueeze(0)  # [1, H, ext, D]
            ki = k[start : start + ext]
            vi = v[start : start + ext]
            if prefix == 0:
                mask, causal = None, True
            else:
                idx = self.req_to_token[slot, :prefix]
                ki = torch.cat([k_buf[idx], ki], dim=0)
                vi = torch.cat([v_buf[idx], vi], dim=0)
                rows = torch.arange(ext, device=q.device)[:, None] + prefix
                mask, causal = torch.arange(prefix + ext, device=q.device)[None, :] <= rows, False
            oi = F.scaled_dot_product_attention(
                qi,
                ki.transpose(0, 1).unsqueeze(0),
                vi.transpose(0, 1).unsqueeze(0),
                attn_mask=mask,
                is_causal=causal,
                scale=self.scale,
                enable_gqa=True,
            )
            out[start : start + ext] = oi[0].transpose(0, 1)
        return out
