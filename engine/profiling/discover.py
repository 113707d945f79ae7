"""Find an engine's processes: the scheduler and detokenizer by title (engine::<role> <socket dir>),
the user process as their parent; under tensor parallelism the other ranks' schedulers
(engine::tp-rank<N>). The title's socket directory tells apart the engines of one user process."""

from __future__ import annotations

import psutil

ROLES = ("scheduler", "detokenizer")


def _role(proc: psutil.Process) -> tuple[str, str] | None:
    """(role, the engine's socket directory or "") from the process title, or None."""
    try:
        cmd = proc.cmdline()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return None
    words = " ".join(cmd).split()
    first, tag = (words[0], words[1] if len(words) > 1 else "") if words else ("", "")
    if first in {f"engine::{role}" for role in ROLES}:
        return first.removeprefix("engine::"), tag
    if first.startswith("engine::tp-rank"):  # a tensor-parallel rank other than 0: scheduler-rank1
        return "scheduler-rank" + first.removeprefix("engine::tp-rank"), tag
    return None


def engine_processes(root: int | None = None) -> list[dict[str, int]]:
    """Engines found among root's descendants (or on the whole machine): [{role: pid}], one dict each."""
    if root is None:
        candidates = psutil.process_iter()
    else:
        try:
            candidates = psutil.Process(root).children(recursive=True)
        except psutil.NoSuchProcess:
            return []
    engines: dict[tuple[int, str], dict[str, int]] = {}
    for proc in candidates:
        found = _role(proc)
        if found is None:
            continue
        role, tag = found
        try:
            parent = proc.ppid()
        except psutil.NoSuchProcess:
            continue
        engines.setdefault((parent, tag), {"user": parent})[role] = proc.pid
    return [e for e in engines.values() if all(r in e for r in ROLES)]
