"""Aborting running requests: by rid, by state, or queued from where no lock may be taken (a finalizer)
for the receiver thread to send. An abort names each request's submission number (seq) beside its
rid, so it cannot hit a later request that reuses the rid."""

from __future__ import annotations

import collections
from typing import Callable

from engine.frontend.request_state import ReqState
from engine.frontend.request_table import RequestTable
from engine.frontend.scheduler_channel import SchedulerChannel
from engine.ipc.messages import AbortRequest


class Aborts:
    def __init__(
        self, table: RequestTable, channel: SchedulerChannel, wake: Callable[[], None]
    ) -> None:
        self._table = table
        self._channel = channel
        self._wake = wake  # wakes the receiver thread, which sends what abort_soon queued
        self._deferred: collections.deque = collections.deque()  # (states, message) from abort_soon

    def abort(self, rids: list[str], message: str = "aborted by the caller") -> None:
        """Ask the scheduler to stop these requests (a rid given for n > 1 stands for all its copies)."""
        if self._table.dead is not None:
            return
        self.abort_requests(self._table.named(rids), message)

    def _send_abort(self, live: list[ReqState], message: str) -> None:
        if live:
            message_out = AbortRequest([s.rid for s in live], message, [s.seq for s in live])
            with self._channel.lock:
                # else the socket may be closed; the requests have failed already
                if self._table.dead is None:
                    self._channel.send(self._channel.encode(message_out))

    def abort_soon(self, states: list[ReqState], message: str = "aborted by the caller") -> None:
        """Abort these requests from where no lock may be taken (a finalizer run by the garbage collector,
        possibly in a thread that holds the table's lock): queued here, sent by the receiver thread. Queued
        as the requests themselves, not their rids: a request given one of their rids meanwhile runs on."""
        if self._table.dead is None:
            self._deferred.append((list(states), message))
            self._wake()

    def send_deferred(self) -> None:
        """Send what abort_soon queued (the receiver thread, once woken)."""
        while self._deferred:
            self.abort_requests(*self._deferred.popleft())

    def queued(self) -> int:
        return len(self._deferred)

    def abort_requests(
        self, states: list[ReqState], message: str = "aborted by the caller"
    ) -> None:
        """Abort these requests, those still running, and no later request given one of their rids."""
        if self._table.dead is not None:
            return
        self._send_abort(self._table.live(states), message)
