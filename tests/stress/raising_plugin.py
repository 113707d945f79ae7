"""A plugin that raises in the one hook named by the file ENGINE_RAISE_CONTROL points at (read when the
hook runs, so a test can move the fault from hook to hook on a running engine); otherwise it does
nothing. It also provides logit processors that misbehave: nan_logits, wrong_shape, not_a_tensor.
Used by tests/stress/test_faults.py."""

from __future__ import annotations

import os

import torch

from engine.hooks import hookimpl
from engine.sampling.processors import CustomLogitProcessor


def _maybe_raise(hook: str) -> None:
    path = os.environ.get("ENGINE_RAISE_CONTROL")
    if not path:
        return
    try:
        with open(path) as f:
            target = f.read().strip()
    except OSError:
        return
    if target == hook:
        raise RuntimeError(f"{hook} raised on purpose")


@hookimpl
def engine_tokenize_before():
    _maybe_raise("engine_tokenize_before")


@hookimpl
def engine_tokenize_after():
    _maybe_raise("engine_tokenize_after")


@hookimpl
def engine_request_submitted():
    _maybe_raise("engine_request_submitted")


@hookimpl
def engine_request_done():
    _maybe_raise("engine_request_done")


@hookimpl
def engine_schedule():
    _maybe_raise("engine_schedule")


@hookimpl
def engine_request_admitted():
    _maybe_raise("engine_request_admitted")


@hookimpl
def engine_request_finished():
    _maybe_raise("engine_request_finished")


@hookimpl
def engine_forward_before():
    _maybe_raise("engine_forward_before")


@hookimpl
def engine_forward_after():
    _maybe_raise("engine_forward_after")


@hookimpl
def engine_process_logits():
    _maybe_raise("engine_process_logits")


@hookimpl
def engine_beam_step():
    _maybe_raise("engine_beam_step")


@hookimpl
def engine_sample_after():
    _maybe_raise("engine_sample_after")


@hookimpl
def engine_step_end():
    _maybe_raise("engine_step_end")


@hookimpl
def engine_detokenize():
    _maybe_raise("engine_detokenize")


@hookimpl
def engine_detokenize_after():
    _maybe_raise("engine_detokenize_after")


@hookimpl
def engine_detokenize_output():
    _maybe_raise("engine_detokenize_output")


@hookimpl
def engine_output():
    _maybe_raise("engine_output")


@hookimpl
def engine_stats():
    _maybe_raise("engine_stats")


class NanLogits(CustomLogitProcessor):
    """Every logit NaN: what a broken model or an overflow would give."""

    def __call__(self, logits, batch):
        return torch.full_like(logits, float("nan"))


class WrongShape(CustomLogitProcessor):
    def __call__(self, logits, batch):
        return logits[:, :-1]


class NotATensor(CustomLogitProcessor):
    def __call__(self, logits, batch):
        return None


@hookimpl
def engine_logit_processors():
    return {"nan_logits": NanLogits, "wrong_shape": WrongShape, "not_a_tensor": NotATensor}
