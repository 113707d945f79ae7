"""Helpers shared by the tests: process checks, and the engine's idle state."""

from __future__ import annotations

import ctypes
import os
import platform
import subprocess
import time
from pathlib import Path

import pytest


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


def wait_path(path: str, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.05)
    return os.path.exists(path)


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


class ScalarBuild:
    """The real kernel library, but its `question`() (int8_panel_vectorized, gguf_panel_vectorized) answers 0,
    as a build without AVX2 does: the layers' choice of path on such a machine, tested here."""

    def __init__(self, lib: ctypes.CDLL, question: str) -> None:
        self._lib, self._question = lib, question

    def __getattr__(self, name: str) -> object:
        return (lambda: 0) if name == self._question else getattr(self._lib, name)


def build_narrower(tmp_path, source_names: str | list[str], flags: list[str]) -> ctypes.CDLL:
    """Kernel sources (one, or several that call each other) compiled with the project's flags plus `flags`
    (-mno-avx512f, ...): the path a machine without those instructions builds. Skips where there is no C
    compiler on x86-64."""
    from engine.kernels.cpu import build

    command = build.compiler_command()
    if command is None or platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("needs a C compiler on x86-64 to build the narrower paths")
    names = [source_names] if isinstance(source_names, str) else source_names
    sources = [str(next(p for p in build.SOURCES if p.name == name)) for name in names]
    out = tmp_path / (Path(sources[0]).stem + "_narrow.so")
    subprocess.run([*command, *build.FLAGS, *flags, *sources, "-o", str(out), "-lm"], check=True)
    return ctypes.CDLL(str(out))


def deeply_nested(message, depth: int = 5000) -> bytes:
    """The message encoded with its "NEST" string value replaced by maps nested `depth` deep."""
    import msgspec

    data = msgspec.msgpack.Encoder().encode(message)
    placeholder = msgspec.msgpack.encode("NEST")
    assert data.count(placeholder) == 1
    return data.replace(placeholder, b"\x81\xa1a" * depth + b"\xc0")
