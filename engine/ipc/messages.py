"""Wire types. Every message is a msgspec struct, tagged, so each channel decodes into a checked union.

Channels (all PUSH/PULL over ipc://):
    tokenizer manager --ToScheduler-->   scheduler
    scheduler         --ToDetokenizer--> detokenizer
    detokenizer       --ToTokenizer-->   tokenizer manager
"""

from __future__ import annotations

from typing import Union

import msgspec

from engine.sampling_params import SamplingParams
from engine.taps.spec import HiddenStates, LayerRequest


class TokenizedRequest(msgspec.Struct, array_like=True):
    """One request after tokenization. `trace_context` holds W3C trace headers (traceparent,
    tracestate) as plain strings: the parent of the spans the scheduler and detokenizer make."""

    rid: str
    input_ids: list[int]
    sampling: SamplingParams
    trace_context: dict[str, str] = {}
    return_logprob: bool = False
    top_logprobs_num: int = 0
    logprob_start_len: int = -1  # first prompt position with a returned logprob; -1: none
    # wall-clock ns when the user process sent it: where its queue time starts
    submitted_ns: int = 0
    seq: int = 0  # the user process's submission number: with rid, names this request for aborts
    # set: a beam search (engine/beam_search), not a sampled request
    beam: Union["BeamParams", None] = None
    # hidden states, steering and plugin taps asked of the layers (engine/taps)
    layers: Union[LayerRequest, None] = None


class BeamParams(msgspec.Struct, array_like=True, frozen=True, omit_defaults=True):
    """A beam search's shape and rules (transformers' meaning for each)."""

    width: int  # K live beams
    num_return: int = 1  # R <= K hypotheses returned, best first
    length_penalty: float = 1.0  # score = cumulative logprob / generated length ** length_penalty
    early_stopping: Union[bool, str] = False  # False, True or "never"


STOP_STRING_MATCHED = "stopped: a stop string matched"  # AbortRequest.message from the detokenizer


class AbortRequest(msgspec.Struct, tag="abort", array_like=True):
    """Stop these requests now (the caller's abort, or the detokenizer after a stop string matched).
    Unknown or finished rids are ignored. `seqs[i]`, when given and not 0, must also match: a rid reused
    after its request finished is a new request, which an abort meant for the old one must not stop."""

    rids: list[str]
    message: str
    seqs: list[int] = []


class GenerateBatch(msgspec.Struct, tag="generate", array_like=True):
    """All requests of one generate() call, sent in one message (SGLang sends one message per prompt)."""

    reqs: list[TokenizedRequest]


class StatsRequest(msgspec.Struct, tag="stats_req", array_like=True):
    """Ask the scheduler for its counters; the answer travels back through the detokenizer."""

    req_id: str


class FlushCache(msgspec.Struct, tag="flush_cache", array_like=True):
    """Evict every unlocked prefix-cache entry; the scheduler answers with Stats (flushed_tokens set)."""

    req_id: str


class FinishReason(msgspec.Struct, array_like=True, omit_defaults=True):
    """Why a request stopped: 'stop' (matched: a token id or a stop string), 'length' (length: the
    token count) or 'abort' (message)."""

    type: str
    matched: int | str | None = None
    length: int | None = None
    message: str | None = None

    def to_dict(self) -> dict:
        out: dict = {"type": self.type}
        if self.type == "stop":
            out["matched"] = self.matched
        elif self.type == "length":
            out["length"] = self.length
        elif self.message is not None:
            out["message"] = self.message
        return out


class RequestMeta(msgspec.Struct, array_like=True):
    """Per-request counters attached to a request's last output, with its hidden states if asked."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    hidden_states: Union[HiddenStates, None] = None


class RequestHeader(msgspec.Struct, array_like=True, omit_defaults=True):
    """Rides with a request's first output: what the detokenizer and the user process need once."""

    prompt_tokens: int
    cached_tokens: int = 0
    stop: tuple[str, ...] = ()
    min_new_tokens: int = 0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    input_logprobs: list[Union[float, None]] = []  # prompt tokens from logprob_start_len on
    input_top: list[Union["TopLogprobs", None]] = []
    trace_context: dict[
        str, str
    ] = {}  # the request's W3C trace headers, for the detokenizer's spans
    seq: int = 0  # TokenizedRequest.seq: the detokenizer's aborts carry it
    hidden_states: bool = False  # its hidden states ride on the scheduler's last output


class TopLogprobs(msgspec.Struct, array_like=True):
    token_ids: list[int]
    logprobs: list[float]


class TokenLogprob(msgspec.Struct, array_like=True, omit_defaults=True):
    """An output token's logprob under the model's distribution, and the most likely alternatives."""

    logprob: float
    top: Union[TopLogprobs, None] = None


# in token_ids: this output carries no new token (a request aborted before producing one)
NO_TOKEN = -1


