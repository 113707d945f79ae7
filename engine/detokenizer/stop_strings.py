"""Stop strings, matched in the detokenizer on the text as it is produced, across token boundaries.

Why here: only the detokenizer has the text. A match is trimmed (the stop string and anything after
it never reach the caller) and the scheduler is told to stop the request. Text that could be the
start of a stop string is held back until the next tokens say whether it is one, so streamed text
never shows a stop string that is later cut.
"""

from __future__ import annotations


class StopMatcher:
    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = stops
        self.keep = max(len(s) for s in stops) - 1  # released characters a match could still start in
        self.tail = ""  # the last `keep` characters released
        self.pending = ""  # held back: a suffix that is the start of some stop string

    def feed(self, delta: str, final: bool) -> tuple[str, str | None]:
        """New text in; (text to release, the stop string matched or None) out."""
        buf = self.pending + delta
        search = self.tail + buf
        best: tuple[int, str] | None = None
        for stop in self.stops:
            at = search.find(stop)
            if at != -1 and (best is None or at < best[0]):
                best = (at, stop)
        if best is not None:
            self.pending = ""
            return buf[: max(best[0] - len(self.tail), 0)], best[1]
        hold = 0 if final else self._held(buf)
        release, self.pending = buf[: len(buf) - hold], buf[len(buf) - hold :]
        if self.keep:
            self.tail = (self.tail + release)[-self.keep :]
        return release, None

    def release(self, delta: str) -> str:
        """Before min_new_tokens: nothing matches, but what could start a stop string is still held
        back, so a stop string that starts before the boundary and ends after it matches whole."""
        buf = self.pending + delta
        hold = self._held(buf)
        release, self.pending = buf[: len(buf) - hold], buf[len(buf) - hold :]
        if self.keep:
            tail = (self.tail + release)[-self.keep :]
            for stop in self.stops:  # a stop string passed over here must not match later
                at = tail.rfind(stop)
                if at != -1:
                    tail = tail[at + len(stop) :]
            self.tail = tail
        return release

    def _held(self, buf: str) -> int:
        """Length of the longest suffix of buf that is a proper prefix of a stop string."""
        hold = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(buf)), hold, -1):
                if buf.endswith(stop[:k]):
                    hold = k
                    break
        return hold
