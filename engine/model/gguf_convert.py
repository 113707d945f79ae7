"""A llama GGUF with a byte-level BPE vocabulary (the embedded SmolLM2's kind) to a Hugging Face directory:
for the embedded file, the same files byte for byte as transformers' `from_pretrained(gguf_file=...)`
(tests/test_gguf_conversion.py), several times faster (docs/performance.md).

Why: transformers builds a config for this architecture with gguf's GGUFReader, which turns every
metadata value into numpy views (seconds for a 49,152-token vocabulary and its merges), and
it does so three times in one conversion (the tokenizer's config, the model's config, the weights), then
builds gguf's tensor-name map once per parameter. Here the metadata comes from transformers' own fast
reader, the config from its own GGUF tables, the tokenizer from its own GGUF converter, the weights from
gguf's own `dequantize` and transformers' own llama q/k un-permutation, reading the tensor data once.
Anything else (another architecture or vocabulary, a tensor this table does not name, a tokenizer_config
beside the file, duplicate tensor names) returns False, and the caller converts through transformers.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# GGUF tensor name -> Hugging Face name, per layer ("{i}") and for the model
LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
MODEL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def hf_name(gguf_name: str, layers: int) -> str | None:
    """The Hugging Face parameter a GGUF tensor is, or None for a tensor this table does not know."""
    if gguf_name in MODEL_NAMES:
        return MODEL_NAMES[gguf_name]
    block, _, rest = gguf_name.partition(".")
    index, _, part = rest.partition(".")
    if block != "blk" or not index.isdigit() or int(index) >= layers or part not in LAYER_NAMES:
        return None
    return f"model.layers.{int(index)}.{LAYER_NAMES[part]}"


def config_dict(metadata: dict[str, Any], tensor_names: tuple[str, ...]) -> dict[str, Any]:
    """transformers' load_gguf_checkpoint config for a llama file: its defaults, its key table, tied
    embeddings where there is no output.weight, the vocabulary's size where the file does not say."""
    from transformers.integrations.ggml import GGUF_CONFIG_DEFAULTS_MAPPING, GGUF_CONFIG_MAPPING

    config: dict[str, Any] = {"tie_word_embeddings": "output.weight" not in tensor_names}
    for key, value in GGUF_CONFIG_DEFAULTS_MAPPING.get("llama", {}).items():
        config.setdefault(key, value)
    for key, value in metadata.items():
        prefix, _, rest = key.partition(".")
        renamed = GGUF_CONFIG_MAPPING.get(prefix, {}).get(rest)
        if renamed is not None and renamed != -1:
            config[renamed] = value
    if "vocab_size" not in config:
        config["vocab_size"] = len(metadata["tokenizer.ggml.tokens"])
    return config


def state_dict(gguf: Path, config: dict[str, Any]):
    """name -> float32 tensor, every tensor of the file dequantized by gguf's own code; None where a
    tensor is not one of a llama's or its type is not one gguf's reader takes."""
    import numpy as np
    import torch
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, dequantize
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    from engine.model.gguf_file import read_index

    # its q/k row order
    layers, processor = (
        config["num_hidden_layers"],
        LlamaTensorProcessor(config=config),
    )
    plain = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16}
    blob = np.memmap(gguf, dtype=np.uint8, mode="r")
    out = {}
    for tensor in read_index(gguf).values():
        name = hf_name(tensor.name, layers)
        try:
            kind = GGMLQuantizationType(tensor.kind)
        except ValueError:
            return None
        if name is None or kind not in GGML_QUANT_SIZES:
            return None
        shape = tuple(reversed(tensor.dims))
        block, size = GGML_QUANT_SIZES[kind]
        count = int(np.prod(shape))
        nbytes = count // block * size
        raw = blob[tensor.offset : tensor.offset + nbytes]
        if raw.size != nbytes or shape[-1] % block:
            return None
        if kind in plain:
            weights = raw.view(plain[kind]).reshape(shape)
        else:
            weights = raw.reshape(*shape[:-1], shape[-1] // block * size)
        weights = processor.process(weights=dequantize(weights, kind), name=tensor.name).weights
        out[name] = torch.from_numpy(np.array(weights, dtype=np.float32, copy=True))
    return out


def convert_llama_gguf(gguf: Path, out: Path) -> bool:
    """Write config.json, generation_config.json, model.safetensors and the tokenizer's files for gguf into
    out. False, having written nothing that matters, where this file is not one converted here."""
    try:
        from transformers.integrations.gguf import read_gguf_metadata
    except ImportError:
        return False
    metadata, tensor_names = read_gguf_metadata(
        str(gguf), ("tokenizer.ggml.tokens", "tokenizer.ggml.merges")
    )
    if (
        metadata.get("general.architecture") != "llama"
        or metadata.get("tokenizer.ggml.model") != "gpt2"
    ):
        return False
    if "mistral" in str(metadata.get("general.name", "")).lower():
        return (
            False  # transformers may take a llama file named so for a Mistral: its call, not ours
        )
    if (gguf.parent / "tokenizer_config.json").exists() or len(set(tensor_names)) != len(
        tensor_names
    ):
        return False  # AutoTokenizer would read that file for its class; gguf's reader refuses duplicates
    from safetensors.torch import save_file
    from transformers import GenerationConfig, LlamaConfig
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    values = config_dict(metadata, tensor_names)
    # as AutoConfig.from_pretrained(folder, gguf_file=...) makes it
    config = LlamaConfig.from_dict(values)
    config._name_or_path = str(gguf.parent)  # as from_pretrained(folder, gguf_file=...) records it
    expected = {hf_name(n, config.num_hidden_layers) for n in tensor_names}
    params = {
        f"model.layers.{i}.{p}"
        for i in range(config.num_hidden_layers)
        for p in LAYER_NAMES.values()
    }
    params |= {"model.embed_tokens.weight", "model.norm.weight"}
    if expected != params | (set() if config.tie_word_embeddings else {"lm_head.weight"}):
        return False  # biases, extra or missing tensors: transformers knows what to do with them
    tensors = state_dict(gguf, values)
    if tensors is None:
        return False
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))
    saved = config.to_dict()
    saved.pop("quantization_config", None)
    saved["dtype"] = "float32"
    saved["architectures"] = ["LlamaForCausalLM"]
    (out / "config.json").write_text(json.dumps(saved, indent=2))
    GenerationConfig.from_model_config(config).save_pretrained(str(out))
    TokenizersBackend.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(
        str(out)
    )
    return True
