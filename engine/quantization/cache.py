"""Quantized weights kept on disk between starts: quantizing SmolLM2-135M's 135M weights costs about
2 s of CPU, reading them back from a memory-mapped file almost nothing (the pages come in as used).
The exact mode's float32 panels use the same files' naming and trust (engine/model/panel_cache.py).

One safetensors file per (model files, mode, format) in the user cache directory (ENGINE_CACHE_DIR/quantized
where that is set); written to a temporary name and renamed, so a half-written file is never read.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import tempfile
from pathlib import Path

import torch

from engine import envvars

FORMAT = 2  # bump when the stored layout changes (2: int8 weights in panels of 16 rows where the width allows)


def cache_dir(kind: str = "quantized") -> Path:
    override = envvars.read("ENGINE_CACHE_DIR")
    if override:
        return Path(override) / kind
    import platformdirs

    return Path(platformdirs.user_cache_dir("engine")) / kind


def cache_file(model_dir: str, mode: str, fmt: int = FORMAT, kind: str = "quantized") -> Path:
    """The file for this model's files (by name, size and time), mode and format, under cache_dir(kind)
    (engine/model/panel_cache.py keeps float32 panels under "packed")."""
    folder = Path(model_dir).resolve()
    parts = [str(folder), mode, str(fmt)]
    for p in sorted(folder.glob("*.safetensors")) + [folder / "config.json"]:
        st = p.stat()
        parts.append(f"{p.name}:{st.st_size}:{st.st_mtime_ns}")
    key = hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]
    return cache_dir(kind) / f"{folder.name}-{mode}-{key}.safetensors"


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


def write_safetensors(path: str, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> None:
    """tensors (CPU) as a safetensors file, each written from its own memory: safetensors' save_file copies
    every tensor into bytes first, 650 MB more for SmolLM2's float32 panels."""
    from engine.model.loader import SAFETENSORS_DTYPES

    names = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}
    header, offset = ({"__metadata__": metadata} if metadata else {}), 0
    for key, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        header[key] = {"dtype": names[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for t in tensors.values():
            f.write(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().data)


def _metadata(path: Path) -> dict | None:
    """A cache file's __metadata__ (model_dir, mode), or None (files written before it had none)."""
    try:
        with open(path, "rb") as f:
            length = struct.unpack("<Q", f.read(8))[0]
            if length > 1 << 24:  # not a header this cache wrote
                return None
            meta = json.loads(f.read(length)).get("__metadata__")
    except (OSError, ValueError, struct.error, AttributeError):
        return None
    return meta if isinstance(meta, dict) else None


def prune(kept: Path, model_dir: str, mode: str) -> None:
    """Remove the cache files that kept replaces (the same model directory and mode, older files or format)
    and those of model directories that no longer exist (the tests' tiny models in temporary folders):
    without it every change of a model's files, and every test run, left hundreds of MB behind. Files
    written before the metadata are matched by their name's model folder and mode. An engine that has a
    removed file mapped keeps reading it (its pages live until unmapped)."""
    folder = str(Path(model_dir).resolve())
    for path in kept.parent.glob("*.safetensors"):
        if path == kept:
            continue
        meta = _metadata(path)
        if meta is None:
            stale = path.name.startswith(f"{Path(folder).name}-{mode}-")
        else:
            source = str(meta.get("model_dir", ""))
            stale = not Path(source).is_dir() or (source == folder and meta.get("mode") == mode)
        if stale:
            try:
                path.unlink()
            except OSError:
                pass


def save_cached(path: Path, tensors: dict[str, torch.Tensor], model_dir: str, mode: str) -> None:
    """Best effort: a read-only or full cache directory only costs the next start its quantization (or
    packing). The file records its model directory and mode, and replaces the files it supersedes (prune)."""
    try:
        if not trusted(path):
            return
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd, tmp = tempfile.mkstemp(suffix=".tmp", dir=path.parent)
        os.close(fd)
        try:
            write_safetensors(tmp, tensors, {"model_dir": str(Path(model_dir).resolve()), "mode": mode})
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        prune(path, model_dir, mode)
    except Exception:  # noqa: BLE001 - OSError (a full disk, a read-only directory): never fatal
        pass
