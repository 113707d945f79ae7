"""The exact float32 mode's weights in f32_linear's panels, kept on disk between starts and mapped, not read.

The first start keeps the panels in a safetensors file (the int8 cache's naming, trust, upkeep and atomic
write: engine/quantization/cache.py), as large as the float32 weights; later starts map it, copy-on-write,
instead of packing. The file is only ever read: as with the mapped embedding (mapped_weight.py), it must
not be truncated while the engine runs. Opt-in: the choice table's row f32-panels-cached
(EngineConfig.kernel_overrides), since the gain at start is small against a second copy on disk.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from engine.linear.f32_panels import F32Linear
from engine.model.mapped_weight import MappedWeight
from engine.model.safetensors_io import index_file
from engine.quantization import cache

# bump when f32_linear.c's packing changes (1: panels of 16 output columns, [N / 16][K][16] float32, one flat
# tensor a layer; tests/test_panel_cache.py checks the layout)
FORMAT = 1
MODE = "float32-panels"


def panel_file(model_dir: str) -> Path:
    return cache.cache_file(model_dir, MODE, FORMAT, kind="packed")


def mapped_panels(
    model_dir: str, shapes: dict[str, tuple[int, int]]
) -> dict[str, torch.Tensor] | None:
    """name -> the layer's panels, mapped from the cache, for every layer of `shapes` ((out, in) by name)
    the cache holds; None where there is no trusted, well-formed file or one of its layers does not fit
    (never an error: the layers are then packed as without a cache)."""
    try:
        path = panel_file(model_dir)
        if not path.exists() or not cache.trusted(path):
            return None
        out = {}
        for name, entry in index_file(path).items():  # byte counts checked against shapes there
            n, k = shapes.get(name, (-1, -1))
            if entry.dtype != torch.float32 or entry.shape != [n * k]:
                return None
            out[name] = MappedWeight(
                path, entry.offset, entry.nbytes, entry.dtype, entry.shape
            ).tensor
    except (OSError, ValueError, RuntimeError):  # unreadable or damaged: packed again and replaced
        return None
    return out or None


def keep_panels(model_dir: str, model: nn.Module) -> None:
    """The model's freshly packed F32Linear panels into the cache, for the next start (best effort)."""
    panels = {name: m.packed for name, m in model.named_modules() if isinstance(m, F32Linear)}
    if not panels:
        return
    try:
        cache.save_cached(panel_file(model_dir), panels, model_dir, MODE, FORMAT)
    except OSError:  # an unreadable cache directory or model folder: the next start packs again
        pass
