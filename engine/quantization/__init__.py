"""Quantized inference: which modes exist, whether this machine can run one, and swapping the model's
linear layers for quantized ones after loading. Each mode lives in a module of its own (int8.py, gguf.py)."""

from __future__ import annotations

import torch
from torch import nn

from typing import Callable

from engine.config import GGUF_MODES, QUANTIZATIONS
from engine.linear.swap import release_freed_memory, replace_linears


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
) -> dict | None:
    """The quantized weights that need no float ones: int8's from its cache (cache.py), only if every
    linear layer's are there with the right types and shapes; gguf's from the GGUF file (always, or a
    ValueError saying why not; read_float reads the few float weights it checks them against). With
    them the loader need not read those layers' float weights at all."""
    if mode == "none":
        return None
    if mode in GGUF_MODES:
        from engine.linear.gguf import read_blocks

        return read_blocks(
            model_dir, cfg, shapes, read_float(["layers.0.self_attn.qkv_proj.weight"])
        )
    from engine.quantization import cache
    from engine.linear.int8 import stored_shape

    stored = cache.load_cached(cache.cache_file(model_dir, mode))
    if stored is None:
        return None
    for name, (n, k) in shapes.items():
        q, scale = stored.get(f"{name}.qweight"), stored.get(f"{name}.scale")
        if q is None or scale is None or q.dtype != torch.int8 or scale.dtype != torch.float32:
            return None
        if tuple(q.shape) != stored_shape(n, k) or tuple(scale.shape) != (n,):
            return None
    return stored


def quantize_model(
    model: nn.Module,
    mode: str,
    model_dir: str | None = None,
    stored: dict[str, torch.Tensor] | None = None,
) -> nn.Module:
    """Replace every linear layer of the decoder (lm_head included) in place; embeddings and norms stay.
    A tied lm_head gets its own int8 copy: the float32 embedding is only gathered from, row by row.
    stored: the weights from load_stored (the layers' float weights may then be left unread, on the
    meta device); without it int8's are quantized here and, with model_dir, kept for next time."""
    if mode == "none":
        return model
    from engine.model.fused_decode import install
    from engine.kernels.cpu import load_native

    lib, threads = load_native(), torch.get_num_threads()
    if mode in GGUF_MODES:
        from engine.linear.gguf import GGUFLinear

        int8 = (
            mode == "gguf-q8"
        )  # its layers repack the blocks: each file copy is let go once packed (pop)
        take = stored.pop if int8 else stored.__getitem__
        replace_linears(
            model,
            lambda name, lin: GGUFLinear(
                *take(name), tuple(lin.weight.shape), lin.bias, lib, threads, int8
            ),
        )
    else:
        _swap_int8(model, mode, model_dir, stored, lib, threads)
    release_freed_memory(
        collect=False
    )  # the float32 weights of the swapped layers (plain nn.Linear: no cycles)
    return install(model, lib)  # float32 decode steps with fused elementwise ops


def _swap_int8(
    model: nn.Module, mode: str, model_dir: str | None, stored: dict | None, lib, threads: int
) -> None:
    """int8 layers, from the stored weights or quantized here and then kept on disk for the next start."""
    from engine.quantization import cache
    from engine.linear.int8 import Int8Linear

    fresh: dict[str, torch.Tensor] = {}

    def make(name: str, lin: nn.Linear) -> Int8Linear:
        known = None if stored is None else (stored[f"{name}.qweight"], stored[f"{name}.scale"])
        layer = Int8Linear(lin.weight, lin.bias, lib, threads, known)
        fresh[f"{name}.qweight"], fresh[f"{name}.scale"] = layer.qweight, layer.scale
        return layer

    replace_linears(model, make)
    if stored is None and model_dir is not None:
        cache.save_cached(cache.cache_file(model_dir, mode), fresh, model_dir, mode)
