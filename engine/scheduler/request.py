"""A request's life inside the scheduler."""

from __future__ import annotations

import torch

from engine.ipc.messages import FinishReason
from engine.sampling_params import SamplingParams


class Req:
    __slots__ = (
        "rid", "input_ids", "sampling", "stop_ids", "output_ids", "slot", "kv_len", "finished",
        "fill_ids", "prefix_indices", "cache_node", "cached_tokens", "admissions",
    )  # fmt: skip

    def __init__(self, rid: str, input_ids: list[int], sampling: SamplingParams, eos_ids: tuple[int, ...]) -> None:
        self.rid = rid
        self.input_ids = input_ids
        self.sampling = sampling
        stop = list(sampling.stop_token_ids)
        if not sampling.ignore_eos:
            stop += [t for t in eos_ids if t not in stop]
        self.stop_ids = tuple(stop)
        self.output_ids: list[int] = []
        self.slot: int | None = None
        # K/V tokens in the pool for fill_ids (cached prefix + chunks prefilled so far); the running batch
        # tracks it in a tensor once the request decodes
        self.kv_len = 0
        self.finished: FinishReason | None = None
        # what the next prefill computes K/V for: the prompt, plus the tokens generated before a retraction
        self.fill_ids: list[int] = input_ids
        self.prefix_indices: torch.Tensor | None = None  # pool indices the radix cache lent this request
        self.cache_node = None  # the tree node those indices end at, locked while the request holds them
        self.cached_tokens = 0  # prompt tokens that came from the cache at first admission
        self.admissions = 0  # more than one: the request was retracted and resumed

    @property
    def prompt_len(self) -> int:
        return len(self.input_ids)

    @property
    def cache_prefix_len(self) -> int:
        return 0 if self.prefix_indices is None else int(self.prefix_indices.numel())

    def all_ids(self) -> list[int]:
        return self.input_ids + self.output_ids
