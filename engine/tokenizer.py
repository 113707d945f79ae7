"""Tokenizers for the user process and the detokenizer, light where they can be.

transformers' AutoTokenizer imports torch, which would be most of Engine()'s start-up. The user
process encodes text with the Rust `tokenizers` library alone (PromptTokenizer) and loads
transformers' tokenizer only when something needs it: a chat template (rendered exactly as
transformers renders it), or `engine.tokenizer`. The detokenizer decodes with `tokenizers` alone
(BatchDecoder).
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path


def load_hf_tokenizer(model_dir: str):
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


# Tokenizer classes whose transformers form encodes exactly as tokenizer.json does. Others (Llama,
# Qwen2, ...) rebuild the tokenizer from vocab and merges in their own __init__, with options.
PLAIN_TOKENIZER_CLASSES = (
    "TokenizersBackend",
    "PreTrainedTokenizerFast",
    "GPT2Tokenizer",
    "GPT2TokenizerFast",
)


class PromptTokenizer:
    """encode(text) from tokenizer.json; transformers' tokenizer (`hf`) loaded on first need.

    Falls back to transformers for encoding too where tokenizer.json alone may not say everything:
    no tokenizer.json (a slow tokenizer), a tokenizer class outside PLAIN_TOKENIZER_CLASSES, or
    tokenizer_config.json setting add_bos_token, add_eos_token, add_prefix_space or legacy."""

    def __init__(self, model_dir: str) -> None:
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        self.model_dir = model_dir
        self._hf = None
        self._lock = threading.Lock()
        folder = Path(model_dir)
        config_path = folder / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.exists() else {}
        self._fast = None
        if (
            (folder / "tokenizer.json").exists()
            and config.get("tokenizer_class") in PLAIN_TOKENIZER_CLASSES
            and not ({"add_bos_token", "add_eos_token", "add_prefix_space", "legacy"} & set(config))
        ):
            from tokenizers import Tokenizer

            self._fast = Tokenizer.from_file(str(folder / "tokenizer.json"))

    @property
    def hf(self):
        """transformers' tokenizer for this model, loaded once, on first use (thread-safe)."""
        with self._lock:
            if self._hf is None:
                self._hf = load_hf_tokenizer(self.model_dir)
            return self._hf

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self._fast is None:
            return self.hf.encode(text, add_special_tokens=add_special_tokens)
        # encode_batch lets go of the GIL while it works (encode holds it, stalling every other
        # thread, an async caller's event loop included, on a long text); same ids
        return self._fast.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def __len__(self) -> int:
        if self._fast is None:
            return len(self.hf)
        return self._fast.get_vocab_size(with_added_tokens=True)

    @property
    def chat_template(self):
        return getattr(self.hf, "chat_template", None)

    def apply_chat_template(self, *args, **kwargs):
        return self.hf.apply_chat_template(*args, **kwargs)


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
        self,
        sequences: list[list[int]],
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> list[str]:
        """spaces_between_special_tokens matters only to slow (Python) tokenizers, as in transformers."""
        if self._fast is not None:
            return self._fast.decode_batch(sequences, skip_special_tokens=skip_special_tokens)
        return self._hf.batch_decode(
            sequences,
            skip_special_tokens=skip_special_tokens,
            spaces_between_special_tokens=spaces_between_special_tokens,
        )
