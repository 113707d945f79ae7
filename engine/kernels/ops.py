"""Elementwise building blocks, written to match Hugging Face's Llama numerics exactly in float32.

On the CPU both float32 and bfloat16 go to the native kernels (engine/kernels/cpu/elementwise.c,
elementwise_bf16.c) when they are built: one pass each instead of a torch call per operation, in
transformers' order of operations (bfloat16: rounded where torch rounds; float32: summation order
and exp aside, see elementwise.c). ENGINE_NATIVE_KERNELS=0 keeps torch's operations.
"""

from __future__ import annotations

import torch

from engine.kernels.cpu import load_native


def _native(*tensors: torch.Tensor):
    """(library, is_bf16) when every tensor is a contiguous CPU tensor of one dtype, float32 or bfloat16, and
    the kernels are built; else (None, False)."""
    dtype = tensors[0].dtype
    if dtype not in (torch.float32, torch.bfloat16):
        return None, False
    for t in tensors:
        if t.dtype is not dtype or t.device.type != "cpu" or not t.is_contiguous():
            return None, False
    return load_native(), dtype is torch.bfloat16


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in float32.

    float32 input: exactly transformers' order of operations (greedy parity depends on it). Lower
    precision: the weight multiply also happens in float32 with a single cast at the end, which on the
    CPU is about twice as fast as transformers' cast-then-multiply in bfloat16 (and no less accurate).
    """
    lib, bf16 = _native(x, weight) if weight.numel() == x.shape[-1] else (None, False)
    if lib is not None:
        return _native_add_rms_norm(lib, bf16, x, None, weight, eps)
    input_dtype = x.dtype
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    if input_dtype == torch.float32:
        return weight * h
    return (h * weight.to(torch.float32)).to(input_dtype)


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float):
    """(h + delta, rms_norm(h + delta)): a residual add and the norm after it. The native bfloat16 path adds
    into h in place (h is the running hidden state, which nothing else holds); without delta, only the norm."""
    # else torch broadcasts or raises
    fits = weight.numel() == h.shape[-1] and (delta is None or delta.shape == h.shape)
    lib, bf16 = _native(h, weight, *(() if delta is None else (delta,))) if fits else (None, False)
    if lib is None:
        if delta is not None:
            h = h + delta
        return h, rms_norm(h, weight, eps)
    return h, _native_add_rms_norm(lib, bf16, h, delta, weight, eps)


def _native_add_rms_norm(
    lib, bf16: bool, h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
):
    """The native kernel: h += delta in place (when given), returns the normed rows."""
    out = torch.empty_like(h)
    kernel = lib.add_rms_norm_bf16 if bf16 else lib.add_rms_norm
    kernel(
        h.data_ptr(),
        None if delta is None else delta.data_ptr(),
        weight.data_ptr(),
        out.data_ptr(),
        h.numel() // h.shape[-1],
        h.shape[-1],
        eps,
        torch.get_num_threads(),
    )
    return out


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU on a fused [.., 2 * I] gate/up projection."""
    lib, bf16 = _native(gate_up) if gate_up.shape[-1] % 2 == 0 else (None, False)
    if lib is not None:
        inter = gate_up.shape[-1] // 2
        out = gate_up.new_empty(*gate_up.shape[:-1], inter)
        (lib.silu_mul_bf16 if bf16 else lib.silu_mul)(
            gate_up.data_ptr(),
            out.data_ptr(),
            gate_up.numel() // gate_up.shape[-1],
            inter,
            torch.get_num_threads(),
        )
        return out
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """Rotate q [T, H, D] and k [T, Hkv, D] by per-token cos/sin [T, D] (neox layout: halves rotate)."""
    cos = cos.unsqueeze(1)
    sin = sin.unsqueeze(1)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def rotate_qkv(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    heads: int,
    kv_heads: int,
    head_dim: int,
):
    """q [T, H, D], k [T, Hkv, D], v [T, Hkv, D] of fused qkv rows [T, (H + 2 Hkv) D], q and k rotated.
    The native path rotates in place in qkv and returns views of it."""
    t = qkv.shape[0]
    fits = (
        qkv.dim() == 2
        and qkv.shape[1] == (heads + 2 * kv_heads) * head_dim
        and cos.shape == sin.shape == (t, head_dim)
    )
    # else torch's path: its broadcast or its error
    lib, bf16 = _native(qkv, cos, sin) if fits else (None, False)
    if lib is not None:
        kernel = lib.rotary_qkv_bf16 if bf16 else lib.rotary_qkv
        kernel(
            qkv.data_ptr(),
            t,
            qkv.stride(0),
            heads,
            kv_heads,
            head_dim,
            cos.data_ptr(),
            sin.data_ptr(),
            torch.get_num_threads(),
        )
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q, k, v = (
        q.view(t, heads, head_dim),
        k.view(t, kv_heads, head_dim),
        v.view(t, kv_heads, head_dim),
    )
    if lib is None:
        q, k = apply_rotary(q, k, cos, sin)
    return q, k, v
