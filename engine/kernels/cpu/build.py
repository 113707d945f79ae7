"""Compile engine/kernels/cpu/*.c (attention, elementwise, the decode step's layers, bf16, float32, int8 and
GGUF-block linear) into one
shared library cached per source and machine, and load it with ctypes.

No -ffast-math: with GCC it links crtfastmath.o, whose constructor turns on flush-to-zero for the
whole process that loads the library (1e-40 * 1.0 == 0.0 in every thread of the scheduler after).
The kernels vectorize without it: their reductions are `omp simd`, their exp is their own.

A library in the cache is code the scheduler runs, so the cache is trusted only as ssh trusts its
files: owned by this user (or root) and writable by nobody else. Otherwise the library is built in a
fresh private directory instead, and a warning names the unsafe path.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import os
import platform
import shlex
import shutil
import stat
import subprocess
import tempfile
from functools import lru_cache
from pathlib import Path

from engine import envvars

logger = logging.getLogger(__name__)

# every kernel: attention, elementwise, the decode step, linear layers
SOURCES = sorted(Path(__file__).parent.glob("*.c"))
# every header the sources include: part of the cache key, as the sources
HEADERS = sorted(Path(__file__).parent.glob("*.h"))
LIBRARY_NAME = "cpu_kernels"
FLAGS = [
    "-O3",
    "-march=native",
    "-fno-math-errno",
    "-fno-trapping-math",
    "-ffp-contract=fast",
    "-fopenmp",
    "-shared",
    "-fPIC",
]


def _cpuinfo_line(prefix: str) -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    return next((line for line in text.splitlines() if line.startswith(prefix)), "")


def _cpu_signature() -> str:
    return f"{platform.machine()}|{_cpuinfo_line('model name')}|{_cpuinfo_line('flags')}"


@lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as /proc/cpuinfo names them (empty where there is none)."""
    return frozenset(_cpuinfo_line("flags").partition(":")[2].split())


def _cache_dir() -> Path:
    override = envvars.read("ENGINE_CACHE_DIR")
    if override:
        return Path(override) / "kernels"
    import platformdirs

    return Path(platformdirs.user_cache_dir("engine")) / "kernels"


def compiler_command() -> list[str] | None:
    """$CC split as a shell would ("ccache gcc" is two words), else cc or gcc from PATH; None if none."""
    cc = os.environ.get("CC", "").strip()
    if cc:
        try:
            words = shlex.split(cc)
        except ValueError:
            return None
        return words if words and shutil.which(words[0]) else None
    found = shutil.which("cc") or shutil.which("gcc")
    return [found] if found else None


