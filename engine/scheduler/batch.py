"""The running (decoding) batch: requests plus per-row tensors that persist across steps.

Tensors change only when requests join (merge) or leave (filter), so a decode step builds its inputs
from them without touching each request in Python.
"""

from __future__ import annotations

import torch

from engine.sampling.batch_params import SamplingTensors
from engine.sampling.stop_table import StopTable
from engine.scheduler.request import Req


def stop_table(reqs: list[Req], copies: int, device) -> StopTable:
    """Each request's stop token ids, `copies` rows each."""
    return StopTable.build([r.stop_ids for r in reqs for _ in range(copies)], device)


def sampling_tensors(reqs: list[Req], vocab_size: int, device) -> SamplingTensors:
    return SamplingTensors.build(
        [r.sampling for r in reqs],
        vocab_size,
        device,
        [r.input_ids for r in reqs],
        [r.output_ids for r in reqs],
        [(r.return_logprob, r.top_logprobs_num) for r in reqs],
    )


class RunningBatch:
    def __init__(
        self, reqs: list[Req], vocab_size: int, device, sampling: SamplingTensors | None = None
    ) -> None:
        """`sampling`: the requests' sampling tensors when already built (prefill builds them first)."""
        self.reqs = reqs
        self.vocab_size = vocab_size
        self.device = device
        self.slots = torch.tensor([r.slot for r in reqs], dtype=torch.int64, device=device)
        self.kv_lens = torch.tensor([r.kv_len for r in reqs], dtype=torch.int64, device=device)
        self.last_ids = torch.tensor(
            [r.output_ids[-1] if r.output_ids else 0 for r in reqs],
            dtype=torch.int64,
            device=device,
        )
        self.out_lens = torch.tensor(
            [len(r.output_ids) for r in reqs], dtype=torch.int64, device=device
        )
        self.max_new = torch.tensor(
            [r.sampling.max_new_tokens for r in reqs], dtype=torch.int64, device=device
        )
        self.stop_table = stop_table(reqs, 1, device)
        self.sampling = (
            sampling if sampling is not None else sampling_tensors(reqs, vocab_size, device)
        )
        self.rids = [r.rid for r in reqs]
        # structured output: each row's grammar matcher or None
        self.matchers = [r.matcher for r in reqs]
        self.any_grammar = any(m is not None for m in self.matchers)

    def __len__(self) -> int:
        return len(self.reqs)

    def remaining_new_tokens(self, clip: int) -> int:
        """Tokens the batch may still generate, each request's count clipped (an estimate's input)."""
        return int((self.max_new - self.out_lens).clamp(max=clip).sum()) if self.reqs else 0

    def filter(self, keep: torch.Tensor, keep_list: list[bool]) -> None:
        self.reqs = [r for r, k in zip(self.reqs, keep_list) if k]
        self.rids = [r.rid for r in self.reqs]
        self.matchers = [m for m, k in zip(self.matchers, keep_list) if k]
        self.any_grammar = any(m is not None for m in self.matchers)
        for name in ("slots", "kv_lens", "last_ids", "out_lens", "max_new"):
            setattr(self, name, getattr(self, name)[keep])
        self.stop_table = self.stop_table.filter(keep, len(self.reqs))
        self.sampling = self.sampling.filter(keep, keep_list)

    def merge(self, other: "RunningBatch") -> None:
        if not self.reqs:
            self.__dict__.update(other.__dict__)
            return
        self.reqs = self.reqs + other.reqs
        self.rids = self.rids + other.rids
        self.matchers = self.matchers + other.matchers
        self.any_grammar = self.any_grammar or other.any_grammar
        for name in ("slots", "kv_lens", "last_ids", "out_lens", "max_new"):
            setattr(self, name, torch.cat([getattr(self, name), getattr(other, name)]))
        self.stop_table = self.stop_table.cat(other.stop_table)
        self.sampling = self.sampling.merge(other.sampling)

    def clear(self) -> None:
        """Every request gone (failed or aborted): the batch empty, its tensors with it."""
        self.__dict__.update(RunningBatch([], self.vocab_size, self.device).__dict__)

    @classmethod
    def empty(cls, vocab_size: int, device) -> "RunningBatch":
        return cls([], vocab_size, device)
