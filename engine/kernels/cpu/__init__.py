"""Native CPU kernels: small C files compiled once per machine with the system C compiler and loaded with
ctypes (no torch headers, so the build takes seconds; the sources compile side by side). Missing
compiler -> callers fall back to torch."""

from engine.kernels.cpu.build import load_native

NATIVE_MAX_HEADS = 64  # MAX_H in decode_attention.c
NATIVE_MAX_HEAD_DIM = 256  # MAX_D in decode_attention.c

__all__ = ["NATIVE_MAX_HEADS", "NATIVE_MAX_HEAD_DIM", "load_native"]
