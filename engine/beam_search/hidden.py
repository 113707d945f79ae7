"""A beam search's generated hidden states (return_hidden_states "generated" or "all"): each beam's own
rows, reordered with the beams at every selection, so a returned hypothesis has the rows of its own
tokens. Row k of a beam: the state at the position that predicted its generated token k."""

from __future__ import annotations

import torch

from engine.beam_search.selection import BeamSelection, Hypothesis
from engine.taps.request import RequestTaps
from engine.taps.spec import HiddenStates


def wants_rows(taps: RequestTaps | None) -> bool:
    """Whether the search asked for per-token rows of its generated tokens."""
    return (
        taps is not None and taps.hidden is not None and taps.hidden.tokens in ("generated", "all")
    )


class BeamStates:
    """Histories [2K, layers, max_new_tokens, hidden] float32 on the host: the K finished slots' first
    (BeamSelection's fin_* order), then the K live beams'. Only columns [0, steps) are meaningful."""

    __slots__ = ("width", "rows")

    def __init__(self, selection: BeamSelection, taps: RequestTaps) -> None:
        """At the start, before the first selection is applied: every live beam is the prompt, whose
        last row (captured by the prefill) predicts each beam's first token."""
        first = taps.chunks[-1][:, -1]  # [layers, hidden]: the prompt's last position
        k = self.width = selection.width
        self.rows = torch.zeros(2 * k, first.shape[0], selection.max_new, first.shape[1])
        self.rows[k:, :, 0] = first

    def select(self, selection: BeamSelection, step: torch.Tensor | None) -> None:
        """After `selection.step`: the live beams' rows of this step ([layers, K, hidden], None at the
        start) join their histories, then every history follows its source (parents, finished)."""
        k, t = self.width, selection.steps - 1
        if step is not None:
            self.rows[k:, :, t] = step.transpose(0, 1)
        done = self.rows[:, :, : t + 1]
        done.copy_(done.index_select(0, selection.row_sources()))

    def generated(self, hyps: list[Hypothesis]) -> list[torch.Tensor]:
        """Each hypothesis's rows, [layers, its length, hidden]."""
        return [self.rows[h.slot, :, : len(h.output_ids)] for h in hyps]


def beam_result(taps: RequestTaps, rows: list[torch.Tensor]) -> HiddenStates | None:
    """The search's HiddenStates: the prompt's rows as for any request, and `generated` the returned
    hypotheses' rows one after another (best first), `beam_rows` how many each."""
    out = taps.result(0)
    if out is None:
        return None
    if rows:
        both = torch.cat(rows, dim=1).contiguous()
        out.generated, out.generated_rows = both.numpy().tobytes(), both.shape[1]
    out.beam_rows = [r.shape[1] for r in rows]
    return out
