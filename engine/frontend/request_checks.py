"""What the user process checks of a call's inputs before anything is queued (logprob options, text that
UTF-8 cannot encode), and of the text messages it receives (lists of unequal length)."""

from __future__ import annotations

from typing import Any

from engine.ipc.messages import BatchTextOut, BeamParams
from engine.sampling_params import MAX_N, SamplingParams

MAX_TOP_LOGPROBS = 100


def check_logprob_options(
    return_logprob, top_logprobs_num, logprob_start_len, vocab_size: int
) -> None:
    if not isinstance(return_logprob, bool):
        raise ValueError(f"return_logprob must be a bool, got {return_logprob!r}")
    if (
        isinstance(top_logprobs_num, bool)
        or not isinstance(top_logprobs_num, int)
        or not 0 <= top_logprobs_num <= min(MAX_TOP_LOGPROBS, vocab_size)
    ):
        raise ValueError(
            f"top_logprobs_num must be an integer in [0, {MAX_TOP_LOGPROBS}], got {top_logprobs_num!r}"
        )
    if (
        isinstance(logprob_start_len, bool)
        or not isinstance(logprob_start_len, int)
        or logprob_start_len < -1
    ):
        raise ValueError(
            f"logprob_start_len must be -1 (no prompt logprobs) or a prompt position >= 0, got {logprob_start_len!r}"
        )
    if not return_logprob and (top_logprobs_num or logprob_start_len != -1):
        raise ValueError("top_logprobs_num and logprob_start_len need return_logprob=True")


def check_unique_rids(rids: list[str]) -> None:
    """ValueError naming the ids a call would use twice once n > 1 expands them (rid ["x", "x-0"], the
    first with n=2): the user process keeps one state per id, so the other request's caller waited forever."""
    seen: set[str] = set()
    twice = sorted({r for r in rids if r in seen or seen.add(r)})
    if twice:
        raise ValueError(
            f"request id(s) {twice} occur more than once in this call (a prompt with n > 1 uses "
            "ids <rid>-0 .. <rid>-<n-1>): choose rids that stay distinct"
        )


def _prompt_count(prompt: Any, input_ids: Any, messages: Any) -> tuple[str, int]:
    """(the input's name, how many prompts it holds), read from its shape alone; a shape the tokenize
    stage refuses counts as one."""
    if prompt is not None:
        return "prompt", len(prompt) if isinstance(prompt, list) else 1
    name, value = ("input_ids", input_ids) if input_ids is not None else ("messages", messages)
    return name, len(value) if isinstance(value, list) and value and isinstance(
        value[0], list
    ) else 1


def _n(params: Any) -> int:
    """A request's n as given; a value parse_sampling_params refuses (naming n) counts as one."""
    n = (
        params.n
        if isinstance(params, SamplingParams)
        else params.get("n", 1)
        if isinstance(params, dict)
        else 1
    )
    return n if isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= MAX_N else 1


def check_call_size(
    limit: int,
    prompt: Any,
    input_ids: Any,
    messages: Any,
    sampling_params: Any,
    beam: BeamParams | None,
) -> None:
    """ValueError when one call would create more than `limit` sequences: prompts x n, a list of
    sampling_params each entry's n, a beam search beam_width per prompt. Read from the inputs' shapes
    before anything is tokenized or built, since a small body can ask for a huge number of requests."""
    name, prompts = _prompt_count(prompt, input_ids, messages)
    each = f" for each of {prompts:,} prompts" if prompts > 1 else ""
    if beam is not None:
        width = beam.width if isinstance(beam.width, int) and beam.width >= 1 else 1
        total, what = prompts * width, f"beam_width={width}{each} makes"
    elif isinstance(sampling_params, list):
        total = sum(_n(p) for p in sampling_params[:prompts]) + max(
            prompts - len(sampling_params), 0
        )
        what = f"sampling_params: the n of the {prompts:,} prompts add up to"
    elif _n(sampling_params) > 1:
        n = _n(sampling_params)
        total, what = prompts * n, f"n={n}{each} makes"
    else:
        total, what = prompts, f"{name}: {prompts:,} prompts make"
    if total > limit:
        raise ValueError(
            f"{what} {total:,} sequences, more than max_sequences_per_call={limit:,} allows in one "
            "call: split it into smaller calls (or start the engine with a larger max_sequences_per_call)"
        )


def unicode_text(text: str, where: str) -> str:
    """text itself, or a ValueError naming where it holds what UTF-8 cannot encode (a lone surrogate such
    as "\\ud800", which json.loads and surrogateescape decoding both produce): the tokenizer raised a
    TypeError that named nothing."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"{where} is not valid Unicode text: a lone surrogate {text[exc.start]!r} at character "
            f"{exc.start} (it cannot be encoded as UTF-8)"
        ) from None
    return text


def unicode_messages(messages: list, where: str) -> list:
    """Every string in the messages, content given as a list of parts included, checked by unicode_text."""

    def walk(value, at: str) -> None:
        if isinstance(value, str):
            unicode_text(value, at)
        elif isinstance(value, dict):
            for key, item in value.items():
                walk(item, f"{at}[{key!r}]")
        elif isinstance(value, list):
            for k, item in enumerate(value):
                walk(item, f"{at}[{k}]")

    for j, m in enumerate(messages):
        walk(m, f"{where}[{j}]")
    return messages


def malformed_text_message(message) -> str | None:
    """Why a well-typed text message is one the detokenizer could not have sent (lists of unequal
    length, which zip would silently cut), or None."""
    if isinstance(message, BatchTextOut):
        n = len(message.rids)
        lengths = [
            len(message.text_deltas),
            len(message.token_ids),
            len(message.finished),
            len(message.meta),
        ]
        lengths += [len(x) for x in (message.headers, message.logprobs) if x]
        if any(length != n for length in lengths):
            return f"text message with {n} rids but lists of {lengths}"
    return None
