"""stagetimer: wall time per stage in each of the three processes, and summed across them.

Stages, each timed between its hooks: tokenize (user process, per prompt), forward and sample
(scheduler, per step), detokenize (detokenizer, per step). Read the figures with

    engine.get_stats()["plugins"]          # {"user": {"stagetimer": {...}}, "scheduler": {...}, ...}
    engine.plugins.stagetimer.summary(engine.get_stats())   # {"per_process": ..., "total": ...}

and a table is printed to stderr when the engine shuts down. The figures are per process: engines
started one after another, or side by side, in one process add to the same user-process figures.
"""

from __future__ import annotations

import sys
import threading
import time
from collections import defaultdict

from engine.hooks import hookimpl

_seconds: dict[str, float] = defaultdict(float)
_calls: dict[str, int] = defaultdict(int)
_lock = threading.Lock()  # the sums: callers in several threads (generate from threads) add at once
_local = threading.local()  # each thread's open timers: two threads tokenizing must not share one


def _open() -> dict[str, float]:
    try:
        return _local.open
    except AttributeError:
        _local.open = {}
        return _local.open


def _start(stage: str) -> None:
    _open()[stage] = time.perf_counter()


def _stop(stage: str) -> None:
    t0 = _open().pop(stage, None)
    if t0 is not None:
        elapsed = time.perf_counter() - t0
        with _lock:
            _seconds[stage] += elapsed
            _calls[stage] += 1


@hookimpl
def engine_tokenize_before(request) -> None:
    _start("tokenize")


@hookimpl
def engine_tokenize_after(request) -> None:
    _stop("tokenize")


@hookimpl
def engine_forward_before(batch, rids) -> None:
    _start("forward")


@hookimpl
def engine_forward_after(batch, rids, logits) -> None:
    _stop("forward")
    # a prompt chunk that is not the last samples nothing
    if logits is not None and logits.shape[0]:
        _start("sample")


@hookimpl
def engine_sample_after(rids, next_ids, logprobs) -> None:
    _stop("sample")


@hookimpl
def engine_step_end(step) -> None:
    """A step with no sampled rows (only beams: their selection) has no engine_sample_after: its
    sample stage ends with the step."""
    _stop("sample")


@hookimpl(wrapper=True)
def engine_detokenize(rids, token_ids, finished):
    """A wrapper: it runs whichever plugin answers this firstresult hook first (skipdetok, say) and
    wherever stagetimer is listed; a plain implementation listed before skipdetok never ran."""
    _start("detokenize")
    return (yield)  # time it, do not replace it


@hookimpl
def engine_detokenize_after(rids, texts) -> None:
    _stop("detokenize")


@hookimpl
def engine_stats(role: str) -> dict:
    with _lock:
        return {"seconds": dict(_seconds), "calls": dict(_calls)}


def summary(stats: dict) -> dict:
    """Per process and summed: {"per_process": {role: {stage: seconds}}, "total": {stage: seconds}}."""
    per_process: dict[str, dict[str, float]] = {}
    total: dict[str, float] = defaultdict(float)
    for role, plugins in stats.get("plugins", {}).items():
        mine = plugins.get("stagetimer")
        if not mine:
            continue
        per_process[role] = dict(mine["seconds"])
        for stage, seconds in mine["seconds"].items():
            total[stage] += seconds
    return {"per_process": per_process, "total": dict(total)}


@hookimpl
def engine_shutdown_report(stats: dict) -> None:
    s = summary(stats)
    lines = ["stagetimer: seconds per stage"]
    for role, stages in s["per_process"].items():
        lines.append(f"  {role:<12}" + "  ".join(f"{k} {v:.3f}" for k, v in sorted(stages.items())))
    lines.append(
        f"  {'total':<12}" + "  ".join(f"{k} {v:.3f}" for k, v in sorted(s["total"].items()))
    )
    print("\n".join(lines), file=sys.stderr)
