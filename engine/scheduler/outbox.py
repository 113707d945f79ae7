"""Messages from the scheduler to the detokenizer."""

from __future__ import annotations

import msgspec
import zmq

from engine.ipc.messages import Codec, ToDetokenizer


class Outbox:
    def __init__(self, sock: zmq.Socket) -> None:
        self.sock = sock
        self.codec = Codec(ToDetokenizer)

    def send(self, message: msgspec.Struct) -> None:
        self.sock.send(self.codec.encode(message))
