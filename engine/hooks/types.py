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
    tokenize_start_ns: int = 0  # wall-clock ns around the tokenize stage (for spans)
    tokenize_end_ns: int = 0
    model: str = (
        ""  # the name of the model of the engine it goes to (a process may run several engines)
    )


@dataclass
class StepRecord:
    """One scheduler step, after it ran, for engine_step_end. Times are wall-clock nanoseconds
    (time.time_ns), so they line up with the other processes' and with OpenTelemetry's."""

    mode: str  # "prefill" or "decode"
    reqs: list  # the Req objects the step served (prefill: every request in it, chunks included)
    tokens: int  # tokens the forward pass computed
    schedule_start_ns: int
    forward_start_ns: int
    sample_start_ns: int | None  # None: the step failed before sampling
    results_start_ns: int | None
    end_ns: int
    error: str | None = None  # the step raised: its requests were aborted with this message
