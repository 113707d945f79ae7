"""The quantized modes' decode steps with their elementwise work in C (kernels/cpu/elementwise.c).

Why: at batch 1 the norms, rotary, residual adds and SiLU of 30 layers are about a thousand torch calls
per step, each a few microseconds of dispatch on a few hundred floats: 8 ms of a 25 ms step. Here each
layer makes four C calls for them, and each residual add is fused into the next norm. Only float32
decode steps of up to MAX_ROWS rows take this path, and only in the quantized modes, which promise
no token parity; the exact mode and every prefill keep llama.py's torch operations, so a prompt's
logits do not depend on this path.
"""

from __future__ import annotations

import types

import torch

from engine.model.llama import LlamaForCausalLM
from kernels.attention import AttentionBackend, ForwardBatch, ForwardMode

MAX_ROWS = 64


def install(model: LlamaForCausalLM, lib) -> LlamaForCausalLM:
    """Route the model's small float32 decode steps through decode_forward; everything else as before."""
    plain = model.forward

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, backend: AttentionBackend) -> torch.Tensor:
        if batch.mode is ForwardMode.DECODE and batch.input_ids.shape[0] <= MAX_ROWS:
            return decode_forward(self, batch, backend, lib)
        return plain(batch, backend)

    model.forward = types.MethodType(forward, model)
    return model


def decode_forward(model: LlamaForCausalLM, batch: ForwardBatch, backend: AttentionBackend, lib) -> torch.Tensor:
    """What LlamaForCausalLM.forward computes for a decode step, with the elementwise ops fused."""
    cfg = model.cfg
    backend.init_forward_metadata(batch)
    cos = model.rope_cos[batch.positions]  # gathers: fresh contiguous tensors
    sin = model.rope_sin[batch.positions]
    h = model.embed_tokens(batch.input_ids)
    t = h.shape[0]
    normed = torch.empty_like(h)
    pending = None  # the last block's output, added to h by the next norm
    q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    for layer in model.layers:
        attn = layer.self_attn
        _add_norm(lib, h, pending, layer.input_layernorm, normed)
        qkv = attn.qkv_proj(normed)  # quantized layers return contiguous rows (linear.py)
        lib.rotary_qkv(qkv.data_ptr(), t, qkv.stride(0), cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cos.data_ptr(),
                       sin.data_ptr())  # fmt: skip
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        out = backend.forward(q.view(t, cfg.num_heads, cfg.head_dim), k.view(t, cfg.num_kv_heads, cfg.head_dim),
                              v.view(t, cfg.num_kv_heads, cfg.head_dim), attn.layer_id, batch)  # fmt: skip
        a = attn.o_proj(out.reshape(t, q_size))
        _add_norm(lib, h, a, layer.post_attention_layernorm, normed)
        gate_up = layer.mlp.gate_up_proj(normed)
        act = torch.empty(t, gate_up.shape[1] // 2, dtype=torch.float32)
        lib.silu_mul(gate_up.data_ptr(), act.data_ptr(), t, act.shape[1])
        pending = layer.mlp.down_proj(act)
    _add_norm(lib, h, pending, model.norm, normed)
    return model.lm_head(normed).float()


def _add_norm(lib, h: torch.Tensor, add: torch.Tensor | None, norm, out: torch.Tensor) -> None:
    lib.add_rms_norm(h.data_ptr(), None if add is None else add.data_ptr(), norm.weight.data_ptr(), out.data_ptr(),
                     h.shape[0], h.shape[1], norm.eps)  # fmt: skip
