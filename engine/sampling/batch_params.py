"""Per-row sampling parameters of a batch, kept as tensors so a step builds nothing per request.

Tensors change only when requests join (merge) or leave (filter). The [B, V] state for penalties
and logit bias exists only while some row in the batch uses them.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from engine.sampling_params import SamplingParams


@dataclass
class SamplingTensors:
    temperature: torch.Tensor  # [B] float32; 1 for greedy rows (unused there)
    top_p: torch.Tensor  # [B] float32
    top_k: torch.Tensor  # [B] int64; vocab size when unlimited
    min_p: torch.Tensor  # [B] float32
    greedy: torch.Tensor  # [B] bool
    min_new: torch.Tensor  # [B] int64
    repetition: torch.Tensor  # [B] float32
    frequency: torch.Tensor  # [B] float32
    presence: torch.Tensor  # [B] float32
    top_logprobs: torch.Tensor  # [B] int64, top logprobs to return per token (0: none)
    want_logprob: torch.Tensor  # [B] bool
    seeds: list[int | None]
    processors: list[tuple[str, dict] | None]  # custom logit processor name and params per row
    # [B, V] float32: each output token's count (frequency/presence)
    counts: torch.Tensor | None = None
    seen: torch.Tensor | None = None  # [B, V] bool: tokens in the prompt or output (repetition)
    bias: torch.Tensor | None = None  # [B, V] float32 logit bias

    vocab_size: int = 0

    def __post_init__(self) -> None:
        """Batch-wide flags, so a step skips every operation no row needs."""
        self.all_greedy = bool(self.greedy.all()) if self.greedy.numel() else True
        self.any_greedy = bool(self.greedy.any())
        self.any_top_k_p = bool((self.top_p < 1.0).any()) or bool(
            (self.top_k < self.vocab_size).any()
        )
        self.any_min_p = bool((self.min_p > 0).any())
        self.any_min_new = bool((self.min_new > 0).any())
        self.any_logprob = bool(self.want_logprob.any())
        self.max_top_logprobs = int(self.top_logprobs.max()) if self.top_logprobs.numel() else 0
        self.any_seed = any(s is not None for s in self.seeds)
        self.any_processor = any(p is not None for p in self.processors)
        # which penalties some row uses: a step applies only those (each is a few passes over [B, V])
        self.any_repetition = bool((self.repetition != 1.0).any())
        self.any_frequency = bool((self.frequency != 0.0).any())
        self.any_presence = bool((self.presence != 0.0).any())

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        vocab_size: int,
        device,
        prompts: list[list[int]],
        outputs: list[list[int]],
        logprob: list[tuple[bool, int]],
    ) -> "SamplingTensors":
        def t(values, dtype):
            return torch.tensor(values, dtype=dtype, device=device)

        greedy = [p.is_greedy for p in params]
        st = cls(
            temperature=t(
                [1.0 if g else p.temperature for p, g in zip(params, greedy)], torch.float32
            ),
            top_p=t([p.top_p for p in params], torch.float32),
            top_k=t(
                [min(p.top_k, vocab_size) if p.top_k > 0 else vocab_size for p in params],
                torch.int64,
            ),
            min_p=t([p.min_p for p in params], torch.float32),
            greedy=t(greedy, torch.bool),
            min_new=t([p.min_new_tokens for p in params], torch.int64),
            repetition=t([p.repetition_penalty for p in params], torch.float32),
            frequency=t([p.frequency_penalty for p in params], torch.float32),
            presence=t([p.presence_penalty for p in params], torch.float32),
            top_logprobs=t([n if want else 0 for want, n in logprob], torch.int64),
            want_logprob=t([want for want, _ in logprob], torch.bool),
            seeds=[p.seed for p in params],
            processors=[
                (p.custom_logit_processor, p.custom_params or {})
                if p.custom_logit_processor
                else None
                for p in params
            ],
            counts=_penalty_counts(params, vocab_size, device, outputs),
            seen=_seen(params, vocab_size, device, prompts, outputs),
            bias=_bias(params, vocab_size, device),
            vocab_size=vocab_size,
        )
        return st

    def filter(self, keep: torch.Tensor, keep_list: list[bool]) -> "SamplingTensors":
        return self.take(keep, [i for i, k in enumerate(keep_list) if k])

    def take(self, index: torch.Tensor, index_list: list[int]) -> "SamplingTensors":
        """The rows `index` picks (a bool mask or row numbers; `index_list`: the row numbers), in order,
        repeats allowed: beams that continue another beam take its penalty state. The [B, V] state goes
        once no row left needs it: a full pass per step each, for nothing."""
        values = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, torch.Tensor):
                values[f.name] = v[index]
            elif isinstance(v, list):
                values[f.name] = [v[i] for i in index_list]
            else:  # None, or the vocabulary size
                values[f.name] = v
        if values["counts"] is not None and not _any_penalty(
            values["repetition"], values["frequency"], values["presence"]
        ):
            values["counts"] = values["seen"] = None
        # a bias of 0 changes nothing either
        if values["bias"] is not None and not bool(values["bias"].any()):
            values["bias"] = None
        return SamplingTensors(**values)

    def merge(self, other: "SamplingTensors") -> "SamplingTensors":
        values = {}
        vocab_size = max(self.vocab_size, other.vocab_size)
        n_self, n_other = len(self.seeds), len(other.seeds)
        for f in fields(self):
            a, b = getattr(self, f.name), getattr(other, f.name)
            if isinstance(a, list):
                values[f.name] = a + b
            elif f.name == "vocab_size":
                values[f.name] = vocab_size
            elif a is None and b is None:
                values[f.name] = None
            elif f.name in ("counts", "seen", "bias"):  # optional [B, V] state: zeros where absent
                dtype = torch.bool if f.name == "seen" else torch.float32
                device = (a if a is not None else b).device
                a = (
                    a
                    if a is not None
                    else torch.zeros(n_self, vocab_size, dtype=dtype, device=device)
                )
                b = (
                    b
                    if b is not None
                    else torch.zeros(n_other, vocab_size, dtype=dtype, device=device)
                )
                values[f.name] = torch.cat([a, b])
            else:
                values[f.name] = torch.cat([a, b])
        return SamplingTensors(**values)

    def record(self, next_ids: torch.Tensor) -> None:
        """After sampling: count each row's new token for the penalties."""
        if self.counts is not None:
            rows = torch.arange(next_ids.shape[0], device=next_ids.device)
            self.counts[rows, next_ids] += 1
            self.seen[rows, next_ids] = True


