"""How many cores this process may use: torch-free, so the benchmark's baseline children can ask too."""

from __future__ import annotations

import os


def usable_cores() -> int:
    """The cores this process may run on (taskset, a container's cpuset), not the host's count: the
    engine's threads, and every benchmark baseline's, are sized by it."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1
