"""The ranks' meeting place on one machine (no torch here: the user process picks it)."""

from __future__ import annotations

import socket


def free_loopback_address() -> str:
    """host:port of a loopback port free now, for one machine's rendezvous."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"
