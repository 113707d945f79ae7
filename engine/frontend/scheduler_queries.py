"""Questions to the scheduler (get_stats, flush_cache): a control message out, and a wait for the Stats
answer that comes back through the detokenizer."""

from __future__ import annotations

import threading
import uuid
from typing import Callable

import msgspec

from engine import hooks
from engine.errors import EngineDeadError
from engine.frontend.request_table import RequestTable
from engine.frontend.scheduler_channel import SchedulerChannel
from engine.ipc.messages import FlushCache, Stats, StatsRequest


class SchedulerQueries:
    def __init__(
        self, table: RequestTable, channel: SchedulerChannel, deferred_aborts: Callable[[], int]
    ) -> None:
        self._table = table  # its lock guards the waiting answers too; its `dead` refuses questions
        self._channel = channel
        self._deferred_aborts = deferred_aborts
        self._pending: dict[str, list] = {}  # req_id -> [answered Event, Stats dict or error]

    def get_stats(self, timeout: float = 30.0) -> dict:
        stats = self._ask(StatsRequest, timeout)
        table = self._table
        with table.lock:  # this request's own holder is gone by now
            stats.setdefault("tracked", {})["user"] = {
                "states": len(table.states),
                "groups": len(table.groups),
                "pending_stats": len(self._pending),
                "deferred_aborts": self._deferred_aborts(),
            }
        if hooks.has("engine_stats"):
            stats["plugins"] = {
                **stats.get("plugins", {}),
                "user": hooks.call_named("engine_stats", role="user"),
            }
        return stats

    def flush_cache(self, timeout: float = 30.0) -> dict:
        return self._ask(FlushCache, timeout)

    def _ask(self, message_cls, timeout: float) -> dict:
        """Send a control message; the scheduler answers with Stats (through the detokenizer)."""
        table = self._table
        if table.dead is not None:
            raise EngineDeadError(table.dead)
        req_id = uuid.uuid4().hex
        holder: list = [threading.Event(), None]
        with table.lock:
            if table.dead is not None:
                raise EngineDeadError(table.dead)
            self._pending[req_id] = holder
        with self._channel.lock:
            if table.dead is not None:
                raise EngineDeadError(table.dead)
            self._channel.send(self._channel.encode(message_cls(req_id)))
        if not holder[0].wait(timeout):
            with table.lock:
                self._pending.pop(req_id, None)
            raise TimeoutError(f"the scheduler did not answer a {message_cls.__name__} message")
        if isinstance(holder[1], BaseException):
            raise holder[1]
        return holder[1]

    def answer(self, message: Stats) -> None:
        """The receiver thread's Stats: wake the question it answers, if still waiting."""
        with self._table.lock:
            holder = self._pending.pop(message.req_id, None)
        if holder is not None:
            holder[1] = msgspec.structs.asdict(message)
            holder[0].set()

    def fail_all(self, reason: str) -> None:
        """Every waiting question gets EngineDeadError(reason)."""
        with self._table.lock:
            stats, self._pending = list(self._pending.values()), {}
        for holder in stats:
            holder[1] = EngineDeadError(reason)
            holder[0].set()
