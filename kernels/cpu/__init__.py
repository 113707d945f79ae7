"""Native CPU kernels: small C files compiled once per machine with the system C compiler and loaded with
ctypes (no torch headers, so the build takes about a second). Missing compiler -> callers fall back to torch."""

from kernels.cpu.build import load_native

__all__ = ["load_native"]
