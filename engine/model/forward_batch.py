"""What one forward pass takes: the batch the scheduler builds and the model and attention backends read."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import torch


class ForwardMode(enum.Enum):
    EXTEND = "extend"  # prefill: several new tokens per request, after an optional cached prefix
    DECODE = "decode"  # one new token per request


@dataclass
class ForwardBatch:
    """Everything one forward pass needs; tensors live on the model's device."""

    mode: ForwardMode
    input_ids: torch.Tensor  # [T] new tokens, requests concatenated
    positions: torch.Tensor  # [T]
    out_cache_loc: torch.Tensor  # [T] pool index where each new token's K/V goes
    req_slots: torch.Tensor  # [B] rows of req_to_token
    seq_lens: torch.Tensor  # [B] sequence length after this pass (prefix + new)
    max_seq_len: int  # max of seq_lens, as a Python int
    # [B] row in T whose hidden state gives each request's next-token logits
    logits_indices: torch.Tensor
    extend_lens: list[int] = field(default_factory=list)  # EXTEND only: new tokens per request
    prefix_lens: list[int] = field(default_factory=list)  # EXTEND only: tokens already in the pool
    # engine.taps.plan.TapPlan: steering, plugin taps and captures at chosen layers; None: untapped
    taps: Any = None
