"""Load-time swaps of a model's linear layers (quantization, bf16 weight packing), and giving the memory
of the weights they replace back to the system."""

from __future__ import annotations

import gc
from typing import Callable

from torch import nn


def replace_linears(model: nn.Module, make: Callable[[str, nn.Linear], nn.Module]) -> int:
    """Every nn.Linear of the model (by its module name) replaced in place by make(name, layer); the count."""
    count = 0
    for prefix, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, child_name, make(f"{prefix}.{child_name}" if prefix else child_name, child))
                count += 1
    return count


def release_freed_memory(collect: bool = True) -> None:
    """The replaced weights are garbage now; glibc keeps freed heap blocks in the process unless asked to
    give them back, which would leave the scheduler as big as before the swap. collect=False where the
    replaced layers hold no reference cycles (a plain nn.Linear): refcounting freed them already, and a
    full collection costs 0.07 s of start-up on a small CPU."""
    if collect:
        gc.collect()
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
