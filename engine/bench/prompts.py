"""Deterministic benchmark prompts from real English text that is always available offline.

The corpus is the docstrings of a fixed list of standard-library modules and of their public
classes and functions. It is tokenized once; each prompt is a window of the token ids whose length
and offset come from a seeded random generator, so the same seed and tokenizer give the same prompts.
"""

from __future__ import annotations

import importlib
import inspect
import random

CORPUS_MODULES: tuple[str, ...] = (
    "argparse",
    "asyncio",
    "collections",
    "concurrent.futures",
    "contextlib",
    "csv",
    "dataclasses",
    "datetime",
    "decimal",
    "email.message",
    "functools",
    "http.client",
    "http.server",
    "inspect",
    "itertools",
    "json",
    "logging",
    "multiprocessing",
    "pathlib",
    "pickle",
    "queue",
    "re",
    "shutil",
    "socket",
    "sqlite3",
    "subprocess",
    "tarfile",
    "tempfile",
    "textwrap",
    "threading",
    "typing",
    "unittest",
    "urllib.request",
    "zipfile",
)


# The parity prompts: greedy outputs on them are compared with transformers (tests) and across
# quantizations (engine/bench/quality.py). Even ones are used as plain text, odd ones as chat turns.
PARITY_PROMPTS: tuple[str, ...] = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "def fibonacci(n):",
    "List three colors of the rainbow:",
    "The quick brown fox",
    "Explain why the sky is blue in one sentence.",
    "Translate to French: Good morning, how are you?",
    "Once upon a time, in a small village by the mountains, there lived an old clockmaker who",
)


def build_corpus(modules: tuple[str, ...] = CORPUS_MODULES) -> str:
    """Docstrings of each module and of its public classes and functions, in a fixed order."""
    parts: list[str] = []
    for name in modules:
        module = importlib.import_module(name)
        docs = [inspect.getdoc(module)]
        for attr in sorted(getattr(module, "__all__", None) or dir(module)):
            if attr.startswith("_"):
                continue
            obj = getattr(module, attr, None)
            if (inspect.isclass(obj) or inspect.isfunction(obj)) and getattr(
                obj, "__module__", ""
            ).startswith(name):
                docs.append(inspect.getdoc(obj))
        parts.extend(d.strip() for d in docs if d and len(d.split()) >= 8)  # skip one-liners
    return "\n\n".join(parts)


def build_prompts(
    tokenizer, num_prompts: int, min_len: int = 32, max_len: int = 512, seed: int = 0
) -> list[list[int]]:
    """num_prompts windows of the tokenized corpus, lengths uniform in [min_len, max_len], seeded offsets."""
    if not 1 <= min_len <= max_len:
        raise ValueError(f"need 1 <= min_len <= max_len, got {min_len}, {max_len}")
    ids = tokenizer(build_corpus(), add_special_tokens=False)["input_ids"]
    if len(ids) < max_len:
        raise ValueError(f"corpus has only {len(ids)} tokens, fewer than max_len={max_len}")
    rng = random.Random(seed)
    prompts = []
    for _ in range(num_prompts):
        length = rng.randint(min_len, max_len)
        start = rng.randrange(len(ids) - length + 1)
        prompts.append(list(ids[start : start + length]))
    return prompts
