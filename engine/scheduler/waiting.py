"""The waiting queue: requests that arrived or were retracted, in queue order, and the order in which
admission tries them (engine/scheduler/policy.py)."""

from __future__ import annotations

from typing import Callable, Iterable, Iterator

from engine.scheduler.policy import order_waiting
from engine.scheduler.request import Req


class WaitingQueue:
    def __init__(self) -> None:
        self._reqs: list[Req] = []

    def __len__(self) -> int:
        return len(self._reqs)

    def __iter__(self) -> Iterator[Req]:
        return iter(self._reqs)

    @property
    def reqs(self) -> list[Req]:
        """The queue, in order (read only: change it through the methods)."""
        return self._reqs

    def add(self, req: Req) -> None:
        self._reqs.append(req)

    def requeue(self, reqs: list[Req]) -> None:
        """Put requests back at the front, in the order given (retracted: they resume first)."""
        self._reqs[:0] = reqs

    def remove(self, reqs: Iterable[Req]) -> None:
        ids = {id(r) for r in reqs}
        if ids:
            self._reqs = [r for r in self._reqs if id(r) not in ids]

    def take(self, pred: Callable[[Req], bool]) -> list[Req]:
        """Remove and return the requests `pred` picks, in queue order."""
        taken = [r for r in self._reqs if pred(r)]
        if taken:
            self._reqs = [r for r in self._reqs if not pred(r)]
        return taken

    def ordered(
        self, policy: str, cache, in_progress: Req | None, free_slots: int | None
    ) -> list[Req]:
        """The requests in the order admission should try them (held-back ones left out)."""
        return order_waiting(self._reqs, policy, cache, in_progress, free_slots)
