"""What the schedule stage carries from one turn to the next (the prompt being prefilled in chunks,
the admission estimate, the last step's mode), and what the current turn has admitted."""

from __future__ import annotations

from engine.model.forward_batch import ForwardMode
from engine.scheduler.request import Req

MIN_NEW_TOKEN_RATIO = 0.1
NEW_TOKEN_RATIO_DECAY = 0.001  # per decode step


class SchedulePlan:
    def __init__(self, init_new_token_ratio: float) -> None:
        self.init_new_token_ratio = init_new_token_ratio
        self.chunked: Req | None = None  # a prompt part-way through a chunked prefill
        self.last_mode: ForwardMode | None = None
        # the share of each request's remaining max_new_tokens that admission reserves
        self.new_token_ratio = init_new_token_ratio
        self._planned: list[Req] = []  # admitted this turn (a failing schedule frees them)
        self._phase = ForwardMode.EXTEND  # which half of the schedule is running

    @property
    def phase(self) -> ForwardMode:
        return self._phase

    @property
    def planned(self) -> list[Req]:
        return self._planned

    def begin(self) -> None:
        """A new turn: nothing admitted yet, planning a prefill."""
        self._planned = []
        self._phase = ForwardMode.EXTEND

    def begin_decode(self) -> None:
        self._phase = ForwardMode.DECODE

    def admitted(self, req: Req) -> None:
        """`req` now holds a slot and a prefix lock: a failing schedule must free them."""
        self._planned.append(req)

    def take_planned(self) -> list[Req]:
        """This turn's admitted requests, forgotten here (kept, they would outlive their requests)."""
        planned, self._planned = self._planned, []
        return planned

    def drop_chunk(self, reqs: list[Req]) -> None:
        """Forget the chunked prompt if it is among `reqs` (they failed or were aborted)."""
        if self.chunked is not None and any(r is self.chunked for r in reqs):
            self.chunked = None

    def decayed(self) -> None:
        """A decode step went well: reserve a little less for new tokens."""
        self.new_token_ratio = max(
            MIN_NEW_TOKEN_RATIO, self.new_token_ratio - NEW_TOKEN_RATIO_DECAY
        )

    def retracted(self) -> None:
        """Requests were retracted for memory: reserve more."""
        ratio = self.init_new_token_ratio
        self.new_token_ratio = min(1.0, max(ratio, self.new_token_ratio + 0.1))
