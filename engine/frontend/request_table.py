"""The requests this engine runs, by rid, and each n > 1 call's copies under the rid it gave; the lock
that guards them; and, once the engine can serve no more, why."""

from __future__ import annotations

import threading

from engine.errors import EngineDeadError
from engine.frontend.request_state import ReqState


def call_names(states: list[ReqState]) -> list[str]:
    """What a call's requests take while they run: their rids, and each n > 1 prompt's rid."""
    return [s.rid for s in states] + sorted({s.group for s in states if s.group is not None})


class RequestTable:
    def __init__(self) -> None:
        self.states: dict[str, ReqState] = {}
        self.groups: dict[
            str, list[ReqState]
        ] = {}  # rid given for n > 1 -> its copies, while any runs
        self.lock = threading.Lock()
        self.dead: str | None = None
        # rids of calls between their clash check and registration: checked and taken under the
        # lock, so two calls giving one rid at once never both reach the submit hooks
        self._reserved: set[str] = set()

    def reserve(self, names: list[str]) -> None:
        """Take a call's names until it registers (or fails): ValueError if any names something running."""
        with self.lock:
            self._check_clash(names)
            self._reserved.update(names)

    def release(self, names: list[str]) -> None:
        """Give back the names of a call that failed before it registered."""
        with self.lock:
            self._reserved.difference_update(names)

    def _check_clash(self, names: list[str]) -> None:
        """A request's rid, or the rid of an n > 1 call (abort's name for its copies), must name
        nothing running: not a request, not another call's copies."""
        clash = [r for r in names if r in self.states or r in self.groups or r in self._reserved]
        if clash:
            raise ValueError(f"request id(s) already running: {clash}")

    def register(self, states: list[ReqState]) -> None:
        with self.lock:
            # checked under the lock that mark_dead takes: no state is orphaned
            if self.dead is not None:
                raise EngineDeadError(self.dead)  # (the caller then gives up the rids it reserved)
            self._reserved.difference_update(call_names(states))
            for state in states:
                self.states[state.rid] = state
                if state.group is not None:
                    self.groups.setdefault(state.group, []).append(state)

    def unregister(self, states: list[ReqState]) -> None:
        """Forget requests registered but never sent (their callers get the error instead)."""
        with self.lock:
            for state in states:
                if self.states.get(state.rid) is state:
                    del self.states[state.rid]
                if state.group is not None and any(
                    m is state for m in self.groups.get(state.group, ())
                ):
                    self.groups.pop(state.group, None)

    def remove_finished(self, state: ReqState) -> None:
        """Forget a finished request, and its call's name once its last copy ended."""
        states = self.states
        with self.lock:
            states.pop(state.rid, None)
            members = self.groups.get(state.group) if state.group is not None else None
            if (
                members is not None
                and any(m is state for m in members)
                and not any(states.get(m.rid) is m for m in members)
            ):
                # its last copy ended (a copy's rid reused since is not one)
                self.groups.pop(state.group, None)

    def named(self, rids: list[str]) -> list[ReqState]:
        """The running requests these rids name (a rid given for n > 1 names all its copies)."""
        with self.lock:
            return [
                s
                for rid in rids
                for s in [*self.groups.get(rid, ()), self.states.get(rid)]
                if s is not None
            ]

    def live(self, states: list[ReqState]) -> list[ReqState]:
        """Those of these requests still running, each once (not a later request given one's rid)."""
        with self.lock:  # each once (abort(["x", "x-0"]) names copy x-0 twice)
            return list({id(s): s for s in states if self.states.get(s.rid) is s}.values())

    def mark_dead(self, reason: str) -> list[ReqState]:
        """Record why the engine serves no more (the first reason stays); empty the table and return
        what it held, for their callers to be failed."""
        if self.dead is None:
            self.dead = reason
        with self.lock:
            states, self.states, self.groups = list(self.states.values()), {}, {}
        return states
