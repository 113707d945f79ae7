"""Objects handed to hooks that may change them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class PromptRequest:
    """One prompt of a generate call, in the tokenize hooks. Exactly one of prompt, messages and
    input_ids is set before tokenization; input_ids is set after it."""

    index: int
    prompt: str | None = None
    messages: list[dict] | None = None
    input_ids: list[int] | None = None
