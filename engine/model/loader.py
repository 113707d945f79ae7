"""Build the decoder from a Hugging Face directory (config.json + safetensors), reporting progress."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import torch

from engine.model.config import ModelConfig, model_config_from_hf
from engine.model.llama import LlamaForCausalLM, remap_hf_weights
from engine.model.rope import rotary_tables
from engine.quantization import quantize_model


def safetensors_files(model_dir: str) -> list[Path]:
    folder = Path(model_dir)
    index = folder / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [folder / n for n in names]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors weights in {model_dir}")
    return files


def read_weights(model_dir: str, progress: Callable[[int, int], None] | None = None) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    files = safetensors_files(model_dir)
    handles = [safe_open(str(f), framework="pt") for f in files]
    keys = [(h, k) for h in handles for k in h.keys()]
    tensors: dict[str, torch.Tensor] = {}
    for i, (handle, key) in enumerate(keys, 1):
        tensors[key] = handle.get_tensor(key)
        if progress is not None:
            progress(i, len(keys))
    return tensors


def load_model(
    model_dir: str, hf_config, dtype: torch.dtype, device: str, max_positions: int, progress=None,
    quantization: str = "none",
) -> tuple[LlamaForCausalLM, ModelConfig]:
    cfg = model_config_from_hf(hf_config, model_dir)
    cos, sin = rotary_tables(hf_config, cfg.head_dim, max_positions, dtype, device)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, cos.to("meta"), sin.to("meta"))
    weights = remap_hf_weights(cfg, read_weights(model_dir, progress))
    state = {k: v.to(dtype=dtype, device=device) for k, v in weights.items()}
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    missing = [m for m in missing if not (cfg.tie_word_embeddings and m == "lm_head.weight")]
    if missing or unexpected:
        raise ValueError(f"weights do not fit the model: missing {missing[:8]}, unexpected {unexpected[:8]}")
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.rope_cos, model.rope_sin = cos, sin
    model.eval()
    return quantize_model(model, quantization, model_dir), cfg
