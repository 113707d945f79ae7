"""Elementwise building blocks, written to match Hugging Face's Llama numerics exactly in float32."""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in float32.

    float32 input: exactly transformers' order of operations (greedy parity depends on it). Lower
    precision: the weight multiply also happens in float32 with a single cast at the end, which on the
    CPU is about twice as fast as transformers' cast-then-multiply in bfloat16 (and no less accurate).
    """
    input_dtype = x.dtype
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    if input_dtype == torch.float32:
        return weight * h
    return (h * weight.to(torch.float32)).to(input_dtype)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU on a fused [.., 2 * I] gate/up projection."""
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
