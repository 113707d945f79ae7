"""Quantized weights kept on disk between starts: quantizing costs seconds of CPU, reading them back
from a memory-mapped file almost nothing (the pages come in as used).
The exact mode's float32 panels use the same files' naming, trust and upkeep (engine/linear/panel_cache.py).

One safetensors file per (model files, mode, format) in the user cache directory (ENGINE_CACHE_DIR/quantized
where that is set); written to a temporary name and renamed, so a half-written file is never read. Each
file records its model directory, mode and host; writing one removes those it replaces (prune).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import socket
import tempfile
from pathlib import Path

import torch

from engine import envvars
from engine.model.safetensors_io import read_metadata, write_safetensors

FORMAT = 2  # bump when the stored layout changes (2: int8 weights in panels of 16 rows where the width allows)


def cache_dir(kind: str = "quantized") -> Path:
    override = envvars.read("ENGINE_CACHE_DIR")
    if override:
        return Path(override) / kind
    import platformdirs

    return Path(platformdirs.user_cache_dir("engine")) / kind


def cache_file(model_dir: str, mode: str, fmt: int = FORMAT, kind: str = "quantized") -> Path:
    """The file for this model's files (by name, size and time), mode and format, under cache_dir(kind)
    (engine/linear/panel_cache.py keeps float32 panels under "packed")."""
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


def prune(kept: Path, model_dir: str, mode: str, fmt: int) -> None:
    """Remove the cache files that kept replaces: the same model directory and mode under another key (its
    files changed), the same model files in an older format (files written before the metadata are known
    only by those names), and this host's files of model directories that no longer exist (the tests' tiny
    models in temporary folders). Without it every change of a model's files, and every test run, left
    hundreds of MB behind. Files another host wrote (a shared home) are left unless they are this model's.
    An engine that has a removed file mapped keeps reading it (its pages live until it unmaps them)."""
    folder, host = str(Path(model_dir).resolve()), socket.gethostname()
    older = {cache_file(model_dir, mode, f, kept.parent.name).name for f in range(1, fmt)}
    for path in kept.parent.glob("*.safetensors"):
        if path == kept:
            continue
        meta = read_metadata(path)
        if meta is None:
            stale = path.name in older
        else:
            mine = str(meta.get("model_dir", "")) == folder and meta.get("mode") == mode
            stale = mine or _orphan(meta, host)
        if stale:
            _unlink(path)


def prune_orphans(kind: str) -> None:
    """Remove this host's files under cache_dir(kind) whose model directory no longer exists: called when
    engine/model/embedded.py removes old conversions, whose files nothing would otherwise replace."""
    host = socket.gethostname()
    try:
        paths = list(cache_dir(kind).glob("*.safetensors"))
    except OSError:
        return
    for path in paths:
        meta = read_metadata(path)
        if meta is not None and _orphan(meta, host):
            _unlink(path)


def _orphan(meta: dict[str, str], host: str) -> bool:
    return meta.get("host") == host and not Path(str(meta.get("model_dir", ""))).is_dir()


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass


def save_cached(
    path: Path, tensors: dict[str, torch.Tensor], model_dir: str, mode: str, fmt: int = FORMAT
) -> None:
    """Best effort: a read-only or full cache directory only costs the next start its quantization (or
    packing); a disk with less than twice the file's size free is not written to."""
    try:
        if not trusted(path):
            return
        from engine.cache_upkeep import make_private_dirs, remove_stale, sync_file

        make_private_dirs(path.parent)
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        if shutil.disk_usage(path.parent).free < 2 * size:
            return
        fd, tmp = tempfile.mkstemp(suffix=".tmp", dir=path.parent)
        os.close(fd)
        try:
            meta = {
                "model_dir": str(Path(model_dir).resolve()),
                "mode": mode,
                "host": socket.gethostname(),
            }
            write_safetensors(tmp, tensors, meta)
            sync_file(Path(tmp))  # its data on disk before the rename makes it the cache's
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        prune(path, model_dir, mode, fmt)
        remove_stale(path.parent, ("tmp*.tmp",))  # writes a killed process left
    except Exception:  # noqa: BLE001 - OSError (a full disk, a read-only directory): never fatal
        pass
