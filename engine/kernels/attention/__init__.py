"""Attention backends: one interface, one implementation per kernel library."""

from engine.kernels.attention.base import AttentionBackend


BACKENDS = ("auto", "torch", "cpu_native")


def create_backend(
    name: str, device: str, native_extend: bool = True, **kwargs
) -> AttentionBackend:
    """`auto`: cpu_native on the CPU when its C kernel builds here and handles the model's heads, else
    torch. `torch` works everywhere. cpu_native runs prefill natively only where its build and head_dim
    allow (AVX-512 and head_dim a multiple of 16, or AVX2 with FMA and a multiple of 8) and native_extend
    (the choice table's native-extend row, engine/linear/choose.py), in torch otherwise: decided here."""
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; available: {list(BACKENDS)}")
    if name in ("auto", "cpu_native") and device == "cpu":
        from engine.kernels.cpu import NATIVE_MAX_HEADS, NATIVE_MAX_HEAD_DIM, load_native

        heads, kv_heads, head_dim = kwargs["num_heads"], kwargs["num_kv_heads"], kwargs["head_dim"]
        fits = (
            heads <= NATIVE_MAX_HEADS
            and head_dim <= NATIVE_MAX_HEAD_DIM
            and kv_heads > 0
            and heads % kv_heads == 0
        )
        if not fits and name == "cpu_native":
            raise ValueError(
                f"attention_backend='cpu_native' supports up to {NATIVE_MAX_HEADS} heads and head_dim "
                f"{NATIVE_MAX_HEAD_DIM}; this model has {heads} heads of {head_dim}"
            )
        lib = load_native() if fits else None
        if lib is not None:
            from engine.kernels.attention.cpu_native_backend import (
                DECODE,
                CpuNativeAttentionBackend,
                native_support,
            )

            # asked once: no failures per request
            if native_support(lib, heads, kv_heads, head_dim) & DECODE:
                return CpuNativeAttentionBackend(lib, native_extend, **kwargs)
            if name == "cpu_native":
                raise ValueError(
                    f"attention_backend='cpu_native' does not handle {heads} heads of {head_dim} here"
                )
        if name == "cpu_native":
            raise RuntimeError(
                "attention_backend='cpu_native' needs a working C compiler (cc) with OpenMP"
            )
    elif name == "cpu_native":
        raise ValueError(f"attention_backend='cpu_native' runs on the CPU only, not on {device!r}")
    from engine.kernels.attention.torch_backend import TorchAttentionBackend

    return TorchAttentionBackend(**kwargs)


__all__ = ["AttentionBackend", "create_backend"]
