"""Incremental detokenization for a batch of requests with one batch_decode call per decode setting.

Each request keeps its ids and two offsets. Text is emitted for ids[read:] when decoding the
window ids[prefix:] yields more than decoding ids[prefix:read]; while it ends in U+FFFD (a UTF-8
character whose bytes are still split across tokens), only the complete characters before it, so
each character comes out with the token that completes it (stop strings and min_new_tokens count on
that). The window starts at the previous emission
boundary, not at the beginning, so the cost per step stays small; decoding the already-emitted
tokens with the new ones (rather than the new ones alone) keeps tokenizers that strip or merge
leading spaces honest. Tokens that add no text to text already out (special tokens skipped) are
dropped from the window, which would otherwise widen by each of them. Requests are grouped by their
(skip_special_tokens, spaces_between_special_tokens) setting; the usual batch has one group, so one call.
"""

from __future__ import annotations

from dataclasses import dataclass, field

REPLACEMENT = "\ufffd"


@dataclass
class DecodeState:
    ids: list[int] = field(default_factory=list)
    prefix_offset: int = 0
    read_offset: int = 0
    # characters past the prefix text already emitted while the window ended in U+FFFD
    held_out: int = 0
    flags: tuple[bool, bool] = (True, True)  # skip_special_tokens, spaces_between_special_tokens


class IncrementalDetokenizer:
    def __init__(self, decoder) -> None:
        self.decoder = decoder
        self.states: dict[str, DecodeState] = {}

    def start(
        self, rid: str, skip_special_tokens: bool, spaces_between_special_tokens: bool
    ) -> None:
        """Set a request's decode flags before its first ids (without this: the defaults)."""
        self.states[rid] = DecodeState(flags=(skip_special_tokens, spaces_between_special_tokens))

    def forget(self, rid: str) -> None:
        self.states.pop(rid, None)

    def step(self, rids: list[str], new_ids: list[list[int]], finished: list[bool]) -> list[str]:
        """Append each request's new ids; return each request's new text. Forget finished requests."""
        states = []
        for rid, ids in zip(rids, new_ids):
            state = self.states.get(rid)
            if state is None:
                state = self.states[rid] = DecodeState()
            state.ids.extend(ids)
            states.append(state)
        n = len(states)
        texts: list[str] = [""] * (2 * n)
        groups: dict[tuple[bool, bool], list[int]] = {}
        for i, state in enumerate(states):
            groups.setdefault(state.flags, []).append(i)
        for (skip, spaces), rows in groups.items():
            windows = [states[i].ids[states[i].prefix_offset : states[i].read_offset] for i in rows]
            windows += [states[i].ids[states[i].prefix_offset :] for i in rows]
            decoded = self.decoder.decode_batch(windows, skip, spaces)
            for j, i in enumerate(rows):
                texts[i], texts[n + i] = decoded[j], decoded[len(rows) + j]
        deltas = []
        for i, state in enumerate(states):
            prefix_text, full_text = texts[i], texts[n + i]
            start = len(prefix_text) + state.held_out
            if len(full_text) > len(prefix_text) and not full_text.endswith(REPLACEMENT):
                deltas.append(full_text[start:])
                state.prefix_offset = state.read_offset
                state.read_offset = len(state.ids)
                state.held_out = 0
            elif (
                full_text == prefix_text
                and state.read_offset > state.prefix_offset
                and not finished[i]
            ):
                # tokens that add no text (skipped specials) after text: out of the window, or a run of them
                # is decoded again every step (not before any text: a sentencepiece decoder strips the
                # window's first space, so a lone "▁" there adds nothing yet counts before a "▁word")
                deltas.append("")
                del state.ids[state.read_offset :]
            elif finished[i]:
                deltas.append(full_text[start:])  # flush what is left, even a broken tail
            else:  # the complete characters before a split one
                complete = len(full_text.rstrip(REPLACEMENT))
                deltas.append(full_text[start:complete])
                state.held_out = max(complete - len(prefix_text), state.held_out)
            if finished[i]:
                del self.states[rids[i]]
        return deltas
