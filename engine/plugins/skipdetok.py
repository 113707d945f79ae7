"""skipdetok: the detokenizer does not decode. Callers get `output_ids` and empty text.

For workloads whose text nobody reads: a user-side beam search scores candidates by their ids and
logprobs. Stop strings cannot match (there is no text); stop tokens and lengths still end requests.

    ENGINE_PLUGINS=skipdetok python run.py
"""

from __future__ import annotations

from engine.hooks import hookimpl


@hookimpl
def engine_detokenize(rids: list, token_ids: list, finished: list) -> list:
    return [""] * len(rids)
