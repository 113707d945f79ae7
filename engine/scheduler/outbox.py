"""Messages from the scheduler to the detokenizer."""

from __future__ import annotations

import msgspec
import zmq

from engine.ipc.messages import Codec, ToDetokenizer


class Outbox:
    def __init__(self, sock: zmq.Socket | None) -> None:
        """sock None: a tensor-parallel rank other than 0, whose outputs rank 0 sends."""
        self.sock = sock
        self.codec = Codec(ToDetokenizer)

    def send(self, message: msgspec.Struct) -> None:
        if self.sock is not None:
            self.sock.send(self.codec.encode(message))
