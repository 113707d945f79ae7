"""The contract between the model and an attention backend.

The model hands every layer's q/k/v for the batch's new tokens; the backend stores k/v into the
token-level KV pool at `out_cache_loc` and attends over each request's whole sequence, which it
finds through the `req_to_token` table (row = request slot, column = position, value = pool index).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from engine.model.forward_batch import ForwardBatch


class AttentionBackend(ABC):
    """Per-step metadata is built once (init_forward_metadata) and reused by every layer."""

    @abstractmethod
    def init_forward_metadata(self, batch: ForwardBatch) -> None: ...

    @abstractmethod
    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, batch: ForwardBatch
    ) -> torch.Tensor:
        """q [T, H, D], k/v [T, Hkv, D] for the new tokens -> attention output [T, H, D]."""
