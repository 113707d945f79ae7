"""Grammar backends: compile a constraint for the model's vocabulary, and make per-row matchers.

xgrammar is the built-in backend. A plugin provides another one (llguidance, outlines-core) through
the `engine_grammar_backend` hook, returning an object with the same three methods; the scheduler
asks once, when the first constrained request arrives.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch


class Matcher(Protocol):
    """One row's position in its grammar."""

    def accept_token(self, token_id: int) -> bool: ...  # False: the grammar does not allow it

    def is_terminated(self) -> bool: ...  # a stop token was accepted where the grammar is complete

    def fork(self) -> "Matcher": ...  # an independent copy (a beam that continues this one)


class GrammarBackend(Protocol):
    name: str

    def compile(self, kind: str, text: str) -> Any:
        """The compiled grammar (slow: runs off the scheduler's loop, in a worker thread)."""

    def matcher(self, compiled: Any) -> Matcher:
        """A fresh matcher at the grammar's start."""

    def new_bitmask(self, rows: int) -> torch.Tensor:
        """An int32 [rows, ceil(V / 32)] bitmask (bit set: allowed)."""

    def fill_masks(self, matchers: list[Matcher], bitmask: torch.Tensor, rows: list[int]) -> None:
        """Row rows[i] of `bitmask` for matchers[i]."""

    def apply_masks(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
        """Disallowed tokens of logits[rows[i]] to -inf, in place."""


COMPILER_CACHE_BYTES = 256 << 20  # xgrammar's compiled-grammar cache, least recently used evicted


class XGrammarBackend:
    """xgrammar: grammars compiled for the tokenizer's vocabulary (its compiler caches them too),
    masks filled in C++ for all rows at once."""

    name = "xgrammar"

    def __init__(self, tokenizer, vocab_size: int, stop_ids: list[int]) -> None:
        from engine.grammar.constraints import xgrammar

        self._xgr = xgr = xgrammar()
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=stop_ids
        )
        # its own cache of compiled grammars is unbounded by default: a client sending ever new schemas
        # would grow the scheduler without end (engine/grammar/stage.py bounds ours)
        self.compiler = xgr.GrammarCompiler(
            info, max_threads=1, cache_limit_bytes=COMPILER_CACHE_BYTES
        )
        self.vocab_size = vocab_size
        self._batch = xgr.BatchGrammarMatcher(max_threads=1)

    def compile(self, kind: str, text: str) -> Any:
        c = self.compiler
        if kind == "json_schema":
            return c.compile_json_schema(text, any_whitespace=False)
        if kind == "regex":
            return c.compile_regex(text)
        return c.compile_grammar(text)

    def matcher(self, compiled: Any) -> Matcher:
        return self._xgr.GrammarMatcher(compiled)

    def new_bitmask(self, rows: int) -> torch.Tensor:
        return self._xgr.allocate_token_bitmask(rows, self.vocab_size)

    def fill_masks(self, matchers: list[Matcher], bitmask: torch.Tensor, rows: list[int]) -> None:
        self._batch.batch_fill_next_token_bitmask(matchers, bitmask, rows)

    def apply_masks(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
        self._xgr.apply_token_bitmask_inplace(
            logits, bitmask, vocab_size=self.vocab_size, indices=rows
        )
