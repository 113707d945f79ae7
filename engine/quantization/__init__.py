"""Quantized inference: which modes exist, whether this machine can run one, and swapping the model's
linear layers for quantized ones after loading. Each mode lives in a module of its own (int8.py)."""

from __future__ import annotations

import torch
from torch import nn

from engine.config import QUANTIZATIONS


def check_quantization(mode: str, device: str, dtype: torch.dtype) -> None:
    """Raise ValueError naming why this machine or configuration cannot run the mode. The names and the
    explicit dtype/device clashes are refused earlier, in EngineConfig.validate (no torch there); this is
    what only the scheduler knows: the resolved device and dtype, and the CPU's kernels."""
    if mode not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {mode!r}")
    if mode == "none":
        return
    if device != "cpu":
        raise ValueError(f"quantization={mode!r} runs on the CPU only (its kernel is C for the CPU); the device is {device!r}")
    if dtype != torch.float32:
        raise ValueError(f"quantization={mode!r} computes in float32 (only the weights are int8); "
                         f"use dtype='float32' or 'auto', not {dtype}")  # fmt: skip
    from kernels.cpu import load_native

    if load_native() is None:
        raise ValueError(f"quantization={mode!r} needs its C kernel (kernels/cpu/int8_linear.c), which could not be "
                         "built: no working C compiler (cc, gcc or $CC), or ENGINE_NATIVE_KERNELS=0")  # fmt: skip


def resolve_dtype_for(mode: str, dtype_name: str) -> str:
    """The `auto` dtype under a quantization: int8's kernels take float32 activations."""
    return "float32" if mode != "none" and dtype_name == "auto" else dtype_name


def quantize_model(model: nn.Module, mode: str, model_dir: str | None = None) -> nn.Module:
    """Replace every linear layer of the decoder (lm_head included) in place; embeddings and norms stay.
    A tied lm_head gets its own int8 copy: the float32 embedding is only gathered from, row by row.
    With model_dir, the int8 weights come from (or go to) the on-disk cache (cache.py)."""
    if mode == "none":
        return model
    from engine.quantization import cache
    from engine.quantization.int8 import Int8Linear
    from kernels.cpu import load_native

    lib, threads = load_native(), torch.get_num_threads()
    path = cache.cache_file(model_dir, mode) if model_dir is not None else None
    stored = cache.load_cached(path) if path is not None else None
    fresh: dict[str, torch.Tensor] = {}
    for prefix, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if not isinstance(child, nn.Linear):
                continue
            name = f"{prefix}.{child_name}" if prefix else child_name
            known = None
            if stored is not None and f"{name}.qweight" in stored:
                known = (stored[f"{name}.qweight"], stored[f"{name}.scale"])
            layer = Int8Linear(child.weight, child.bias, lib, threads, known)
            setattr(module, child_name, layer)
            fresh[f"{name}.qweight"], fresh[f"{name}.scale"] = layer.qweight, layer.scale
    if path is not None and (stored is None or stored.keys() != fresh.keys()):
        cache.save_cached(path, fresh)
    _release_float_weights()
    return model


def _release_float_weights() -> None:
    """The float32 linear weights are garbage now; glibc keeps freed heap blocks in the process unless
    asked to give them back, which would leave the scheduler as big as before quantization."""
    import gc

    gc.collect()
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
