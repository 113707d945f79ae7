"""Parity on tiny random models saved as Hugging Face directories: Qwen2 (q/k/v bias, GQA, untied
embeddings) and Llama with llama3 RoPE scaling and tied embeddings."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from conftest import hf_greedy

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")


def _qwen2_config():
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=49152, hidden_size=64, intermediate_size=160, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=False, initializer_range=0.2,
        eos_token_id=2, bos_token_id=1, rope_theta=10000.0,
    )


def _llama_config():
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, max_position_embeddings=2048, tie_word_embeddings=True, initializer_range=0.2,
        eos_token_id=2, bos_token_id=1,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 256},
    )


@pytest.fixture(scope="module", params=["qwen2", "llama3-rope"])
def tiny(request, tmp_path_factory, model_dir):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = _qwen2_config() if request.param == "qwen2" else _llama_config()
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    if request.param == "qwen2":  # random biases, so the bias path is really exercised
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                torch.nn.init.normal_(proj.bias, std=0.2)
    model.eval()
    folder = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(folder)
    for name in TOKENIZER_FILES:
        if (Path(model_dir) / name).exists():
            shutil.copy(Path(model_dir) / name, folder / name)
    return request.param, str(folder), model


def test_tiny_model_greedy_parity(tiny):
    from engine import Engine

    name, folder, model = tiny
    prompts = [[1, 2000 + 7 * i, 300 + i, 45, 9000 - i, 77] * (1 + i) for i in range(6)]
    expected = [hf_greedy(model, ids, 24) for ids in prompts]
    assert all(len(set(e)) > 5 for e in expected), "the reference degenerated; the comparison would be weak"
    with Engine(model_path=folder, dtype="float32", max_total_tokens=4096) as eng:
        assert eng.server_info["architecture"] == ("Qwen2ForCausalLM" if name == "qwen2" else "LlamaForCausalLM")
        outs = eng.generate(input_ids=prompts, sampling_params={"max_new_tokens": 24, "temperature": 0})
        single = eng.generate(input_ids=prompts[-1], sampling_params={"max_new_tokens": 24, "temperature": 0})
    assert [o["output_ids"] for o in outs] == expected
    assert single["output_ids"] == expected[-1]
