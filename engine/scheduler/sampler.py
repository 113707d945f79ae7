"""Batched sampling: one set of tensor ops for the whole batch, greedy and sampled rows side by side."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SamplingTensors:
    """Per-row sampling parameters of a batch, kept as tensors so a step builds nothing per request."""

    temperature: torch.Tensor  # [B] float32; 0 for greedy rows
    top_p: torch.Tensor  # [B] float32
    top_k: torch.Tensor  # [B] int64; vocab size when unlimited
    greedy: torch.Tensor  # [B] bool
    all_greedy: bool
    any_filter: bool  # some row uses top_p < 1 or a top_k

    @classmethod
    def from_params(cls, params, vocab_size: int, device) -> "SamplingTensors":
        greedy = [p.is_greedy for p in params]
        top_k = [p.top_k if p.top_k > 0 else vocab_size for p in params]
        top_p = [p.top_p for p in params]
        return cls(
            temperature=torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device),
            top_p=torch.tensor(top_p, dtype=torch.float32, device=device),
            top_k=torch.tensor(top_k, dtype=torch.int64, device=device),
            greedy=torch.tensor(greedy, dtype=torch.bool, device=device),
            all_greedy=all(greedy),
            any_filter=any(p < 1.0 for p in top_p) or any(k < vocab_size for k in top_k),
        )

    def filter(self, keep: torch.Tensor) -> "SamplingTensors":
        greedy = self.greedy[keep]
        top_p, top_k = self.top_p[keep], self.top_k[keep]
        return SamplingTensors(
            self.temperature[keep], top_p, top_k, greedy, bool(greedy.all()), self.any_filter
        )

    def merge(self, other: "SamplingTensors") -> "SamplingTensors":
        return SamplingTensors(
            torch.cat([self.temperature, other.temperature]),
            torch.cat([self.top_p, other.top_p]),
            torch.cat([self.top_k, other.top_k]),
            torch.cat([self.greedy, other.greedy]),
            self.all_greedy and other.all_greedy,
            self.any_filter or other.any_filter,
        )


def sample(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """Next token ids [B] from float32 logits [B, V]."""
    greedy_ids = logits.argmax(dim=-1)
    if st.all_greedy:
        return greedy_ids
    temperature = torch.where(st.greedy, torch.ones_like(st.temperature), st.temperature)  # greedy rows: unused
    probs = torch.softmax(logits / temperature[:, None], dim=-1)
    if st.any_filter:
        sorted_probs, sorted_idx = probs.sort(dim=-1, descending=True)
        ranks = torch.arange(probs.shape[-1], device=probs.device)
        drop = ranks[None, :] >= st.top_k[:, None]
        drop |= (sorted_probs.cumsum(dim=-1) - sorted_probs) > st.top_p[:, None]  # always keeps the top token
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        choice = torch.multinomial(sorted_probs, 1)
        sampled = sorted_idx.gather(1, choice).squeeze(1)
    else:
        sampled = torch.multinomial(probs, 1).squeeze(1)
    return torch.where(st.greedy, greedy_ids, sampled)
