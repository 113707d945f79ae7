"""Tokenizer loading for the user process (full Hugging Face tokenizer: chat templates) and a light
batch decoder for the detokenizer (the Rust `tokenizers` library alone, no torch import)."""

from __future__ import annotations

import os
from pathlib import Path


def load_hf_tokenizer(model_dir: str):
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


class BatchDecoder:
    """decode_batch(list of id lists) -> list of str, one call for the whole batch."""

    def __init__(self, model_dir: str) -> None:
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        path = Path(model_dir) / "tokenizer.json"
        if path.exists():
            from tokenizers import Tokenizer

            self._fast = Tokenizer.from_file(str(path))
            self._hf = None
        else:
            self._fast = None
            self._hf = load_hf_tokenizer(model_dir)

    def decode_batch(
        self, sequences: list[list[int]], skip_special_tokens: bool = True, spaces_between_special_tokens: bool = True
    ) -> list[str]:
        """spaces_between_special_tokens matters only to slow (Python) tokenizers, as in transformers."""
        if self._fast is not None:
            return self._fast.decode_batch(sequences, skip_special_tokens=skip_special_tokens)
        return self._hf.batch_decode(
            sequences, skip_special_tokens=skip_special_tokens, spaces_between_special_tokens=spaces_between_special_tokens
        )
