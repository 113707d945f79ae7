"""The receiving end of a channel: a PULL socket's messages, decoded, with the malformed ones dropped.

A message that does not decode as the channel's types, or that the owner's check refuses, was not
written by the engine: it is logged as dropped, naming the receiving process, and never stops the
receiver.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Iterator

import msgspec
import zmq

from engine.ipc.messages import Codec

logger = logging.getLogger(__name__)

_DROPPED = object()


class Inbox:
    def __init__(
        self,
        sock: zmq.Socket,
        codec: Codec,
        who: str,
        check: Callable[[Any], str | None] | None = None,
    ) -> None:
        """`who` starts each log line ("engine::scheduler"); `check` says what is wrong with a message
        that decoded (lists of unequal length, ...), or None."""
        self.sock = sock
        self.codec = codec
        self.who = who
        self.check = check

    def drain(self) -> Iterator[Any]:
        """Every message waiting now, in arrival order, without blocking."""
        while True:
            try:
                data = self.sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            message = self._accept(data)
            if message is not _DROPPED:
                yield message

    def recv(self) -> Any:
        """The next message that is not dropped, waiting for it."""
        while True:
            message = self._accept(self.sock.recv())
            if message is not _DROPPED:
                return message

    def _accept(self, data: bytes) -> Any:
        try:
            message = self.codec.decode(data)
        except msgspec.DecodeError as exc:  # not ours: drop it rather than die
            logger.warning("%s: dropped a malformed message (%s)", self.who, exc)
            return _DROPPED
        problem = self.check(message) if self.check is not None else None
        if problem:  # typed right, but no engine process sends it
            logger.warning("%s: dropped a malformed message (%s)", self.who, problem)
            return _DROPPED
        return message
