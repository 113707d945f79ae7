"""Rotary tables (cos, sin per position), computed the way transformers computes them, scaling included."""

from __future__ import annotations

import torch


def inv_freq_and_scaling(hf_config, head_dim: int) -> tuple[torch.Tensor, float]:
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    if not params:  # transformers < 5 spelling
        params = dict(getattr(hf_config, "rope_scaling", None) or {})
    # at the top level, as transformers takes it
    params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        base = params["rope_theta"]
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        return inv_freq, 1.0
    if rope_type == "dynamic":
        raise ValueError(
            "rope_type 'dynamic' (NTK scaling that changes with sequence length) is not supported"
        )
    # transformers switches to the long factors past original_max_position_embeddings
    if rope_type == "longrope":
        raise ValueError(
            "rope_type 'longrope' (factors that change with sequence length) is not supported"
        )
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"unknown rope_type {rope_type!r}")
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, None)
    return inv_freq.float(), float(scaling)


def rotary_tables(
    hf_config, head_dim: int, max_positions: int, dtype, device
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of shape [max_positions, head_dim], in the model's dtype (as transformers casts them)."""
    inv_freq, scaling = inv_freq_and_scaling(hf_config, head_dim)
    positions = torch.arange(max_positions, dtype=torch.float)
    freqs = positions[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos = (emb.cos() * scaling).to(dtype=dtype, device=device)
    sin = (emb.sin() * scaling).to(dtype=dtype, device=device)
    return cos, sin
