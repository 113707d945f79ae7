"""A request's life inside the scheduler."""

from __future__ import annotations

import torch

from engine.ipc.messages import FinishReason
from engine.sampling_params import SamplingParams


class Req:
    __slots__ = (
        "rid",
        "input_ids",
        "sampling",
        "stop_ids",
        "output_ids",
        "slot",
        "kv_len",
        "finished",
        "fill_ids",
        "prefix_indices",
        "cache_node",
        "cached_tokens",
        "admissions",
        "return_logprob",
        "top_logprobs_num",
        "logprob_from",
        "logprob_start_len",
        "input_logprobs",
        "input_top",
        "header_sent",
        "trace_context",
        "arrived_ns",
        "received_ns",
        "admitted_ns",
        "first_token_ns",
        "seq",
        "beam",
        "beam_slots",
        "beam_steps",
        "grammar",
        "matcher",
        "taps",
    )

    def __init__(
        self,
        rid: str,
        input_ids: list[int],
        sampling: SamplingParams,
        eos_ids: tuple[int, ...],
        return_logprob: bool = False,
        top_logprobs_num: int = 0,
        logprob_start_len: int = -1,
        trace_context: dict[str, str] | None = None,
        arrived_ns: int = 0,
        received_ns: int = 0,
        seq: int = 0,
        beam=None,
    ) -> None:
        self.rid = rid
        self.seq = seq  # the user process's submission number (0: not given)
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
        # pool indices the radix cache lent this request
        self.prefix_indices: torch.Tensor | None = None
        # the tree node those indices end at, locked while the request holds them
        self.cache_node = None
        self.cached_tokens = 0  # prompt tokens that came from the cache at first admission
        self.admissions = 0  # more than one: the request was retracted and resumed
        self.return_logprob = return_logprob
        self.top_logprobs_num = top_logprobs_num if return_logprob else 0
        # prompt logprobs: the first prompt position whose hidden state the prefill must compute (so
        # the prefix cache may lend no more than that), None when the request wants none
        want_prompt = return_logprob and 0 <= logprob_start_len < len(input_ids)
        self.logprob_from: int | None = max(logprob_start_len - 1, 0) if want_prompt else None
        self.logprob_start_len = logprob_start_len if want_prompt else -1
        self.input_logprobs: list = []
        self.input_top: list = []
        self.reset_prompt_logprobs()
        self.header_sent = False  # the first output carries a RequestHeader
        # W3C trace headers from the user process, and wall-clock times (ns, 0: not reached) for spans
        self.trace_context = trace_context or {}
        self.arrived_ns = arrived_ns  # sent by the user process (its queue time starts there)
        self.received_ns = received_ns  # read by the scheduler
        self.admitted_ns = 0  # first admission
        self.first_token_ns = 0
        self.beam = beam  # BeamParams: a beam search (engine/beam_search)
        self.beam_slots: list[
            int
        ] = []  # a beam search's extra request slots, one per beam after the first
        self.beam_steps = 0  # a beam search's selections, set when it ends
        # structured output: the compile's future (engine/grammar), None: no constraint
        self.grammar = None
        self.matcher = None  # its grammar matcher, from admission on
        # engine.taps.request.RequestTaps: steering, plugin taps, hidden states; None: untapped
        self.taps = None

    @property
    def prompt_len(self) -> int:
        return len(self.input_ids)

    @property
    def cache_prefix_len(self) -> int:
        return 0 if self.prefix_indices is None else int(self.prefix_indices.numel())

    def reset_prompt_logprobs(self) -> None:
        """Start the prompt logprobs over (also when a chunked prefill is retracted and redone)."""
        # the first prompt token has no logprob
        first = [None] if self.logprob_start_len == 0 else []
        self.input_logprobs, self.input_top = list(first), list(first)

    def max_prefix(self) -> int:
        """How many fill tokens the prefix cache may lend: all but the last, none whose prompt
        logprobs or hidden states are wanted (only a prefill computes them), none to a steered request."""
        limit = len(self.fill_ids) - 1
        if self.logprob_from is not None and not self.header_sent:
            limit = min(limit, self.logprob_from)
        if self.taps is not None:  # steered, or hidden states wanted from a position on
            taps_limit = self.taps.prefix_limit()
            if taps_limit is not None:
                limit = min(limit, taps_limit)
        return limit

    def all_ids(self) -> list[int]:
        return self.input_ids + self.output_ids
