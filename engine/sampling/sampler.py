"""The sample stage: batched logits in, one token per row out, with logprobs when asked.

Order, as in transformers and vLLM: logprobs are taken from the model's own distribution (raw
logits); then logit bias, repetition / frequency / presence penalties, custom logit processors,
grammar masks, min_new_tokens (stop tokens masked, unless nothing else is left); greedy rows take
the argmax of that; sampled rows divide by their temperature, keep top-k, top-p and min-p, and
draw. Every step is one tensor operation over the batch, skipped when no row needs it. Custom
processors are the exception: one call per processor name, with all the rows that selected it.

Drawing inverts each row's cumulative distribution at one uniform draw, which picks token i with
probability p_i. A seeded row draws from its own generator seeded with (seed, tokens generated so
far), so its tokens do not depend on what else is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.hooks.runtime import FatalHookError
from engine.sampling.batch_params import SamplingTensors
from engine.sampling.processors import ProcessorBatch, ProcessorSet
from engine.sampling.stop_table import StopTable

NEG_INF = float("-inf")


@dataclass
class SampleOutput:
    next_ids: torch.Tensor  # [B] int64
    # [B] logprob of each chosen token under the raw distribution
    logprobs: torch.Tensor | None = None
    # [B, K] the K most likely tokens under the raw distribution
    top_ids: torch.Tensor | None = None
    top_logprobs: torch.Tensor | None = None  # [B, K]
    failed: dict[int, str] = field(default_factory=dict)  # row -> error, from a custom processor


def apply_penalties(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """Repetition (transformers' rule, over prompt and output), then frequency and presence (OpenAI's
    rule, over output tokens). Only the kinds some row uses: the others change nothing, at a few passes
    over [B, V] each."""
    if st.any_repetition:
        rep = st.repetition[:, None]
        penalized = torch.where(logits > 0, logits / rep, logits * rep)
        logits = torch.where(st.seen, penalized, logits)
    counts = st.counts
    if st.any_frequency:
        logits = logits - st.frequency[:, None] * counts
    if st.any_presence:
        logits = logits - st.presence[:, None] * (counts > 0).to(logits.dtype)
    return logits


def suppress_stop_tokens(
    logits: torch.Tensor,
    st: SamplingTensors,
    out_lens: torch.Tensor,
    stop_table: StopTable,
    keep_last: bool = False,
) -> None:
    """min_new_tokens: rows that have not generated enough yet cannot pick EOS or a stop token.

    `keep_last` (a grammar or a custom processor masked tokens before): a row this would leave with no
    token at all keeps its stop tokens. A complete grammar allows only EOS; masking it too drew token 0,
    which the grammar then refused, and a finished output ended as an abort."""
    rows, ids = stop_table.where(out_lens < st.min_new)
    if not rows.numel():
        return
    saved = logits[rows, ids] if keep_last else None
    logits[rows, ids] = NEG_INF
    if saved is not None:
        touched = rows.unique()
        empty = touched[torch.isneginf(logits[touched]).all(dim=-1)]
        if empty.numel():
            back = torch.isin(rows, empty)
            logits[rows[back], ids[back]] = saved[back]


def run_processors(
    logits: torch.Tensor,
    st: SamplingTensors,
    out_lens: torch.Tensor,
    output_ids: list[list[int]],
    processors: ProcessorSet,
    failed: dict[int, str],
    beams: list[int | None] | None = None,
) -> None:
    groups: dict[str, list[int]] = {}
    for row, selected in enumerate(st.processors):
        if selected is not None:
            groups.setdefault(selected[0], []).append(row)
    for name, rows in groups.items():
        idx = torch.tensor(rows, dtype=torch.int64, device=logits.device)
        batch = ProcessorBatch(
            [st.processors[r][1] for r in rows],
            [output_ids[r] for r in rows],
            out_lens[idx],
            [beams[r] for r in rows] if beams is not None else [None] * len(rows),
        )
        try:
            logits[idx] = processors.get(name)(logits[idx], batch)
        except BaseException as exc:  # noqa: BLE001 - a processor's failure (SystemExit too) fails only its rows
            if isinstance(exc, FatalHookError):
                raise
            _rows_alone(logits, rows, batch, processors.get(name), name, failed)


def _rows_alone(
    logits: torch.Tensor,
    rows: list[int],
    batch: ProcessorBatch,
    proc,
    name: str,
    failed: dict[int, str],
) -> None:
    """The batched call raised: each row again, alone, so one request's failure is not its
    neighbours'."""
    for j, r in enumerate(rows):
        one = ProcessorBatch(
            [batch.params[j]], [batch.output_ids[j]], batch.out_lens[j : j + 1], [batch.beams[j]]
        )
        try:
            logits[r : r + 1] = proc(logits[r : r + 1].clone(), one)
        except BaseException as exc:  # noqa: BLE001 - as the hooks' isolation: only FatalHookError stops the process
            if isinstance(exc, FatalHookError):
                raise
            failed[r] = f"custom_logit_processor {name!r} failed: {type(exc).__name__}: {exc}"


