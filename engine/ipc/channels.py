"""The private runtime directory and the ZeroMQ PUSH/PULL sockets that live in it."""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass

import zmq


SOCKET_PATH_MAX = 107  # bytes of a Unix socket's path (sockaddr_un.sun_path, less its NUL)


@dataclass(frozen=True)
class Endpoints:
    """ipc:// addresses of the three PULL sockets, inside one private directory."""

    runtime_dir: str
    scheduler: str  # the scheduler pulls requests here
    detokenizer: str  # the detokenizer pulls token outputs here
    tokenizer: str  # the tokenizer manager pulls text outputs here

    @classmethod
    def create(cls) -> "Endpoints":
        # mode 0700: only this user can reach the sockets
        runtime_dir = tempfile.mkdtemp(prefix="engine-")
        # a long TMPDIR
        if len(os.fsencode(os.path.join(runtime_dir, "detokenizer"))) > SOCKET_PATH_MAX:
            os.rmdir(runtime_dir)
            runtime_dir = tempfile.mkdtemp(prefix="engine-", dir="/tmp")
        os.chmod(runtime_dir, 0o700)
        return cls(
            runtime_dir=runtime_dir,
            scheduler=f"ipc://{runtime_dir}/scheduler",
            detokenizer=f"ipc://{runtime_dir}/detokenizer",
            tokenizer=f"ipc://{runtime_dir}/tokenizer",
        )

    def to_dict(self) -> dict:
        return {
            k: getattr(self, k) for k in ("runtime_dir", "scheduler", "detokenizer", "tokenizer")
        }

    def remove(self) -> None:
        shutil.rmtree(self.runtime_dir, ignore_errors=True)


MAX_MESSAGE_BYTES = 1 << 30  # a peer sending more is disconnected by zmq, not read into memory


def pull_socket(ctx: zmq.Context, endpoint: str) -> zmq.Socket:
    """Bound, and for ipc:// readable and writable by this user only (the directory is 0700 as well)."""
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
    sock.bind(endpoint)
    if endpoint.startswith("ipc://"):
        os.chmod(endpoint[len("ipc://") :], 0o600)
    return sock


RECONNECT_MS = 10  # zmq's default is 100


def push_socket(ctx: zmq.Context, endpoint: str) -> zmq.Socket:
    """Connects before the peer has bound (processes start in any order); zmq then retries every
    RECONNECT_MS, and the first message waits for the connection: a short interval keeps the first
    request from waiting most of zmq's default one between the user process and the scheduler."""
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RECONNECT_IVL, RECONNECT_MS)
    sock.connect(endpoint)
    return sock
