"""The contract between the model and an attention backend.

The model hands every layer's q/k/v for the batch's new tokens; the backend stores k/v into the
token-level KV pool at `out_cache_loc` and attends over each request's whole sequence, which it
finds through the `req_to_token` table (row = request slot, column = position, value = pool index).
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

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
    logits_indices: torch.Tensor  # [B] row in T whose hidden state gives each request's next-token logits
    extend_lens: list[int] = field(default_factory=list)  # EXTEND only: new tokens per request
    prefix_lens: list[int] = field(default_factory=list)  # EXTEND only: tokens already in the pool


class AttentionBackend(ABC):
    """Per-step metadata is built once (init_forward_metadata) and reused by every layer."""

    @abstractmethod
    def init_forward_metadata(self, batch: ForwardBatch) -> None: ...

    @abstractmethod
    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, batch: ForwardBatch
    ) -> torch.Tensor:
        """q [T, H, D], k/v [T, Hkv, D] for the new tokens -> attention output [T, H, D]."""
