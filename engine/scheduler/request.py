"""A request's life inside the scheduler."""

from __future__ import annotations

from engine.ipc.messages import FinishReason
from engine.sampling_params import SamplingParams


class Req:
    __slots__ = ("rid", "input_ids", "sampling", "stop_ids", "output_ids", "slot", "kv_len", "finished")

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
        self.kv_len = 0  # K/V tokens in the pool when it joins the running batch (the batch tracks it after)
        self.finished: FinishReason | None = None

    @property
    def prompt_len(self) -> int:
        return len(self.input_ids)

    @property
    def max_tokens(self) -> int:
        """The most KV this request can ever hold: its prompt plus every new token but the last."""
        return self.prompt_len + self.sampling.max_new_tokens - 1
