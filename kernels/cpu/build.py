"""Compile kernels/cpu/*.c into a shared library cached per source and machine, and load it with ctypes."""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from functools import lru_cache
from pathlib import Path

SOURCE = Path(__file__).with_name("decode_attention.c")
FLAGS = ["-O3", "-march=native", "-ffast-math", "-fno-finite-math-only", "-fopenmp", "-shared", "-fPIC"]


def _cpu_signature() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
        flags = next((line for line in text.splitlines() if line.startswith("flags")), "")
        model = next((line for line in text.splitlines() if line.startswith("model name")), "")
    except OSError:
        flags = model = ""
    return f"{platform.machine()}|{model}|{flags}"


def _cache_dir() -> Path:
    override = os.environ.get("ENGINE_CACHE_DIR")
    if override:
        return Path(override) / "kernels"
    import platformdirs

    return Path(platformdirs.user_cache_dir("engine")) / "kernels"


@lru_cache(maxsize=1)
def load_native() -> ctypes.CDLL | None:
    """The compiled library, or None when no C compiler works here (ENGINE_NATIVE_KERNELS=0 also disables)."""
    if os.environ.get("ENGINE_NATIVE_KERNELS", "1") == "0":
        return None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        return None
    source = SOURCE.read_bytes()
    key = hashlib.sha256(source + " ".join(FLAGS).encode() + _cpu_signature().encode()).hexdigest()[:16]
    target = _cache_dir() / f"decode_attention-{key}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
        result = subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", tmp, "-lm"], capture_output=True, text=True)
        if result.returncode != 0:
            os.unlink(tmp)
            return None
        os.replace(tmp, target)
    lib = ctypes.CDLL(str(target))
    lib.decode_attention.restype = ctypes.c_int
    lib.decode_attention.argtypes = [
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,
        ctypes.c_float, ctypes.c_int, ctypes.c_int,
    ]
    lib.extend_attention.restype = ctypes.c_int
    lib.extend_attention.argtypes = [
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
        ctypes.c_int, ctypes.c_int, ctypes.c_float, ctypes.c_int, ctypes.c_int,
    ]
    return lib