def unsafe_reason(path: Path) -> str | None:
    """Why path may not be trusted (another user may write it), or None. Like ssh's StrictModes."""
    try:
        st = path.stat()
    except OSError as exc:
        return f"cannot stat it ({exc})"
    if st.st_uid not in (os.getuid(), 0):
        return f"it is owned by uid {st.st_uid}, not by this user"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"it is writable by group or others (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def _object(command: list[str], source: Path, folder: Path) -> bool:
    """Compile one source into folder/<name>.o; whether that worked (-shared is the link's alone)."""
    flags = [f for f in FLAGS if f != "-shared"]
    result = subprocess.run(
        [*command, *flags, "-c", str(source), "-o", str(folder / f"{source.stem}.o")],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    return result.returncode == 0


def _compile(command: list[str], folder: Path) -> Path | None:
    """Build into a new file in folder; the file, or None (nothing left behind) when the build fails.

    Each source is compiled on its own, as many at once as this process may use cores, then linked: the
    sources are separate translation units either way (no LTO), so the library's code is the same as one
    `cc` call over all of them would make, in less wall time (docs/performance.md, "Kernel measurements").
    """
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=folder)
    os.close(fd)
    objects: Path | None = None
    ok = False
    try:
        from concurrent.futures import ThreadPoolExecutor

        objects = Path(tempfile.mkdtemp(prefix=".objects-", dir=folder))
        jobs = max(1, len(os.sched_getaffinity(0)))
        longest_first = sorted(SOURCES, key=lambda p: p.stat().st_size, reverse=True)
        with ThreadPoolExecutor(max_workers=jobs) as pool:
            compiled = list(
                pool.map(lambda source: _object(command, source, objects), longest_first)
            )
        if all(compiled):
            linked = subprocess.run(
                [
                    *command,
                    *FLAGS,
                    *(str(objects / f"{p.stem}.o") for p in SOURCES),
                    "-o",
                    tmp,
                    "-lm",
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            ok = linked.returncode == 0 and os.path.getsize(tmp) > 0
    except Exception:  # noqa: BLE001 - no compiler, no threads, a full disk: torch's kernels instead, nothing left
        ok = False
    finally:
        if objects is not None:
            shutil.rmtree(objects, ignore_errors=True)
        if not ok:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
    return Path(tmp) if ok else None


def source_bytes() -> bytes:
    return b"".join(p.name.encode() + b"\0" + p.read_bytes() for p in [*SOURCES, *HEADERS])


def cache_key() -> str:
    """Sources, flags and CPU: a change to any of them builds a new library."""
    return hashlib.sha256(
        source_bytes() + " ".join(FLAGS).encode() + _cpu_signature().encode()
    ).hexdigest()[:16]


def cached_library() -> Path:
    """Where the cache keeps (or will keep) the library of these sources, flags and CPU."""
    return _cache_dir() / f"{LIBRARY_NAME}-{cache_key()}.so"


def library_path(rebuild: bool = False) -> tuple[Path, bool] | None:
    """(the compiled library, whether it is a private copy to delete once loaded), or None where it is
    not cached and no compiler builds it. A trusted cached library is used without a compiler (an image
    may ship a warm cache and no gcc); `rebuild` replaces it (it would not load)."""
    target = cached_library()
    try:
        from engine.cache_upkeep import make_private_dirs

        make_private_dirs(target.parent)
    except OSError:
        pass
    problem = next(
        (
            f"{p}: {why}"
            for p in (target.parent.parent, target.parent)
            if (why := unsafe_reason(p)) is not None
        ),
        None,
    )
    if problem is None and not rebuild and target.exists() and unsafe_reason(target) is None:
        return target, False
    command = compiler_command()
    if command is None:
        return None
    if problem is None:
        from engine.cache_upkeep import remove_stale, sync_file

        built = _compile(command, target.parent)
        if built is None:
            return None
        try:
            sync_file(built)
        except OSError:  # best effort: the library is whole in this process's view either way
            pass
        os.replace(built, target)
        remove_stale(target.parent, ("tmp*.so", ".objects-*"))  # builds a killed process left
        return target, False
    logger.warning(
        "engine: not using the kernel cache (%s); building in a private directory", problem
    )
    private = Path(tempfile.mkdtemp(prefix="engine-kernels-"))
    built = _compile(command, private)
    if built is None:
        shutil.rmtree(private, ignore_errors=True)
        return None
    return built, True


def bind_attention(lib: ctypes.CDLL) -> ctypes.CDLL:
    """Declare the attention kernels' C signatures (a library built from decode_attention.c and extend_avx2.c,
    which it calls on AVX2 builds, has only these)."""
    lib.decode_attention.restype = ctypes.c_int
    lib.decode_attention.argtypes = [
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_int64,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_float,
        ctypes.c_int,
        ctypes.c_int,
    ]
    lib.decode_attention_store.restype = ctypes.c_int
    lib.decode_attention_store.argtypes = [
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_int64,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_int64,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_float,
        ctypes.c_int,
        ctypes.c_int,
    ]
    lib.extend_attention.restype = ctypes.c_int
    lib.extend_attention.argtypes = [
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_int64,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_float,
        ctypes.c_int,
        ctypes.c_int,
    ]
    return lib


def bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    """Declare the kernels' C signatures on a loaded library."""
    bind_attention(lib)
    lib.int8_linear.restype = ctypes.c_int
    lib.int8_linear.argtypes = [
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_int64,
        ctypes.c_int64,
        ctypes.c_int64,
        ctypes.c_int,
    ]
    # absent from libraries built before it (the kernel bench loads old builds)
    if hasattr(lib, "int8_panel_linear"):
        lib.int8_panel_linear.restype = ctypes.c_int
        lib.int8_panel_linear.argtypes = lib.int8_linear.argtypes
        lib.int8_panel_vectorized.restype = ctypes.c_int
        lib.int8_panel_vectorized.argtypes = []
    lib.gguf_linear.restype = ctypes.c_int
    lib.gguf_linear.argtypes = [
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_int64,
        ctypes.c_int64,
        ctypes.c_int64,
        ctypes.c_int,
    ]
    # absent from libraries built before it, as int8_panel_linear
    if hasattr(lib, "gguf_panel_linear"):
        lib.gguf_panel_linear.restype = ctypes.c_int
        lib.gguf_panel_linear.argtypes = lib.gguf_linear.argtypes
        lib.gguf_panel_vectorized.restype = ctypes.c_int
        lib.gguf_panel_vectorized.argtypes = []
    # quantization="gguf-q8" (absent from libraries built before it)
    if hasattr(lib, "gguf_q8_linear"):
        lib.gguf_q8_bytes.restype = ctypes.c_int64
        lib.gguf_q8_bytes.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
        lib.gguf_q8_pack.restype = ctypes.c_int
        lib.gguf_q8_pack.argtypes = [
            ctypes.c_int,
            ctypes.c_void_p,
            ctypes.c_int64,
            ctypes.c_int64,
            ctypes.c_void_p,
        ]
        lib.gguf_q8_linear.restype = ctypes.c_int
        lib.gguf_q8_linear.argtypes = lib.gguf_linear.argtypes
    lib.gguf_dequantize.restype = ctypes.c_int
    lib.gguf_dequantize.argtypes = [
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_int64,
        ctypes.c_int64,
        ctypes.c_int,
    ]
    lib.add_rms_norm.restype = None
    lib.add_rms_norm.argtypes = [ctypes.c_void_p] * 4 + [
        ctypes.c_int64,
        ctypes.c_int64,
        ctypes.c_float,
        ctypes.c_int,
    ]
    lib.rotary_qkv.restype = None
    lib.rotary_qkv.argtypes = [
        ctypes.c_void_p,
        ctypes.c_int64,
        ctypes.c_int64,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_int,
    ]
    lib.silu_mul.restype = None
    lib.silu_mul.argtypes = [
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_int64,
        ctypes.c_int64,
        ctypes.c_int,
    ]
    lib.add_rms_norm_bf16.restype = None
    lib.add_rms_norm_bf16.argtypes = [ctypes.c_void_p] * 4 + [
        ctypes.c_int64,
        ctypes.c_int64,
        ctypes.c_float,
        ctypes.c_int,
    ]
    lib.rotary_qkv_bf16.restype = None
    lib.rotary_qkv_bf16.argtypes = [
        ctypes.c_void_p,
        ctypes.c_int64,
        ctypes.c_int64,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_int,
    ]
    lib.silu_mul_bf16.restype = None
    lib.silu_mul_bf16.argtypes = [
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_int64,
        ctypes.c_int64,
        ctypes.c_int,
    ]
    # absent from libraries built before it (the kernel bench loads old builds)
    if hasattr(lib, "bf16_linear"):
        lib.bf16_linear_support.restype = ctypes.c_int
        lib.bf16_linear_support.argtypes = []
        lib.bf16_linear_pack.restype = ctypes.c_int
        lib.bf16_linear_pack.argtypes = [
            ctypes.c_void_p,
            ctypes.c_int64,
            ctypes.c_int64,
            ctypes.c_int,
            ctypes.c_void_p,
        ]
        lib.bf16_linear.restype = ctypes.c_int
        lib.bf16_linear.argtypes = [
            ctypes.c_void_p,
            ctypes.c_int64,
            ctypes.c_int64,
            ctypes.c_void_p,
            ctypes.c_int64,
            ctypes.c_int,
            ctypes.c_void_p,
            ctypes.c_int,
        ]
    # a bfloat16 model's float32 logits (absent from libraries built before it)
    if hasattr(lib, "bf16_logits"):
        lib.bf16_logits_support.restype = ctypes.c_int
        lib.bf16_logits_support.argtypes = []
        lib.bf16_logits_pack.restype = ctypes.c_int
        lib.bf16_logits_pack.argtypes = [
            ctypes.c_void_p,
            ctypes.c_int64,
            ctypes.c_int64,
            ctypes.c_int,
            ctypes.c_void_p,
        ]
        lib.bf16_logits.restype = ctypes.c_int
        # (x, m, k, packed, n, nr, y, threads), y float32
        lib.bf16_logits.argtypes = lib.bf16_linear.argtypes
    # absent from libraries built before it (the kernel bench loads old builds)
    if hasattr(lib, "f32_linear"):
        lib.f32_linear_support.restype = ctypes.c_int
        lib.f32_linear_support.argtypes = []
        lib.f32_linear_pack.restype = ctypes.c_int
        lib.f32_linear_pack.argtypes = [
            ctypes.c_void_p,
            ctypes.c_int64,
            ctypes.c_int64,
            ctypes.c_void_p,
            ctypes.c_int,
        ]
        lib.f32_linear.restype = ctypes.c_int
        lib.f32_linear.argtypes = [
            ctypes.c_void_p,
            ctypes.c_int64,
            ctypes.c_int64,
            ctypes.c_void_p,
            ctypes.c_int64,
            ctypes.c_void_p,
            ctypes.c_int,
        ]
    # absent from libraries built before it (the kernel bench loads old builds)
    if hasattr(lib, "f32_block_linear"):
        lib.f32_blocks_support.restype = ctypes.c_int
        lib.f32_blocks_support.argtypes = []
        lib.f32_blocks_bytes.restype = ctypes.c_int64
        lib.f32_blocks_bytes.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
        lib.f32_blocks_pack.restype = ctypes.c_int
        lib.f32_blocks_pack.argtypes = [
            ctypes.c_int,
            ctypes.c_void_p,
            ctypes.c_int64,
            ctypes.c_int64,
            ctypes.c_void_p,
            ctypes.c_int,
        ]
        lib.f32_block_linear.restype = ctypes.c_int
        lib.f32_block_linear.argtypes = [
            ctypes.c_int,
            ctypes.c_void_p,
            ctypes.c_int64,
            ctypes.c_int64,
            ctypes.c_void_p,
            ctypes.c_int64,
            ctypes.c_void_p,
            ctypes.c_int,
        ]
    # engine/model/decode_layers.py: the structs' addresses, h, t, cos, sin, the step
    if hasattr(lib, "decode_layers"):
        lib.decode_layers.restype = ctypes.c_int
        lib.decode_layers.argtypes = [
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_int64,
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_int64,
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_int,
            ctypes.c_void_p,
        ]
    if hasattr(lib, "native_support"):
        lib.native_support.restype = ctypes.c_int
        lib.native_support.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int]
    return lib


@lru_cache(maxsize=1)
def load_native() -> ctypes.CDLL | None:
    """The compiled library, or None when no C compiler works here (ENGINE_NATIVE_KERNELS=0 also disables)."""
    if envvars.read("ENGINE_NATIVE_KERNELS") == "0":
        return None
    found = library_path()
    if found is None:
        return None
    path, private = found
    try:
        return bind(ctypes.CDLL(str(path)))
    except (
        OSError
    ) as exc:  # a cached library cut short (a crash as it was written): built again, once
        if private:
            raise
        logger.warning(
            "engine: the cached kernel library does not load (%s); building it again", exc
        )
        found = library_path(rebuild=True)
        if found is None:
            return None
        path, private = found
        return bind(ctypes.CDLL(str(path)))
    finally:
        if private:  # mapped now: the file is no longer needed
            shutil.rmtree(path.parent, ignore_errors=True)