def _any_penalty(repetition: torch.Tensor, frequency: torch.Tensor, presence: torch.Tensor) -> bool:
    return bool(((repetition != 1.0) | (frequency != 0.0) | (presence != 0.0)).any())


def _penalty_counts(params, vocab_size, device, outputs) -> torch.Tensor | None:
    if not any(p.uses_penalties for p in params):
        return None
    counts = torch.zeros(len(params), vocab_size, dtype=torch.float32, device=device)
    for row, out in enumerate(outputs):  # only tokens generated before a retraction: usually none
        if out:
            counts[row].index_add_(
                0, torch.tensor(out, device=device), torch.ones(len(out), device=device)
            )
    return counts


def _seen(params, vocab_size, device, prompts, outputs) -> torch.Tensor | None:
    if not any(p.uses_penalties for p in params):
        return None
    seen = torch.zeros(len(params), vocab_size, dtype=torch.bool, device=device)
    for row, (p, prompt, out) in enumerate(zip(params, prompts, outputs)):
        if p.repetition_penalty != 1.0:
            seen[row, torch.tensor(prompt + out, dtype=torch.int64, device=device)] = True
    return seen


def _bias(params, vocab_size, device) -> torch.Tensor | None:
    if not any(p.logit_bias for p in params):
        return None
    bias = torch.zeros(len(params), vocab_size, dtype=torch.float32, device=device)
    for row, p in enumerate(params):
        for token, value in p.logit_bias:
            bias[row, token] = value
    return bias