def draw(probs: torch.Tensor, st: SamplingTensors, out_lens: torch.Tensor) -> torch.Tensor:
    """One token per row, token i with probability p_i / sum(p): the inverse of each row's cumulative
    distribution (float64: a token's share is lost to rounding only below about 1e-16 of the sum) at
    one uniform draw. One draw per row, not one per token as the exponential race needs (a draw per
    vocabulary entry costs as much as a decode step at large batches: docs/sampling.md). A
    seeded row draws from its own generator seeded with (seed, tokens generated so far): it does not
    depend on its neighbours."""
    cdf = probs.cumsum(dim=-1, dtype=torch.float64)
    u = torch.rand(probs.shape[0], 1, dtype=torch.float64, device=probs.device)
    if st.any_seed:
        lens = out_lens.tolist()
        for row, seed in enumerate(st.seeds):
            if seed is not None:
                gen = torch.Generator(device=probs.device)
                gen.manual_seed((seed * 1_000_003 + lens[row]) % (1 << 63))
                u[row] = torch.rand(1, dtype=torch.float64, generator=gen, device=probs.device)
    # the first token whose cumulative sum passes the draw: u < 1, so u * total < total (float64 rounds
    # it no higher), and the token found is one the sum rose at, one with probability, never one filtered
    # out; the clamp is for a row of NaN (which nothing found), which must still give a token id
    picked = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).squeeze(1)
    return picked.clamp_(max=probs.shape[-1] - 1)


def process_logits(
    logits: torch.Tensor,
    st: SamplingTensors,
    out_lens: torch.Tensor,
    stop_table: StopTable,
    output_ids: list[list[int]],
    processors: ProcessorSet,
    failed: dict[int, str],
    beams: list[int | None] | None = None,
    grammar=None,
) -> torch.Tensor:
    """The engine's own processing, in order: logit bias, penalties, custom processors, grammar masks
    (`grammar(logits)`, in place), min_new_tokens (last, so that it can see what the masks left: it never
    takes a row's last tokens). Sampling applies it to logits; beam search to log-probabilities, as
    transformers does. `beams`: each row's beam index (None: not a beam), for the custom processors."""
    if st.bias is not None:
        logits = logits + st.bias
    if st.counts is not None:
        logits = apply_penalties(logits, st)
    if st.any_processor:
        run_processors(logits, st, out_lens, output_ids, processors, failed, beams)
    if grammar is not None:
        grammar(logits)
    if st.any_min_new:
        suppress_stop_tokens(
            logits, st, out_lens, stop_table, keep_last=grammar is not None or st.any_processor
        )
    return logits


def fail_emptied_rows(logits: torch.Tensor, st: SamplingTensors, failed: dict[int, str]) -> None:
    """A sampled row a custom processor left all -inf (it banned every token, or every token the grammar
    allows: it runs before the mask) would give a token nothing allows (greedy: 0; sampled: the last
    id), which a grammar then refuses, blamed on the grammar. It fails here, naming the processor.
    (Beam searches: a beam left so is hopeless; a search whose every beam is ends with no hypothesis.)"""
    rows = [r for r, sel in enumerate(st.processors) if sel is not None and r not in failed]
    if not rows:
        return
    empty = torch.isneginf(logits[torch.tensor(rows, device=logits.device)]).all(dim=-1).tolist()
    for r, is_empty in zip(rows, empty):
        if is_empty:
            failed[r] = (
                f"custom_logit_processor {st.processors[r][0]!r} left no token to choose: it banned every "
                "token the grammar and the other parameters allow"
            )


# the most likely tokens top_k / top_p are first measured in, before a full sort
TOP_WINDOWS = (
    256,
    4096,
)


