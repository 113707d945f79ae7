"""Find an engine's processes: the scheduler and detokenizer by title (engine::<role>), the user
process as their parent; under tensor parallelism the other ranks' schedulers (engine::tp-rank<N>)."""

from __future__ import annotations

import psutil

ROLES = ("scheduler", "detokenizer")


def _role(proc: psutil.Process) -> str | None:
    try:
        cmd = proc.cmdline()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return None
    title = " ".join(cmd)
    for role in ROLES:
        if title.startswith(f"engine::{role}"):
            return role
    if title.startswith("engine::tp-rank"):  # a tensor-parallel rank other than 0: scheduler-rank1
        return "scheduler-rank" + title.removeprefix("engine::tp-rank").split()[0]
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
    engines: dict[int, dict[str, int]] = {}
    for proc in candidates:
        role = _role(proc)
        if role is None:
            continue
        try:
            parent = proc.ppid()
        except psutil.NoSuchProcess:
            continue
        engines.setdefault(parent, {"user": parent})[role] = proc.pid
    return [e for e in engines.values() if all(r in e for r in ROLES)]
