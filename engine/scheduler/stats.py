"""The scheduler's counters, as the Stats message the user process asks for."""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine import hooks
from engine.hooks import HookError
from engine.ipc.messages import Stats

if TYPE_CHECKING:
    from engine.scheduler.state import SchedulerState


def stats(state: SchedulerState, req_id: str, flushed_tokens: int = 0) -> Stats:
    c = state.counters
    return Stats(
        req_id=req_id,
        max_total_tokens=state.max_total_tokens,
        free_tokens=state.kv.pool.available,
        max_running_requests=state.req_to_token.size,
        free_slots=state.req_to_token.available,
        running=len(state.running) + (state.plan.chunked is not None) + len(state.beams.groups),
        waiting=len(state.waiting),
        prefill_steps=c["prefill_steps"],
        decode_steps=c["decode_steps"],
        prompt_tokens=c["prompt_tokens"],
        generated_tokens=c["generated_tokens"],
        finished_requests=c["finished_requests"],
        aborted_requests=c["aborted_requests"],
        stage_seconds=dict(state.busy_seconds),
        prefill_tokens=c["prefill_tokens"],
        chunked_prefill_steps=c["chunked_prefill_steps"],
        cache_hit_tokens=c["cache_hit_tokens"],
        prompt_cache_hit_tokens=c["prompt_cache_hit_tokens"],
        retracted_requests=c["retracted_requests"],
        flushed_tokens=flushed_tokens,
        beam_searches=len(state.beams.groups),
        beam_kv_tokens=state.beams.kv_tokens,
        beam_kv_peak_tokens=state.beams.kv_peak_tokens,
        grammar_compile_seconds=list(state.grammars.compile_seconds),
        grammar_mask_seconds=state.grammars.mask_seconds,
        grammar_mask_steps=state.grammars.mask_steps,
        plugins={"scheduler": _plugin_stats("scheduler")} if hooks.has("engine_stats") else {},
        tracked={"scheduler": tracked(state)},
        **state.kv.stats(),
    )


def tracked(state: SchedulerState) -> dict[str, int]:
    """The scheduler's per-request structures and their sizes: every one is 0 when nothing runs (the
    stress suite asserts it after every crowd)."""
    return {
        "waiting": len(state.waiting),
        "running": len(state.running),
        "chunked": int(state.plan.chunked is not None),
        "planned": len(state.plan.planned),
        "beam_groups": len(state.beams.groups),
        "beam_kv_tokens": state.beams.kv_tokens,
        "slots_in_use": state.req_to_token.size - state.req_to_token.available,
        "cache_lock_refs": state.kv.stats().get("cache_lock_refs", 0),
    }


def _plugin_stats(role: str) -> dict:
    try:
        return hooks.call_named("engine_stats", role=role)
    except HookError as exc:
        return {"error": str(exc)}
