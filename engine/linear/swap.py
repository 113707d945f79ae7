"""Load-time swaps of a model's linear layers (quantization, bf16 weight packing), and giving the memory
of the weights they replace back to the system."""

from __future__ import annotations

import gc
from typing import Callable

from torch import nn


def replace_linears(model: nn.Module, make: Callable[[str, nn.Linear], nn.Module]) -> int:
    """Every nn.Linear of the model (by its module name) replaced in place by make(name, layer); the count."""
    # (parent, name) pairs only: a list of the layers themselves would keep every replaced weight alive
    # until the end, the plain and the new weights side by side at the peak
    slots = [
        (prefix, module, child_name)
        for prefix, module in model.named_modules()
        for child_name, child in module.named_children()
        if isinstance(child, nn.Linear)
    ]
    for prefix, module, child_name in slots:
        setattr(
            module,
            child_name,
            make(f"{prefix}.{child_name}" if prefix else child_name, getattr(module, child_name)),
        )
    return len(slots)


def release_freed_memory(collect: bool = True) -> None:
    """The replaced weights are garbage now; glibc keeps freed heap blocks in the process unless asked to
    give them back, which would leave the scheduler as big as before the swap. collect=False where the
    replaced layers hold no reference cycles (a plain nn.Linear): refcounting freed them already, and a
    full collection only adds start-up time."""
    if collect:
        gc.collect()
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