class BatchTokenOut(msgspec.Struct, tag="tokens", array_like=True):
    """One scheduler step's new tokens: exactly one new token (or NO_TOKEN) per listed request.

    `finished[i]` is None while request i runs; `meta[i]` is set on its last output only.
    """

    rids: list[str]
    token_ids: list[int]
    finished: list[Union[FinishReason, None]]
    meta: list[Union[RequestMeta, None]]
    headers: list[Union[RequestHeader, None]] = []  # empty when no request in the step starts
    logprobs: list[Union[TokenLogprob, None]] = []  # empty when no request wants logprobs


class BatchTextOut(msgspec.Struct, tag="text", array_like=True):
    """The detokenizer's answer to one BatchTokenOut: text and ids since the previous output per request."""

    rids: list[str]
    text_deltas: list[str]
    token_ids: list[int]
    finished: list[Union[FinishReason, None]]
    meta: list[Union[RequestMeta, None]]
    headers: list[Union[RequestHeader, None]] = []
    logprobs: list[Union[TokenLogprob, None]] = []


class BeamHypothesis(msgspec.Struct, array_like=True):
    output_ids: list[int]
    logprob: float  # cumulative log-probability (after logit processors)
    score: float  # length-normalised: logprob / len(output_ids) ** length_penalty
    finish: FinishReason


class BeamSearchOut(msgspec.Struct, tag="beams", array_like=True, omit_defaults=True):
    """A finished beam search's returned hypotheses, best first: its only output (no per-step tokens)."""

    rid: str
    hypotheses: list[BeamHypothesis]
    meta: RequestMeta
    width: int
    steps: int  # selection steps run
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    trace_context: dict[str, str] = {}


class BeamTextOut(msgspec.Struct, tag="beam_text", array_like=True):
    """BeamSearchOut with each hypothesis's text, from the detokenizer."""

    rid: str
    hypotheses: list[BeamHypothesis]
    texts: list[str]
    meta: RequestMeta
    width: int
    steps: int
    detokenize_seconds: float = 0.0


class Stats(msgspec.Struct, tag="stats", array_like=True):
    """Scheduler counters: pool and table occupancy, queue lengths, totals since start."""

    req_id: str
    max_total_tokens: int
    free_tokens: int
    max_running_requests: int
    free_slots: int
    running: int
    waiting: int
    prefill_steps: int
    decode_steps: int
    prompt_tokens: int
    generated_tokens: int
    finished_requests: int
    aborted_requests: int = 0
    stage_seconds: dict[
        str, float
    ] = {}  # scheduler wall time per stage (schedule, forward_extend, ...)
    # tokens computed by prefill steps (prompts less cache hits, chunks, resumptions)
    prefill_tokens: int = 0
    chunked_prefill_steps: int = 0  # prefill steps that carried a partial prompt
    cache_hit_tokens: int = 0  # prefill tokens taken from the prefix cache instead of computed
    retracted_requests: int = 0  # times a running request went back to the queue for lack of KV
    flushed_tokens: int = 0  # set in the answer to FlushCache
    cache_enabled: bool = True
    cache_tokens: int = 0  # pool tokens the radix tree holds (locked + evictable)
    cache_evictable_tokens: int = 0
    cache_locked_tokens: int = 0  # held by running requests' prefixes
    cache_lock_refs: int = 0  # sum of lock counts in the tree: 0 when idle
    cache_evicted_tokens: int = 0
    beam_searches: int = 0  # beam searches decoding now (each also counts once in running)
    beam_kv_tokens: int = 0  # pool tokens their generated beams hold now (prompts are in the cache)
    beam_kv_peak_tokens: int = 0  # the most beam_kv_tokens has been since start
    grammar_compile_seconds: list[
        float
    ] = []  # structured output: each distinct constraint's compile
    # bitmask fill + apply, summed over steps with constrained rows
    grammar_mask_seconds: float = 0.0
    grammar_mask_steps: int = 0
    plugins: dict[str, dict] = {}  # role -> plugin name -> what its engine_stats hook returned
    # role (scheduler, detokenizer, user) -> per-request structure -> its size now: all 0 when idle
    tracked: dict[str, dict[str, int]] = {}
    # prompt tokens the cache served at their request's first admission (cache_hit_tokens also counts a
    # retracted request's own tokens met again): the prefix-cache hit rate is this over prompt_tokens
    prompt_cache_hit_tokens: int = 0


ToScheduler = Union[GenerateBatch, StatsRequest, FlushCache, AbortRequest]
ToDetokenizer = Union[BatchTokenOut, BeamSearchOut, Stats]
ToTokenizer = Union[BatchTextOut, BeamTextOut, Stats]


class Codec:
    """Encoder plus a decoder bound to one channel's union type: anything else fails to decode."""

    def __init__(self, union_type) -> None:
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(union_type)

    def encode(self, message) -> bytes:
        return self._encoder.encode(message)

    def decode(self, data: bytes):
        """The message, or msgspec.DecodeError (engine.ipc.inbox drops it with a log line)."""
        try:
            return self._decoder.decode(data)
        # msgspec's answer to nesting in a field of any value (custom_params, stats)
        except RecursionError:
            raise msgspec.DecodeError("the message is nested too deeply") from None
