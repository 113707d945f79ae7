"""What the user process checks of a call's inputs before anything is queued (logprob options, text that
UTF-8 cannot encode), and of the text messages it receives (lists of unequal length)."""

from __future__ import annotations

from engine.ipc.messages import BatchTextOut

MAX_TOP_LOGPROBS = 100


def _check_logprob_options(return_logprob, top_logprobs_num, logprob_start_len, vocab_size: int) -> None:
    if not isinstance(return_logprob, bool):
        raise ValueError(f"return_logprob must be a bool, got {return_logprob!r}")
    if isinstance(top_logprobs_num, bool) or not isinstance(top_logprobs_num, int) or not 0 <= top_logprobs_num <= min(MAX_TOP_LOGPROBS, vocab_size):
        raise ValueError(f"top_logprobs_num must be an integer in [0, {MAX_TOP_LOGPROBS}], got {top_logprobs_num!r}")
    if isinstance(logprob_start_len, bool) or not isinstance(logprob_start_len, int) or logprob_start_len < -1:
        raise ValueError(f"logprob_start_len must be -1 (no prompt logprobs) or a prompt position >= 0, got {logprob_start_len!r}")
    if not return_logprob and (top_logprobs_num or logprob_start_len != -1):
        raise ValueError("top_logprobs_num and logprob_start_len need return_logprob=True")


def _check_unique_rids(rids: list[str]) -> None:
    """ValueError naming the ids a call would use twice once n > 1 expands them (rid ["x", "x-0"], the
    first with n=2): the user process keeps one state per id, so the other request's caller waited forever."""
    seen: set[str] = set()
    twice = sorted({r for r in rids if r in seen or seen.add(r)})
    if twice:
        raise ValueError(f"request id(s) {twice} occur more than once in this call (a prompt with n > 1 uses "
                         "ids <rid>-0 .. <rid>-<n-1>): choose rids that stay distinct")  # fmt: skip


def _unicode(text: str, where: str) -> str:
    """text itself, or a ValueError naming where it holds what UTF-8 cannot encode (a lone surrogate such
    as "\\ud800", which json.loads and surrogateescape decoding both produce): the tokenizer raised a
    TypeError that named nothing."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"{where} is not valid Unicode text: a lone surrogate {text[exc.start]!r} at character "
                         f"{exc.start} (it cannot be encoded as UTF-8)") from None  # fmt: skip
    return text


def _unicode_messages(messages: list, where: str) -> list:
    """Every string in the messages, content given as a list of parts included, checked by _unicode."""

    def walk(value, at: str) -> None:
        if isinstance(value, str):
            _unicode(value, at)
        elif isinstance(value, dict):
            for key, item in value.items():
                walk(item, f"{at}[{key!r}]")
        elif isinstance(value, list):
            for k, item in enumerate(value):
                walk(item, f"{at}[{k}]")

    for j, m in enumerate(messages):
        walk(m, f"{where}[{j}]")
    return messages


def _malformed(message) -> str | None:
    """Why a well-typed text message is one the detokenizer could not have sent (lists of unequal
    length, which zip would silently cut), or None."""
    if isinstance(message, BatchTextOut):
        n = len(message.rids)
        lengths = [len(message.text_deltas), len(message.token_ids), len(message.finished), len(message.meta)]
        lengths += [len(x) for x in (message.headers, message.logprobs) if x]
        if any(length != n for length in lengths):
            return f"text message with {n} rids but lists of {lengths}"
    return None
