"""What the decoder needs from a Hugging Face config, checked once so unsupported models fail clearly."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...]


def _eos_ids(*values) -> tuple[int, ...]:
    out: list[int] = []
    for value in values:
        if value is None:
            continue
        for v in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(v, int) and v not in out:
                out.append(v)
    return tuple(out)


# Keys read straight from config.json; where one is missing, transformers' class default would apply,
# so such a config goes through AutoConfig instead.
_PLAIN_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "rms_norm_eps",
    "max_position_embeddings",
    "tie_word_embeddings",
    "eos_token_id",
    "num_key_value_heads",
)


class PlainConfig(SimpleNamespace):
    """config.json as attributes, for the configs that need nothing from transformers' classes."""


def plain_config(model_dir: str) -> PlainConfig | None:
    """config.json read as it is, or None where transformers' own parsing would add something:
    a model type other than the three supported, a missing key (its class default), rope scaling."""
    data = json.loads((Path(model_dir) / "config.json").read_text())
    if data.get("model_type") not in ("llama", "qwen2", "mistral") or any(
        k not in data for k in _PLAIN_KEYS
    ):
        return None
    # MistralConfig's default is 4096
    if data["model_type"] == "mistral" and "sliding_window" not in data:
        return None
    rope = data.get("rope_parameters") or {}
    if data.get("rope_scaling") or rope.get("rope_type", "default") != "default":
        return None
    if "rope_theta" not in rope and "rope_theta" not in data:
        return None
    return PlainConfig(**data)


def load_hf_config(model_dir: str):
    """The model's config. config.json read directly where that is exact (importing transformers and
    AutoConfig costs the scheduler seconds of start-up); AutoConfig otherwise."""
    plain = plain_config(model_dir)
    if plain is not None:
        return plain
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_dir)


def model_config_from_hf(hf_config, model_dir: str | None = None) -> ModelConfig:
    archs = getattr(hf_config, "architectures", None) or []
    by_type = {
        "llama": "LlamaForCausalLM",
        "qwen2": "Qwen2ForCausalLM",
        "mistral": "MistralForCausalLM",
    }
    arch = archs[0] if archs else by_type.get(getattr(hf_config, "model_type", ""), "")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"unsupported architecture {arch!r}; supported: {SUPPORTED_ARCHITECTURES}")
    act = getattr(hf_config, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"unsupported hidden_act {act!r}: only silu (SwiGLU) is implemented")
    if arch == "Qwen2ForCausalLM" and getattr(hf_config, "use_sliding_window", False):
        raise ValueError("Qwen2 with use_sliding_window=True is not supported")
    if arch == "MistralForCausalLM" and getattr(hf_config, "sliding_window", None):
        if hf_config.sliding_window < hf_config.max_position_embeddings:
            raise ValueError("Mistral sliding-window attention is not supported")
    num_heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
    attention_bias = bool(getattr(hf_config, "attention_bias", False))
    generation_eos = None
    if model_dir is not None:
        gen = Path(model_dir) / "generation_config.json"
        if gen.exists():
            generation_eos = json.loads(gen.read_text()).get("eos_token_id")
    return ModelConfig(
        architecture=arch,
        vocab_size=hf_config.vocab_size,
        hidden_size=hf_config.hidden_size,
        intermediate_size=hf_config.intermediate_size,
        num_layers=hf_config.num_hidden_layers,
        num_heads=num_heads,
        num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or num_heads,
        head_dim=head_dim,
        rms_norm_eps=hf_config.rms_norm_eps,
        tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
        qkv_bias=True if arch == "Qwen2ForCausalLM" else attention_bias,
        o_bias=False if arch == "Qwen2ForCausalLM" else attention_bias,
        mlp_bias=bool(getattr(hf_config, "mlp_bias", False)),
        max_position_embeddings=hf_config.max_position_embeddings,
        eos_token_ids=_eos_ids(generation_eos, getattr(hf_config, "eos_token_id", None)),
    )
