"""The machine line every benchmark prints and records: figures are read against the machine they ran on."""

from __future__ import annotations

import os


def machine_line() -> str:
    """The CPU, the cores this process may use, whether bfloat16 is native there, and torch's version."""
    import torch

    from engine.cores import usable_cores
    from engine.scheduler.device import cpu_has_native_bf16, cpu_model

    native = "native bfloat16" if cpu_has_native_bf16() else "no native bfloat16"
    cores = usable_cores()
    host = f" of the host's {os.cpu_count()}" if os.cpu_count() and os.cpu_count() != cores else ""
    return f"{cpu_model()}, {cores} cores{host} (every backend runs on these), {native}, torch {torch.__version__}"
