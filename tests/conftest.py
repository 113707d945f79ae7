"""Shared fixtures: one float32 engine on the embedded SmolLM2 for the whole session, and its HF reference."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "def fibonacci(n):",
    "List three colors of the rainbow:",
    "The quick brown fox",
    "Explain why the sky is blue in one sentence.",
    "Translate to French: Good morning, how are you?",
    "Once upon a time, in a small village by the mountains, there lived an old clockmaker who",
]


@pytest.fixture(scope="session")
def engine():
    from engine import Engine

    eng = Engine(dtype="float32", max_total_tokens=16384)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="session")
def model_dir(engine) -> str:
    return engine.model_dir


@pytest.fixture(scope="session")
def tokenizer(engine):
    return engine.tokenizer


@pytest.fixture(scope="session")
def hf_model(model_dir):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    model.eval()
    return model


def hf_greedy(model, ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers' own greedy generate for one prompt, no padding."""
    import torch

    with torch.inference_mode():
        out = model.generate(
            torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=model.generation_config.eos_token_id,
        )
    return out[0, len(ids):].tolist()
