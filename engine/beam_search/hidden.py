"""A beam search's generated hidden states (return_hidden_states "generated" or "all"): each step's rows
are kept once, with where each beam came from, and a returned hypothesis's rows are gathered at the end
along its own beam's history. Row k of a beam: the state at the position that predicted its token k."""

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
    """rows[s]: the K live beams' rows of column s ([layers, K, hidden] float32 on the host), held once;
    sources[s]: `BeamSelection.row_sources` of selection s, where each of the 2K slots (finished
    hypotheses', then live beams') came from. A step costs O(K); a history is gathered only at the end."""

    __slots__ = ("width", "rows", "sources")

    def __init__(self, selection: BeamSelection, taps: RequestTaps) -> None:
        """At the start, before the first selection is applied: every live beam is the prompt, whose
        last row (captured by the prefill) predicts each beam's first token."""
        first = taps.chunks[-1][:, -1:]  # [layers, 1, hidden]: the prompt's last position
        self.width = selection.width
        self.rows: list[torch.Tensor] = [first.expand(-1, self.width, -1)]
        self.sources: list[torch.Tensor] = []

    def select(self, selection: BeamSelection, step: torch.Tensor | None) -> None:
        """After `selection.step`: the live beams' rows of this step ([layers, K, hidden], None at the
        start) and where every slot now comes from."""
        if step is not None:
            if step.ndim != 3 or step.shape[1] != self.width:
                raise ValueError(
                    f"expected the rows of {self.width} beams, got {tuple(step.shape)}"
                )
            self.rows.append(step)
        self.sources.append(selection.row_sources())
        if len(self.rows) != len(self.sources):
            raise ValueError(f"{len(self.rows)} steps of rows for {len(self.sources)} selections")

    def take_step(self, selection: BeamSelection, taps: RequestTaps) -> str | None:
        """`select` with the rows the layer taps delivered for this step (exactly one entry); why the
        search must fail instead, or None."""
        delivered = list(taps.beam_step)
        taps.beam_step.clear()
        if len(delivered) != 1:
            return f"hidden states: expected one capture of the beams' rows per step, got {len(delivered)}"
        try:
            self.select(selection, delivered[0])
        except ValueError as exc:
            return f"hidden states: {exc}"
        return None

    def generated(self, hyps: list[Hypothesis]) -> torch.Tensor | None:
        """The hypotheses' rows one after another, [layers, sum of their lengths, hidden]: each walks
        its slot's sources back from the last selection (one row per step, none copied before). The
        search is over: the held rows are let go."""
        rows, self.rows = self.rows, []
        sources, self.sources = self.sources, []
        if not hyps:
            return None
        k, back = self.width, torch.stack(sources).tolist()  # [steps, 2K]
        zero = torch.zeros_like(rows[0][:, 0])
        picked = []
        for h in hyps:
            n, slot, cols = len(h.output_ids), h.slot, []
            for s in range(len(back) - 1, -1, -1):
                slot = back[s][slot]
                if s < n:  # a finished slot never held a row of its own: zeros, never returned
                    cols.append(rows[s][:, slot - k] if slot >= k else zero)
            picked += reversed(cols)
        return torch.stack(picked, dim=1) if picked else None


def beam_result(
    taps: RequestTaps, rows: torch.Tensor | None, hyps: list[Hypothesis]
) -> HiddenStates | None:
    """The search's HiddenStates: the prompt's rows as for any request, and `generated` the returned
    hypotheses' rows one after another (best first), `beam_rows` how many each."""
    out = taps.result(0)
    if out is None:
        return None
    if rows is not None:
        out.generated, out.generated_rows = rows.contiguous().numpy().tobytes(), rows.shape[1]
    out.beam_rows = [len(h.output_ids) for h in hyps]
    return out
