"""Building a decode step: one new token for every running request, inputs taken from the batch's tensors."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine.scheduler.step import Step
from engine.model.forward_batch import ForwardBatch, ForwardMode

if TYPE_CHECKING:
    from engine.scheduler.scheduler import Scheduler

MIN_NEW_TOKEN_RATIO = 0.1
NEW_TOKEN_RATIO_DECAY = 0.001  # per decode step


def decode_step(sched: Scheduler) -> Step:
    """Rows: the running requests, then every live beam of the beam searches (engine/beam_search)."""
    rows, beams = sched.running, sched.beams
    n, nb = len(rows), beams.num_rows
    loc = sched.kv.alloc(n + nb)
    positions = rows.kv_lens
    sched.req_to_token.table[rows.slots, positions] = loc[:n]
    rows.kv_lens = positions + 1
    input_ids, slots, seq_lens = rows.last_ids, rows.slots, rows.kv_lens
    if nb:
        positions = torch.cat([positions, beams.place(loc[n:])])
        input_ids = torch.cat([input_ids, beams.last_ids])
        slots = torch.cat([slots, beams.slots])
        seq_lens = torch.cat([seq_lens, beams.kv_lens])
    sched.counters["decode_steps"] += 1
    sched.new_token_ratio = max(MIN_NEW_TOKEN_RATIO, sched.new_token_ratio - NEW_TOKEN_RATIO_DECAY)
    batch = ForwardBatch(
        mode=ForwardMode.DECODE,
        input_ids=input_ids,
        positions=positions,
        out_cache_loc=loc,
        req_slots=slots,
        seq_lens=seq_lens,
        max_seq_len=int(seq_lens.max()),
        logits_indices=torch.arange(n + nb, device=sched.device),
    )
    return Step(batch, rows, beam_reqs=beams.reqs if nb else [])
