"""Device, dtype and KV-pool sizing decisions, made once at scheduler start."""

from __future__ import annotations

import torch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def resolve_device(name: str) -> str:
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device='cuda' was asked for but torch sees no CUDA device")
    return name


def cpu_has_native_bf16() -> bool:
    """AVX512_BF16 or AMX: the CPU runs bfloat16 matmuls natively."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def cpu_model() -> str:
    """The CPU's model name, for benchmark reports (figures are read against the machine)."""
    import platform

    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def resolve_dtype(name: str, device: str) -> torch.dtype:
    """auto: float32 on the CPU (exact, transformers' float32 tokens, and no slower for one stream:
    docs/quantization.md, "Which dtype"), bfloat16 on CUDA."""
    if name == "auto":
        return torch.bfloat16 if device == "cuda" else torch.float32
    return _DTYPES[name]


def free_memory_bytes(device: str) -> int:
    if device == "cuda":
        return int(torch.cuda.mem_get_info()[0])
    import psutil

    return int(psutil.virtual_memory().available)


def pool_size(
    max_total_tokens: int | None, mem_fraction: float, bytes_per_token: int, device: str, cap: int
) -> int:
    """Tokens in the KV pool: the explicit budget, or a share of free memory, never more than can be used."""
    if max_total_tokens is not None:
        return max_total_tokens
    tokens = int(free_memory_bytes(device) * mem_fraction) // bytes_per_token
    if tokens < 1:
        raise MemoryError(
            f"mem_fraction={mem_fraction} of free memory holds no KV token ({bytes_per_token} bytes each)"
        )
    return min(tokens, cap)
