"""The scheduler's request socket as every tensor-parallel rank sees it: rank 0 drains the real one
and shares each turn's messages, as the bytes that arrived (never pickled), with the other ranks, so
every rank decodes and handles the same messages in the same turn and schedules alike.

It stands in for the zmq socket under the scheduler's Inbox: recv() and poll() as the Inbox and the
receive stage call them.
"""

from __future__ import annotations

import collections

import zmq

from engine.distributed.group import TPGroup

# an idle rank 0 shares an empty turn this often, well inside the collectives' timeout
IDLE_TURN_MS = 10_000


class TurnSocket:
    def __init__(self, sock: zmq.Socket | None, group: TPGroup) -> None:
        """sock: the request socket on rank 0, None on the others."""
        self.sock, self.group = sock, group
        self._turn: collections.deque[bytes] | None = None

    def poll(self, timeout: int | None = None) -> int:
        """Rank 0: wait for a request (at most IDLE_TURN_MS). The others wait in the turn's share."""
        if self.sock is None:
            return 0
        return self.sock.poll(IDLE_TURN_MS if timeout is None else min(timeout, IDLE_TURN_MS))

    def recv(self, flags: int = 0) -> bytes:
        """The turn's next message; zmq.Again once they are all read, which ends the turn."""
        if self._turn is None:
            arrived = self._drain() if self.sock is not None else None
            self._turn = collections.deque(self.group.share_bytes(arrived))
        if not self._turn:
            self._turn = None
            raise zmq.Again()
        return self._turn.popleft()

    def _drain(self) -> list[bytes]:
        out = []
        while True:
            try:
                out.append(self.sock.recv(zmq.NOBLOCK))
            except zmq.Again:
                return out
