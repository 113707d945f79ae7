"""Custom logit processors: classes registered under a name, selected by requests by that name.

Why names and not code: no code travels over a socket. The user process checks that the name is
registered and that the request's `custom_params` suit it; the scheduler runs the processor on the
batched logits, one row per request that selected it, with each row's params.

A processor is registered through the entry-point group `engine.logit_processors` (name = a class
`module:Class`), or by calling `register_logit_processor` in every process (a plugin does that).

    class BanTokens(CustomLogitProcessor):
        def __call__(self, logits, batch):
            for row, params in enumerate(batch.params):
                logits[row, params["token_ids"]] = float("-inf")
            return logits
"""

from __future__ import annotations

from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the user process validates names and params without importing torch
    import torch

ENTRY_POINT_GROUP = "engine.logit_processors"
_registry: dict[str, type["CustomLogitProcessor"]] = {}


@dataclass
class ProcessorBatch:
    """The rows one processor sees in a step."""

    params: list[dict]  # each row's custom_params
    output_ids: list[list[int]]  # each row's tokens generated so far (read-only)
    out_lens: torch.Tensor  # [R] int64, tokens generated so far
    # each row's beam index when the row is a live beam of a beam search (its rid's rows are beams
    # 0..K-1, output_ids that beam's own tokens), None for an ordinary request's row
    beams: list[int | None] = field(default_factory=list)


class CustomLogitProcessor:
    """Base class. One instance per scheduler, called once per step with all rows that selected it."""

    def validate_params(self, params: dict, vocab_size: int) -> None:
        """Raise ValueError if a request's custom_params are unusable. Runs in the user process, at
        submission; the scheduler trusts what passed."""

    def __call__(self, logits: torch.Tensor, batch: ProcessorBatch) -> torch.Tensor:
        """logits [R, V] float32 -> processed logits (in place or new)."""
        raise NotImplementedError


def register_logit_processor(name: str, cls: type[CustomLogitProcessor]) -> None:
    if not (isinstance(cls, type) and issubclass(cls, CustomLogitProcessor)):
        raise TypeError(f"{cls!r} is not a CustomLogitProcessor subclass")
    _registry[name] = cls


def available_logit_processors() -> list[str]:
    return sorted(set(_registry) | {ep.name for ep in entry_points(group=ENTRY_POINT_GROUP)})


def get_logit_processor(name: str) -> type[CustomLogitProcessor]:
    """The class registered under name; ValueError listing the registered names if there is none."""
    if name in _registry:
        return _registry[name]
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name == name:
            cls = ep.load()
            register_logit_processor(name, cls)
            return cls
    raise ValueError(
        f"custom_logit_processor {name!r} is not registered; available: {available_logit_processors()}"
    )


def _is_token(value: Any, vocab_size: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < vocab_size


class DisallowedTokens(CustomLogitProcessor):
    """Never generate the given tokens. custom_params: {"token_ids": [ids]}."""

    def validate_params(self, params: dict, vocab_size: int) -> None:
        ids = params.get("token_ids")
        if not isinstance(ids, list) or not ids or not all(_is_token(t, vocab_size) for t in ids):
            raise ValueError(
                f"custom_params['token_ids'] must be a non-empty list of token ids in [0, {vocab_size}), got {ids!r}"
            )

    def __call__(self, logits: torch.Tensor, batch: ProcessorBatch) -> torch.Tensor:
        import torch

        rows = [r for r, p in enumerate(batch.params) for _ in p["token_ids"]]
        cols = [t for p in batch.params for t in p["token_ids"]]
        dev = logits.device
        logits[torch.tensor(rows, device=dev), torch.tensor(cols, device=dev)] = float("-inf")
        return logits


class ForceTokenAfter(CustomLogitProcessor):
    """Generate token_id as the (after+1)-th new token, e.g. to close a section after a fixed length.
    custom_params: {"token_id": id, "after": N}."""

    def validate_params(self, params: dict, vocab_size: int) -> None:
        token, after = params.get("token_id"), params.get("after")
        if not _is_token(token, vocab_size):
            raise ValueError(
                f"custom_params['token_id'] must be a token id in [0, {vocab_size}), got {token!r}"
            )
        if not isinstance(after, int) or isinstance(after, bool) or after < 0:
            raise ValueError(f"custom_params['after'] must be an integer >= 0, got {after!r}")

    def __call__(self, logits: torch.Tensor, batch: ProcessorBatch) -> torch.Tensor:
        import torch

        dev = logits.device
        after = torch.tensor([p["after"] for p in batch.params], dtype=torch.int64, device=dev)
        token = torch.tensor([p["token_id"] for p in batch.params], dtype=torch.int64, device=dev)
        force = batch.out_lens == after
        if bool(force.any()):
            rows = force.nonzero().squeeze(1)
            logits[rows] = float("-inf")
            logits[rows, token[rows]] = 0.0
        return logits


class ProcessorSet:
    """The scheduler's instances, one per name, created on first use."""

    def __init__(self) -> None:
        self._instances: dict[str, CustomLogitProcessor] = {}

    def get(self, name: str) -> CustomLogitProcessor:
        proc = self._instances.get(name)
        if proc is None:
            proc = self._instances[name] = get_logit_processor(name)()
        return proc
