"""Building a decode step: one new token for every running request, inputs taken from the batch's tensors."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine.scheduler.step import Step
from engine.model.forward_batch import ForwardBatch, ForwardMode

if TYPE_CHECKING:
    from engine.scheduler.state import SchedulerState


def decode_step(state: SchedulerState) -> Step:
    """Rows: the running requests, then every live beam of the beam searches (engine/beam_search)."""
    rows, beams = state.running, state.beams
    n, nb = len(rows), beams.num_rows
    loc = state.kv.alloc(n + nb)
    positions = rows.kv_lens
    state.req_to_token.table[rows.slots, positions] = loc[:n]
    rows.kv_lens = positions + 1
    input_ids, slots, seq_lens = rows.last_ids, rows.slots, rows.kv_lens
    if nb:
        positions = torch.cat([positions, beams.place(loc[n:])])
        input_ids = torch.cat([input_ids, beams.last_ids])
        slots = torch.cat([slots, beams.slots])
        seq_lens = torch.cat([seq_lens, beams.kv_lens])
    state.counters["decode_steps"] += 1
    state.plan.decayed()
    batch = ForwardBatch(
        mode=ForwardMode.DECODE,
        input_ids=input_ids,
        positions=positions,
        out_cache_loc=loc,
        req_slots=slots,
        seq_lens=seq_lens,
        max_seq_len=int(seq_lens.max()),
        logits_indices=torch.arange(n + nb, device=state.device),
    )
    return Step(batch, rows, beam_reqs=beams.reqs if nb else [])
