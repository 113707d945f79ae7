"""steer_contrast: a steering vector made from the contrast of two sets of prompts, by name.

Offline, once: the mean residual stream after `layer` over the positive prompts' tokens, minus
that of the negative prompts, saved to a file:

    from engine import Engine
    from engine.plugins.steer_contrast import make_vector
    with Engine() as engine:
        make_vector(engine, ["Love"], ["Hate"], layer=12, path="love.safetensors", name="love")

Then the plugin registers every file named in ENGINE_STEER_VECTORS under its name, and a request
steers with it by name:

    ENGINE_PLUGINS=engine.plugins.steer_contrast:SteerContrast ENGINE_STEER_VECTORS=love.safetensors
    engine.generate(prompt, params, steering=[{"layer": 12, "vector": "love", "scale": 4.0}])
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from engine import envvars
from engine.hooks import hookimpl

if TYPE_CHECKING:  # make_vector's: the plugin itself reads its files without torch
    import torch


def mean_residual(engine, prompts: list[str], layer: int) -> torch.Tensor:
    """The residual stream after `layer`, averaged over every token of every prompt: float32 [hidden]."""
    import torch

    results = engine.generate(
        list(prompts),
        {"max_new_tokens": 1, "temperature": 0},
        return_hidden_states={"layers": [layer], "tokens": "prompt"},
    )
    rows = torch.cat([r["meta_info"]["hidden_states"]["prompt"][0] for r in results])
    return rows.mean(dim=0)


def make_vector(
    engine,
    positive: list[str],
    negative: list[str],
    layer: int,
    path: str | None = None,
    name: str = "contrast",
) -> torch.Tensor:
    """mean_residual(positive) - mean_residual(negative) at `layer`; saved to path (safetensors:
    tensor "vector", metadata name and layer) when given, for the plugin to register."""
    vector = mean_residual(engine, positive, layer) - mean_residual(engine, negative, layer)
    if path is not None:
        from safetensors.torch import save_file

        save_file(
            {"vector": vector.contiguous()}, path, metadata={"name": name, "layer": str(layer)}
        )
    return vector


def load_vector(path: str) -> tuple[str, int | None, list[float]]:
    """(name, layer it was made at, vector) from a file make_vector wrote; the name defaults to
    the file's stem. Read with numpy: the engine's user process and detokenizer load no torch."""
    from safetensors import safe_open

    with safe_open(path, framework="numpy") as f:
        meta = f.metadata() or {}
        vector = f.get_tensor("vector").astype("float32").tolist()
    layer = meta.get("layer")
    return meta.get("name") or Path(path).stem, None if layer is None else int(layer), vector


class SteerContrast:
    """The plugin: registers each vector file under its name (paths None: ENGINE_STEER_VECTORS,
    comma-separated)."""

    def __init__(self, paths: list[str] | None = None) -> None:
        if paths is None:
            paths = [
                p.strip() for p in envvars.read("ENGINE_STEER_VECTORS").split(",") if p.strip()
            ]
        self.vectors: dict[str, list[float]] = {}
        for path in paths:
            name, _, vector = load_vector(path)
            if name in self.vectors:
                raise ValueError(f"steer_contrast: two vector files are named {name!r}")
            self.vectors[name] = vector

    @hookimpl
    def engine_steering_vectors(self) -> dict[str, list[float]]:
        return dict(self.vectors)