def top_k_top_p(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """probs [B, V] with each row's tokens outside its top_k, or past its top_p, set to 0 (both measured on
    the same distribution, as SGLang does). A token goes once the tokens before it reach top_p (the smallest
    set that reaches it, as transformers and vLLM keep; never the top token). A row whose top_p is 1 loses
    nothing to it: a float32 running sum over a large vocabulary passes 1 before its tail.

    Measured first on each row's most likely tokens (topk), which is enough for a row whose cut ends
    inside them; only the rows whose cut does not go on to the next window, then to a full sort of the
    vocabulary (costly at large batches): one broad row does not send the batch there."""
    rows, vocab = probs.shape
    # rows that lose anything, still to cut
    pending = ((top_k < vocab) | (top_p < 1.0)).nonzero().squeeze(1)
    if not pending.numel():
        return probs
    out = torch.empty_like(probs) if pending.numel() == rows else probs.clone()
    for window in TOP_WINDOWS:
        if window >= vocab or not pending.numel():
            break
        values, ids = probs.index_select(0, pending).topk(window, dim=-1)
        drop = _dropped(values, top_k[pending], top_p[pending])
        done = drop[:, -1]  # the cut ends in the window: what is past it goes too
        if bool(done.any()):
            kept = torch.zeros(int(done.sum()), vocab, dtype=probs.dtype, device=probs.device)
            kept.scatter_(1, ids[done], values[done].masked_fill(drop[done], 0.0))
            out.index_copy_(0, pending[done], kept)
            pending = pending[~done]
    if pending.numel():
        part = probs.index_select(0, pending)
        sorted_probs, sorted_idx = part.sort(dim=-1, descending=True)
        drop = _dropped(sorted_probs, top_k[pending], top_p[pending])
        out.index_copy_(
            0, pending, part.masked_fill(torch.zeros_like(drop).scatter_(1, sorted_idx, drop), 0.0)
        )
    return out


def _dropped(sorted_probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Which of each row's most likely tokens (in order, descending) top_k and top_p remove."""
    ranks = torch.arange(sorted_probs.shape[-1], device=sorted_probs.device)
    drop = ranks[None, :] >= top_k[:, None]
    drop |= ((sorted_probs.cumsum(dim=-1) - sorted_probs) >= top_p[:, None]) & (
        top_p[:, None] < 1.0
    )
    drop[:, 0] = False  # a top_p under float32's least value (0 there) must not empty the row
    return drop


def sample(
    logits: torch.Tensor,
    st: SamplingTensors,
    out_lens: torch.Tensor,
    stop_table: StopTable,
    output_ids: list[list[int]],
    processors: ProcessorSet,
    on_logits=None,
    grammar=None,
) -> SampleOutput:
    """Next token ids [B] from float32 logits [B, V] (the rows of `out_lens` and `stop_table`)."""
    out = SampleOutput(next_ids=torch.empty(0))
    logprobs_all = torch.log_softmax(logits, dim=-1) if st.any_logprob else None
    logits = process_logits(
        logits, st, out_lens, stop_table, output_ids, processors, out.failed, grammar=grammar
    )
    if on_logits is not None:  # the engine_process_logits hook: may change logits in place
        on_logits(logits)
    if st.any_processor:  # after the hook, which may still put tokens back
        fail_emptied_rows(logits, st, out.failed)
    if st.all_greedy:
        out.next_ids = logits.argmax(dim=-1)
    else:
        probs = torch.softmax(logits / st.temperature[:, None], dim=-1)
        if st.any_top_k_p:
            probs = top_k_top_p(probs, st.top_k, st.top_p)
        if st.any_min_p:
            probs = probs.masked_fill(
                probs < st.min_p[:, None] * probs.max(dim=-1, keepdim=True).values, 0.0
            )
        sampled = draw(probs, st, out_lens)
        out.next_ids = (
            torch.where(st.greedy, logits.argmax(dim=-1), sampled) if st.any_greedy else sampled
        )
    if logprobs_all is not None:
        out.logprobs = logprobs_all.gather(1, out.next_ids[:, None]).squeeze(1)
        if st.max_top_logprobs:
            out.top_logprobs, out.top_ids = logprobs_all.topk(st.max_top_logprobs, dim=-1)
    st.record(out.next_ids)
    return out
