"""Find an engine's processes: the scheduler and detokenizer by title (engine::<role> <socket dir>),
the user process as their parent; under tensor parallelism the other ranks' schedulers
(engine::tp-rank<N>; rank 0's title says how many: ranks=<N>). The title's socket directory tells
apart the engines of one user process."""

from __future__ import annotations

import psutil

ROLES = ("scheduler", "detokenizer")


def parse_title(title: str) -> tuple[str, str, int] | None:
    """(role, the engine's socket directory or "", the ranks rank 0 runs on this machine) from an
    engine child's title, e.g. "engine::scheduler ranks=2 engine-ab12"; None for another process."""
    words = title.split()
    if not words:
        return None
    tag = next((w for w in words[1:] if w.startswith("engine-")), "")
    ranks = next((int(w[6:]) for w in words[1:] if w.startswith("ranks=") and w[6:].isdigit()), 1)
    first = words[0]
    if first in {f"engine::{role}" for role in ROLES}:
        return first.removeprefix("engine::"), tag, ranks
    if first.startswith("engine::tp-rank"):  # a tensor-parallel rank other than 0: scheduler-rank1
        return "scheduler-rank" + first.removeprefix("engine::tp-rank"), tag, 1
    return None


def _parsed(proc: psutil.Process) -> tuple[str, str, int] | None:
    try:
        return parse_title(" ".join(proc.cmdline()))
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return None


def engine_processes(root: int | None = None, node_ranks: bool = False) -> list[dict[str, int]]:
    """Engines found among root's descendants (or on the whole machine): [{role: pid}], one dict each,
    once its scheduler, detokenizer and this machine's other ranks all have their titles. node_ranks:
    also the ranks `python -m engine.distributed.node` runs here for an engine whose rank 0 is on
    another machine, as {"node": its pid, "scheduler-rank<N>": ...}."""
    if root is None:
        candidates = psutil.process_iter()
    else:
        try:
            candidates = psutil.Process(root).children(recursive=True)
        except psutil.NoSuchProcess:
            return []
    engines: dict[tuple[int, str], dict[str, int]] = {}
    ranks: dict[tuple[int, str], int] = {}
    for proc in candidates:
        found = _parsed(proc)
        if found is None:
            continue
        role, tag, count = found
        try:
            parent = proc.ppid()
        except psutil.NoSuchProcess:
            continue
        engines.setdefault((parent, tag), {"user": parent})[role] = proc.pid
        if role == "scheduler":
            ranks[(parent, tag)] = count
    found = [
        e
        for key, e in engines.items()
        if all(r in e for r in ROLES)
        and all(f"scheduler-rank{r}" in e for r in range(1, ranks.get(key, 1)))
    ]
    if node_ranks:  # a node's ranks: no scheduler, detokenizer or socket directory of their own
        found += [
            {"node": e.pop("user"), **e}
            for (_, tag), e in engines.items()
            if not tag and not any(r in e for r in ROLES)
        ]
    return found
