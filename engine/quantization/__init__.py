"""Quantized inference: which modes exist, whether this machine can run one, and the quantized weights
at hand before loading (the int8 cache, a GGUF's blocks). The layers are engine/linear/int8.py and gguf.py."""

from __future__ import annotations

import torch
from torch import nn

from typing import Callable

from engine.config import GGUF_MODES, QUANTIZATIONS


def check_quantization(mode: str, device: str, dtype: torch.dtype) -> None:
    """Raise ValueError naming why this machine or configuration cannot run the mode. The names and the
    explicit dtype/device clashes are refused earlier, in EngineConfig.validate (no torch there); this is
    what only the scheduler knows: the resolved device and dtype, and the CPU's kernels."""
    if mode not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {mode!r}")
    if mode == "none":
        return
    if device != "cpu":
        raise ValueError(
            f"quantization={mode!r} runs on the CPU only (its kernel is C for the CPU); the device is {device!r}"
        )
    if dtype != torch.float32:
        raise ValueError(
            f"quantization={mode!r} computes in float32 (only the weights are quantized); "
            f"use dtype='float32' or 'auto', not {dtype}"
        )
    from engine.kernels.cpu import load_native

    if load_native() is None:
        raise ValueError(
            f"quantization={mode!r} needs its C kernel (engine/kernels/cpu/{mode}_linear.c), which could not be "
            "built: no working C compiler (cc, gcc or $CC), or ENGINE_NATIVE_KERNELS=0"
        )


def resolve_dtype_for(mode: str, dtype_name: str) -> str:
    """The `auto` dtype under a quantization: the quantized kernels take float32 activations."""
    return "float32" if mode != "none" and dtype_name == "auto" else dtype_name


def resolve_device_for(mode: str, device_name: str) -> str:
    """The `auto` device under a quantization: its kernels are the CPU's, even where CUDA is present."""
    return "cpu" if mode != "none" and device_name == "auto" else device_name


def linear_shapes(model: nn.Module) -> dict[str, tuple[int, int]]:
    """(out, in) of every linear layer, by module name (works on the meta device)."""
    return {
        name: tuple(m.weight.shape) for name, m in model.named_modules() if isinstance(m, nn.Linear)
    }


def load_stored(
    model_dir: str,
    mode: str,
    shapes: dict[str, tuple[int, int]],
    cfg=None,
    read_float: Callable[[list[str]], dict[str, torch.Tensor]] | None = None,
    whole_rows: bool = False,
) -> dict | None:
    """The quantized weights that need no float ones: int8's from its cache (cache.py), only if every
    linear layer's are there with the right types and shapes; gguf's from the GGUF file (always, or a
    ValueError saying why not; read_float reads the few float weights it checks them against). With
    them the loader need not read those layers' float weights at all. whole_rows (a tensor-parallel
    rank, which cuts them afterwards): int8's quantized here from the whole rows where the cache
    lacks them, and cached."""
    if mode == "none":
        return None
    if mode in GGUF_MODES:
        from engine.linear.gguf import read_blocks

        return read_blocks(
            model_dir, cfg, shapes, read_float(["layers.0.self_attn.qkv_proj.weight"])
        )
    from engine.quantization import cache

    path = cache.cache_file(model_dir, mode)
    stored = _fitting(cache.load_cached(path), shapes)
    if stored is None and whole_rows:
        stored = _quantize_int8(shapes, read_float)
        cache.save_cached(path, stored, model_dir, mode)
    return stored


def _fitting(stored: dict | None, shapes: dict[str, tuple[int, int]]) -> dict | None:
    """The cached int8 weights where every layer's are there with the right types and shapes."""
    from engine.linear.int8 import stored_shape

    if stored is None:
        return None
    for name, (n, k) in shapes.items():
        q, scale = stored.get(f"{name}.qweight"), stored.get(f"{name}.scale")
        if q is None or scale is None or q.dtype != torch.int8 or scale.dtype != torch.float32:
            return None
        if tuple(q.shape) != stored_shape(n, k) or tuple(scale.shape) != (n,):
            return None
    return stored


def _quantize_int8(shapes: dict[str, tuple[int, int]], read_float) -> dict[str, torch.Tensor]:
    """Every layer's int8 weights and scales as Int8Linear makes them, one float weight at a time."""
    from engine.linear.int8 import quantize_stored

    stored = {}
    for name in shapes:
        weight = read_float([f"{name}.weight"])[f"{name}.weight"]
        stored[f"{name}.qweight"], stored[f"{name}.scale"] = quantize_stored(weight)
    return stored
