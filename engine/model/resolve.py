"""Turn the user's model_path into a Hugging Face directory (converting a GGUF once)."""

from __future__ import annotations

import os
from pathlib import Path

from engine.model.embedded import convert_gguf, converted_dir_for, embedded_gguf_path, is_converted


def resolve_model_dir(model_path: str | None, announce=print) -> str:
    """None: the embedded model. A .gguf file: converted and cached. A directory: must hold config.json."""
    if model_path is None:
        gguf = embedded_gguf_path()
    else:
        path = Path(os.path.expanduser(model_path))
        if path.is_dir():
            if not (path / "config.json").exists():
                raise FileNotFoundError(
                    f"model_path {model_path!r} is a directory without config.json"
                )
            return str(path)
        if not path.exists():
            raise FileNotFoundError(
                f"model_path {model_path!r} does not exist (give a Hugging Face directory or a .gguf file; "
                "nothing is downloaded)"
            )
        if path.suffix != ".gguf":
            raise ValueError(f"model_path {model_path!r} is a file but not a .gguf file")
        gguf = path
    if not is_converted(converted_dir_for(gguf)) and announce is not None:
        announce(f"Dequantizing {gguf.name} once into {converted_dir_for(gguf)} ...")
    return str(convert_gguf(gguf))


def model_name(model_path: str | None) -> str:
    """The name spans and stats report (gen_ai.request.model): the file or folder name, no suffix."""
    path = embedded_gguf_path() if model_path is None else Path(os.path.expanduser(model_path))
    name = path.name if path.is_dir() else path.stem
    return name.split(".")[0] if path.suffix == ".gguf" else name
