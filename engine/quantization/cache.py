"""Quantized weights kept on disk between starts: quantizing SmolLM2-135M's 135M weights costs about
2 s of CPU, reading them back from a memory-mapped file almost nothing (the pages come in as used).

One safetensors file per (model files, mode, format) in the user cache directory (ENGINE_CACHE_DIR/quantized
where that is set); written to a temporary name and renamed, so a half-written file is never read.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

import torch

from engine import envvars

FORMAT = 2  # bump when the stored layout changes (2: int8 weights in panels of 16 rows where the width allows)


def cache_dir() -> Path:
    override = envvars.read("ENGINE_CACHE_DIR")
    if override:
        return Path(override) / "quantized"
    import platformdirs

    return Path(platformdirs.user_cache_dir("engine")) / "quantized"


def cache_file(model_dir: str, mode: str) -> Path:
    folder = Path(model_dir).resolve()
    parts = [str(folder), mode, str(FORMAT)]
    for p in sorted(folder.glob("*.safetensors")) + [folder / "config.json"]:
        st = p.stat()
        parts.append(f"{p.name}:{st.st_size}:{st.st_mtime_ns}")
    key = hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]
    return cache_dir() / f"{folder.name}-{mode}-{key}.safetensors"


def trusted(path: Path) -> bool:
    """The cache holds weights the scheduler computes with (and sizes it trusts): used only where nobody
    else can write it, as the kernel cache (engine/kernels/cpu/build.py)."""
    from engine.kernels.cpu.build import unsafe_reason

    folders = [path.parent, path.parent.parent]
    return all(not p.exists() or unsafe_reason(p) is None for p in folders) and (
        not path.exists() or unsafe_reason(path) is None
    )


def load_cached(path: Path) -> dict[str, torch.Tensor] | None:
    if not path.exists() or not trusted(path):
        return None
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except Exception:  # noqa: BLE001 - a damaged cache is rebuilt, never fatal
        return None


def save_cached(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Best effort: a read-only or full cache directory only costs the next start its quantization."""
    from safetensors.torch import save_file

    try:
        if not trusted(path):
            return
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd, tmp = tempfile.mkstemp(suffix=".tmp", dir=path.parent)
        os.close(fd)
        try:
            save_file({k: v.contiguous() for k, v in tensors.items()}, tmp)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    except Exception:  # noqa: BLE001 - OSError, or safetensors' own error for a full disk: never fatal
        pass
