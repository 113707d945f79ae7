"""What this load offers the choice table: the mode, dtype and device asked for, and this CPU's kernels."""

from __future__ import annotations

import torch

from engine.linear import bf16, f32_blocks, f32_panels
from engine.linear.choose import Where
from engine.linear.onednn import packing_available


def native_library(mode: str, dtype: torch.dtype, device: str):
    """Our C kernels where this load may use them (the CPU: quantized, or packed, or bfloat16's float32
    head), else None; built or loaded once a process."""
    if torch.device(device).type != "cpu":
        return None
    if mode == "none" and not (packing_available(dtype, device) or dtype == torch.bfloat16):
        return None
    from engine.kernels.cpu import load_native

    return load_native()


def where_here(
    mode: str,
    dtype: torch.dtype,
    device: str,
    tied: bool,
    lib,
    overrides: dict[str, str],
    tp: bool = False,
) -> Where:
    """The table's facts for this load, before the weights are looked at (tp: a rank's shards)."""
    where = Where(
        mode=mode,
        dtype=str(dtype).removeprefix("torch."),
        device=torch.device(device).type,
        tied=tied,
        overrides=dict(overrides),
        tp=tp,
    )
    if mode != "none" or not packing_available(dtype, device) or where.on("torch-plain"):
        return where
    f32 = f32_panels.runs_here(lib)
    return where.found(
        packs=True,
        avx2_only=torch.backends.cpu.get_cpu_capability() == "AVX2",
        bf16_kernel=dtype == torch.bfloat16 and bf16.runs_here(lib),
        f32_kernel=dtype == torch.float32 and f32,
        f32_blocks_kernel=dtype == torch.float32 and f32 and f32_blocks.runs_here(lib),
    )
