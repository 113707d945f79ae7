"""Stop strings, matched in the detokenizer on the text as it is produced, across token boundaries.

Why here: only the detokenizer has the text. A match is trimmed (the stop string and anything after
it never reach the caller) and the scheduler is told to stop the request. Text that could be the
start of a stop string is held back until the next tokens say whether it is one, so streamed text
never shows a stop string that is later cut.

The rule, independent of how the text is split into tokens: the match is the stop string occurrence
that ends first (the longest one when several end at the same place), counting only occurrences that
end after the text of the first min_new_tokens - 1 tokens. The text before it is the output. Held
text always reaches the caller when the request ends without a match.
"""

from __future__ import annotations


class StopMatcher:
    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = stops
        self.pending = ""  # held back: a suffix that is the start of some stop string
        # leading characters of pending from before min_new_tokens: no match may end in them
        self.early = 0

    def feed(self, delta: str, final: bool) -> tuple[str, str | None]:
        """New text in; (text to release, the stop string matched or None) out. `final`: the request
        ends with this text, so nothing is held back."""
        buf = self.pending + delta
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        for stop in self.stops:
            # the first one ending after `early`
            at = buf.find(stop, max(self.early - len(stop) + 1, 0))
            if at != -1:
                candidate = (at + len(stop), at, stop)
                if best is None or candidate < best:
                    best = candidate
        if best is not None:
            self.pending, self.early = "", 0
            return buf[: best[1]], best[2]
        release = self._hold(buf, final)
        self.early = max(self.early - len(release), 0)
        return release, None

    def release(self, delta: str, final: bool = False) -> str:
        """Before min_new_tokens: nothing matches, but what could start a stop string is still held
        back, so a stop string that starts before the boundary and ends after it matches whole."""
        release = self._hold(self.pending + delta, final)
        self.early = len(self.pending)
        return release

    def _hold(self, buf: str, final: bool) -> str:
        """Keep the longest suffix of buf that is a proper prefix of a stop string (none if final)."""
        hold = 0
        if not final:
            for stop in self.stops:
                for k in range(min(len(stop) - 1, len(buf)), hold, -1):
                    if buf.endswith(stop[:k]):
                        hold = k
                        break
        self.pending = buf[len(buf) - hold :]
        return buf[: len(buf) - hold]
