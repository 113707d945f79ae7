"""Helpers shared by the tests: process checks, and the engine's idle state."""

from __future__ import annotations

import os
import time


def pid_alive(pid: int) -> bool:
    """True while pid exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def wait_gone(pids, timeout: float) -> list[int]:
    """Wait until none of pids is alive; return those still alive at the deadline."""
    deadline = time.monotonic() + timeout
    alive = list(pids)
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if pid_alive(p)]
        if alive:
            time.sleep(0.1)
    return alive


def wait_path_gone(path: str, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not os.path.exists(path)


def engine_idle(stats: dict) -> bool:
    """Nothing running or queued; every slot free; every pool token free or cached; no lock in the tree."""
    return (
        stats["running"] == 0
        and stats["waiting"] == 0
        and stats["free_slots"] == stats["max_running_requests"]
        and stats["free_tokens"] + stats["cache_tokens"] == stats["max_total_tokens"]
        and stats["cache_locked_tokens"] == 0
        and stats["cache_lock_refs"] == 0
    )
