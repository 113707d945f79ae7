"""A tiny random Llama whose head_dim (40) is not a multiple of 16, served by one engine that the
issue-13 tests share: a short context, the default attention backend."""

from __future__ import annotations

CONTEXT = 96
HEAD_DIM = 40


def save_tiny_llama(folder, tokenizer_dir: str, head_dim: int = HEAD_DIM) -> None:
    import shutil
    from pathlib import Path

    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from conftest import TOKENIZER_FILES

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=4 * head_dim,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        initializer_range=0.2,
        eos_token_id=2,
        bos_token_id=1,
    )
    model = AutoModelForCausalLM.from_config(
        config, dtype=torch.float32, attn_implementation="sdpa"
    )
    model.save_pretrained(folder)
    for name in TOKENIZER_FILES:
        if (Path(tokenizer_dir) / name).exists():
            shutil.copy(Path(tokenizer_dir) / name, Path(folder) / name)
