"""The converted directories of GGUFs (517 MB each for the embedded model) are removed when a new conversion
replaces them, with the cache files made from them; nothing else in the cache folder is touched."""

from __future__ import annotations

import socket
from pathlib import Path

import torch

from engine.model.embedded import conversion_source, prune_conversions
from engine.model.safetensors_io import read_metadata, write_safetensors
from engine.quantization import cache
from engine.quantization.gguf import gguf_source


def _conversion(root: Path, name: str, gguf: Path, host: str | None) -> Path:
    folder = root / name
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    (folder / ".complete").write_text(f"{gguf}\n{host}\n" if host else str(gguf))
    return folder


def test_a_new_conversion_removes_the_ones_it_replaces_and_only_those(tmp_path, monkeypatch):
    monkeypatch.setenv("ENGINE_CACHE_DIR", str(tmp_path / "cache"))
    root, here = tmp_path / "cache", socket.gethostname()
    model, other = tmp_path / "model.gguf", tmp_path / "other.gguf"
    model.write_bytes(b"GGUF"), other.write_bytes(b"GGUF")
    gone = tmp_path / "removed-venv" / "model.gguf"
    kept = _conversion(root, "model-" + "a" * 16, model, here)
    older = _conversion(root, "model-" + "b" * 16, model, "elsewhere")  # the same file: replaced, whoever made it
    orphan = _conversion(root, "model-" + "c" * 16, gone, here)  # its GGUF went with a virtual environment
    legacy = _conversion(root, "model-" + "d" * 16, gone, None)  # a one-line mark, before the host was kept
    survivors = [
        _conversion(root, "other-" + "e" * 16, other, here),  # another GGUF that still exists
        _conversion(root, "model-" + "f" * 16, gone, "elsewhere"),  # another host's (a shared home): its file may be there
        _conversion(root, "user-model", gone, here),  # not named as ours
        root / ("model-" + "0" * 16),  # another process's conversion in progress: no mark yet
        root / "quantized",
    ]
    survivors[3].mkdir()
    int8 = {folder: cache.cache_file(str(folder), "int8") for folder in (kept, orphan, survivors[0])}
    for folder, path in int8.items():
        cache.save_cached(path, {"w": torch.zeros(4)}, str(folder), "int8")
    foreign = cache.cache_file(str(legacy), "int8")
    cache.save_cached(foreign, {"w": torch.zeros(4)}, str(legacy), "int8")
    meta = read_metadata(foreign)
    write_safetensors(str(foreign), {"w": torch.zeros(4)}, {**meta, "host": "elsewhere"})
    assert all(p.exists() for p in [*int8.values(), foreign])

    removed = prune_conversions(kept)
    assert sorted(removed) == sorted([older, orphan, legacy])
    assert kept.is_dir() and all(p.exists() for p in survivors) and not any(p.exists() for p in removed)
    for kind in ("quantized", "packed"):
        cache.prune_orphans(kind)
    assert int8[kept].exists() and int8[survivors[0]].exists() and foreign.exists()  # another host's: kept
    assert not int8[orphan].exists()


def test_the_mark_names_the_gguf_in_either_form(tmp_path):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    new, old = _conversion(tmp_path, "m-" + "1" * 16, gguf, "host-a"), _conversion(tmp_path, "m-" + "2" * 16, gguf, None)
    assert conversion_source(new) == (str(gguf), "host-a") and conversion_source(old) == (str(gguf), None)
    assert gguf_source(str(new)) == gguf == gguf_source(str(old))
    (new / ".complete").write_text("not a gguf\nhost-a\n")
    assert conversion_source(new) is None and gguf_source(str(new)) is None
    assert prune_conversions(new) == [] and old.is_dir()  # a folder that is no conversion prunes nothing
