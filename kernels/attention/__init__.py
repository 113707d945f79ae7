"""Attention backends: one interface, one implementation per kernel library."""

from kernels.attention.base import AttentionBackend, ForwardBatch, ForwardMode


def create_backend(name: str, device: str, **kwargs) -> AttentionBackend:
    """`auto` and `torch` give the torch backend (the only one this build has)."""
    if name in ("auto", "torch"):
        from kernels.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend(**kwargs)
    raise ValueError(f"unknown attention backend {name!r}; available: ['torch']")


__all__ = ["AttentionBackend", "ForwardBatch", "ForwardMode", "create_backend"]
