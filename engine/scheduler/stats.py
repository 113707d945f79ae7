"""The scheduler's counters, as the Stats message the user process asks for."""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine import hooks
from engine.hooks import HookError
from engine.ipc.messages import Stats

if TYPE_CHECKING:
    from engine.scheduler.scheduler import Scheduler


def stats(sched: Scheduler, req_id: str, flushed_tokens: int = 0) -> Stats:
    c = sched.counters
    return Stats(
        req_id=req_id,
        max_total_tokens=sched.max_total_tokens,
        free_tokens=sched.kv_pool.available,
        max_running_requests=sched.req_to_token.size,
        free_slots=sched.req_to_token.available,
        running=len(sched.running) + (sched.chunked_req is not None) + len(sched.beams.groups),
        waiting=len(sched.waiting),
        prefill_steps=c["prefill_steps"],
        decode_steps=c["decode_steps"],
        prompt_tokens=c["prompt_tokens"],
        generated_tokens=c["generated_tokens"],
        finished_requests=c["finished_requests"],
        aborted_requests=c["aborted_requests"],
        stage_seconds=dict(sched.busy_seconds),
        prefill_tokens=c["prefill_tokens"],
        chunked_prefill_steps=c["chunked_prefill_steps"],
        cache_hit_tokens=c["cache_hit_tokens"],
        prompt_cache_hit_tokens=c["prompt_cache_hit_tokens"],
        retracted_requests=c["retracted_requests"],
        flushed_tokens=flushed_tokens,
        beam_searches=len(sched.beams.groups),
        beam_kv_tokens=sched.beams.kv_tokens,
        beam_kv_peak_tokens=sched.beams.kv_peak_tokens,
        grammar_compile_seconds=list(sched.grammars.compile_seconds),
        grammar_mask_seconds=sched.grammars.mask_seconds,
        grammar_mask_steps=sched.grammars.mask_steps,
        plugins={"scheduler": _plugin_stats("scheduler")} if hooks.has("engine_stats") else {},
        tracked={"scheduler": tracked(sched)},
        **sched.kv.stats(),
    )


def tracked(sched: Scheduler) -> dict[str, int]:
    """The scheduler's per-request structures and their sizes: every one is 0 when nothing runs (the
    stress suite asserts it after every crowd)."""
    return {
        "waiting": len(sched.waiting),
        "running": len(sched.running),
        "chunked": int(sched.chunked_req is not None),
        "planned": len(sched._planned),
        "beam_groups": len(sched.beams.groups),
        "beam_kv_tokens": sched.beams.kv_tokens,
        "slots_in_use": sched.req_to_token.size - sched.req_to_token.available,
        "cache_lock_refs": sched.kv.stats().get("cache_lock_refs", 0),
    }


def _plugin_stats(role: str) -> dict:
    try:
        return hooks.call_named("engine_stats", role=role)
    except HookError as exc:
        return {"error": str(exc)}
