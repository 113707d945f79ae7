"""The counters of a request a stop string ended: its tokens up to the match, and its hidden states
cut to those tokens (the scheduler may have computed a few more before the stop reached it)."""

from __future__ import annotations

import msgspec

from engine.ipc.messages import RequestMeta
from engine.taps.spec import HiddenStates

FLOAT32 = 4


def stopped_meta(meta: RequestMeta | None, prompt: int, cached: int, tokens: int) -> RequestMeta:
    """`meta`: the scheduler's, or None when the match came before the scheduler's last output."""
    if meta is None:
        return RequestMeta(prompt, tokens, cached)
    hidden = meta.hidden_states
    if hidden is not None and hidden.generated_rows > tokens:
        hidden = cut_generated(hidden, tokens)
    return msgspec.structs.replace(meta, completion_tokens=tokens, hidden_states=hidden)


def cut_generated(hidden: HiddenStates, rows: int) -> HiddenStates:
    """The first `rows` generated rows of each layer ([layers, rows, hidden] float32 bytes)."""
    per_row = hidden.hidden_size * FLOAT32
    old = hidden.generated_rows * per_row
    data = hidden.generated
    kept = b"".join(data[i * old : i * old + rows * per_row] for i in range(len(hidden.layers)))
    return msgspec.structs.replace(hidden, generated=kept, generated_rows=rows)
