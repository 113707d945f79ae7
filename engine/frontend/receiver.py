"""The receiver thread: one zmq poll over the detokenizer's socket, a wake pipe and the children's process
sentinels, so a child's death is noticed at once. Outputs go to the dispatch; a wake sends the queued aborts."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from typing import Any, Callable

import zmq

from engine.frontend.request_checks import malformed_text_message
from engine.ipc.inbox import Inbox
from engine.ipc.messages import Codec, ToTokenizer

logger = logging.getLogger(__name__)


class Receiver:
    def __init__(self, sock: zmq.Socket) -> None:
        self.sock = sock
        self.inbox = Inbox(
            sock, Codec(ToTokenizer), "engine::tokenizer_manager", malformed_text_message
        )
        # wakes the thread: to stop, or to send aborts queued where no lock may be taken
        # (finalizers). A pipe, because any thread may write it; a zmq socket is for one thread at a time.
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._wake_lock = threading.Lock()  # only ever tried, never waited on
        self._stopping = False
        self._thread: threading.Thread | None = None

    def start(
        self,
        sentinels: dict[int, str],
        dispatch: Callable[[Any], None],
        on_wake: Callable[[], None],
        on_dead: Callable[[str], None],
    ) -> None:
        """Begin receiving; `sentinels` maps each child's process sentinel fd to its role."""
        self._dispatch, self._on_wake, self._on_dead = dispatch, on_wake, on_dead
        self._thread = threading.Thread(
            target=self.loop, args=(sentinels,), name="engine-recv", daemon=True
        )
        self._thread.start()

    def wake(self) -> None:
        """Wake the receiver thread. Never blocks: safe in a finalizer, under any lock."""
        if self._wake_lock.acquire(blocking=False):
            try:
                if self._wake_w >= 0:
                    os.write(self._wake_w, b"x")
            except OSError:  # the pipe is full: the thread is awake already
                pass
            finally:
                self._wake_lock.release()

    def stop(self) -> bool:
        """Stop the thread and wait for it (a while); False if it still runs (stuck in a caller's listener,
        or this is that thread)."""
        self._stopping = True
        self.wake()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(5)
        return thread is None or not thread.is_alive()

    def close(self) -> None:
        """Close the socket and the wake pipe, once the thread has stopped."""
        self.sock.close(linger=0)
        with self._wake_lock:
            for fd in (self._wake_r, self._wake_w):
                os.close(fd)
            self._wake_w = -1

    def loop(self, sentinels: dict[int, str]) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        for fd in sentinels:
            poller.register(fd, zmq.POLLIN)
        while True:
            events = dict(poller.poll())
            if self._wake_r in events:
                with contextlib.suppress(OSError):
                    while os.read(self._wake_r, 4096):
                        pass
                if self._stopping:
                    return
                self._on_wake()
            for fd, role in sentinels.items():
                if fd in events:
                    self._on_dead(
                        f"the {role} process died; this engine can serve no more requests"
                    )
                    return
            if self.sock in events:
                try:
                    for message in self.inbox.drain():
                        self._dispatch(message)
                except Exception as exc:  # noqa: BLE001 - a dead receiver would leave every caller waiting
                    self._on_dead(
                        f"the tokenizer manager's receiver failed ({type(exc).__name__}: {exc})"
                    )
                    return
