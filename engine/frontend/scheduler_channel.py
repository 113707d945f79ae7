"""The push socket to the scheduler, and the lock every sending thread takes: a zmq socket serves one
thread at a time, and the lock also orders a submission's send before any abort of it."""

from __future__ import annotations

import threading

import zmq

from engine.ipc.messages import Codec, ToScheduler


class SchedulerChannel:
    def __init__(self, sock: zmq.Socket) -> None:
        self.sock = sock
        self.lock = threading.Lock()
        self.codec = Codec(ToScheduler)

    def encode(self, message) -> bytes:
        return self.codec.encode(message)

    def send(self, payload: bytes) -> None:
        """Send encoded bytes; the caller holds `lock`."""
        self.sock.send(payload)

    def close(self) -> None:
        """Close under the lock: a sender that takes it afterwards finds the engine dead, not a closed socket."""
        with self.lock:
            self.sock.close(linger=0)
