"""The exact float32 mode's weights in f32_linear's panels, kept on disk between starts and mapped, not read.

Why: on the CPUs where float32 layers run on our kernel (AVX2 without AVX-512: f32_linear.py), every start
packed SmolLM2-135M's 540 MB into panels, reading the file and writing as many fresh pages, which the
kernel zeroes on first touch: 0.38 s of the scheduler's 0.50 s load on an AMD EPYC Zen 1, a start whose
3 s target it sat at. The first start keeps the panels in a safetensors file (the int8 cache's naming,
trust, upkeep and atomic write: engine/quantization/cache.py), as large as the float32 weights;
later starts map it, copy-on-write, so a layer's pages come from the page cache when a step first reads
them. The file is only ever read: as with the mapped embedding (mapped_weight.py), it must not be
truncated while the engine runs. Opt-in, ENGINE_PANEL_CACHE=1 (enabled(), below).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from engine import envvars
from engine.linear.f32_panels import F32Linear
from engine.model.mapped_weight import MappedWeight
from engine.model.safetensors_io import index_file
from engine.quantization import cache

# bump when f32_linear.c's packing changes (1: panels of 16 output columns, [N / 16][K][16] float32, one flat
# tensor a layer; tests/test_panel_cache.py checks the layout)
FORMAT = 1
MODE = "float32-panels"


def enabled() -> bool:
    """Off unless ENGINE_PANEL_CACHE=1. Mapped panels decode as fast as packed ones (17 A/B pairs on a Zen 1
    spread both ways within that machine's noise), but the gain is small against the cost: start-up 0-0.5 s
    shorter there, while every model's exact weights take their size again on disk (540 MB for the embedded
    model, 28 GB for a 7B) and the first start writes them (1-2 s more). docs/performance.md."""
    return envvars.read("ENGINE_PANEL_CACHE") == "1"


def panel_file(model_dir: str) -> Path:
    return cache.cache_file(model_dir, MODE, FORMAT, kind="packed")


def mapped_panels(
    model_dir: str, shapes: dict[str, tuple[int, int]]
) -> dict[str, torch.Tensor] | None:
    """name -> the layer's panels, mapped from the cache, for every layer of `shapes` ((out, in) by name)
    the cache holds; None where there is no trusted, well-formed file or one of its layers does not fit
    (never an error: the layers are then packed as without a cache)."""
    if not enabled():
        return None
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
    if not enabled():
        return
    panels = {name: m.packed for name, m in model.named_modules() if isinstance(m, F32Linear)}
    if not panels:
        return
    try:
        cache.save_cached(panel_file(model_dir), panels, model_dir, MODE, FORMAT)
    except OSError:  # an unreadable cache directory or model folder: the next start packs again
        pass
