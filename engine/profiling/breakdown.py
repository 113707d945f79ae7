"""Samples -> the engine's stages, the top functions by own time, and a one-line reading.

Only the threads that do the engine's work are shared out (py-spy records each sample's thread:
`engine profile` runs it with --threads): in the scheduler and detokenizer the serving thread (the
loop), in the user process every thread that ran the engine's code (the callers, the receiver).
Other threads (the grammar compile pool, OpenTelemetry's export thread, a child's parent lifeline)
are listed with their sample counts, not shared out: idle all the time, they would read as waiting
or as work. A sample belongs to the outermost stage function on its stack (TokenizerManager.tokenize,
Scheduler.schedule / forward / sample / process_results, DetokenizerManager.detokenize); a stack
with none whose innermost frames wait on a socket, a poll, an event, an idle pool worker or the
scheduler's hold-back sleep is "waiting on ZMQ"; the rest is "other" (start-up, imports, model
loading, message handling). `busy_stages_pct` shares out the samples that neither wait nor belong
to start-up: where the process's work goes once it serves.
"""

from __future__ import annotations

from collections import Counter

STAGES = (
    "tokenize",
    "schedule",
    "forward",
    "sample",
    "process_results",
    "detokenize",
    "waiting on ZMQ",
    "other",
)
STAGE_FUNCTIONS = {
    "TokenizerManager.tokenize": "tokenize",
    "Scheduler.schedule": "schedule",
    "Scheduler.forward": "forward",
    "Scheduler.sample": "sample",
    "Scheduler.process_results": "process_results",
    "DetokenizerManager.detokenize": "detokenize",
    "DetokenizerManager.detokenize_beams": "detokenize",
}
WAIT_HINTS = ("poll", "recv", "wait", "select", "sleep", "zmq/sugar/poll")
# innermost frames of a thread with nothing to do: a ThreadPoolExecutor worker waiting for work (its
# queue's get runs in C, so the worker's own frame is the innermost)
IDLE_FRAMES = ("_worker (concurrent/futures/thread.py:",)
# a child's parent-lifeline thread: always asleep, not the process's work
HOUSEKEEPING = ("_watch_parent",)
THREAD = "thread ("  # py-spy --threads: a stack's first frame, "thread (<tid>): <name>"
# a child's serving thread: it built the process, then serves
SERVING = (
    "run_child",
    ".serve_forever",
)


def _blocking_lines() -> set[str]:
    """ "Function (file:line)" of the engine's own blocking calls. zmq's recv and poll and time.sleep
    run in C, so a sample waiting there shows the calling line as its innermost Python frame: the
    sockets, and the scheduler's 1 ms sleep while requests wait that none can start."""
    import inspect
    import os

    import engine
    from engine.detokenizer.manager import DetokenizerManager
    from engine.scheduler import receive
    from engine.scheduler.scheduler import Scheduler
    from engine.frontend.receiver import Receiver

    out = set()
    for func, marker in (
        (DetokenizerManager.serve_forever, ".recv("),
        (receive.recv_requests, ".poll("),
        (Receiver.loop, "poller.poll("),
        (Scheduler.serve_forever, "time.sleep("),
    ):
        lines, first = inspect.getsourcelines(func)
        root = os.path.dirname(os.path.dirname(os.path.abspath(engine.__file__)))
        # py-spy shows paths relative to sys.path
        short = os.path.relpath(inspect.getsourcefile(func), root)
        for offset, text in enumerate(lines):
            if marker in text:
                out.add(f"{func.__qualname__} ({short}:{first + offset})")
    return out


_BLOCKING: set[str] | None = None


def _func(frame: str) -> str:
    return frame.split(" (")[0]


def stage_of(stack: tuple[str, ...]) -> str:
    for frame in stack:
        stage = STAGE_FUNCTIONS.get(_func(frame))
        if stage:
            return stage
    global _BLOCKING
    if _BLOCKING is None:
        _BLOCKING = _blocking_lines()
    inner = stack[-1]
    if (
        inner in _BLOCKING
        or inner.startswith(IDLE_FRAMES)
        or any(hint in _func(inner).lower() for hint in WAIT_HINTS)
    ):
        return "waiting on ZMQ"
    return "other"


def split_thread(stack: tuple[str, ...]) -> tuple[str | None, tuple[str, ...]]:
    """(the thread, as py-spy --threads names it, or None; the frames)."""
    if stack and stack[0].startswith(THREAD):
        return stack[0], stack[1:]
    return None, stack


def _engine_frame(frame: str) -> bool:
    """A frame of the engine's own work: the plugins' service threads (the tracing plugin's exporter under
    OpenTelemetry's export thread, the metrics plugin's scrape server) run engine code too, but wait all day."""
    return " (engine/" in frame and not frame.split(" (engine/", 1)[1].startswith(
        ("tracing/", "plugins/")
    )


def counted_threads(role: str | None, threads: dict[str | None, Counter]) -> set[str | None]:
    """The threads whose samples are shared out (see the module's docstring); all of them when none
    qualifies (no thread ids, or a profile that ended before the engine served)."""
    if role in ("scheduler", "detokenizer"):
        chosen = {
            t for t, st in threads.items() if any(_func(f).endswith(SERVING) for s in st for f in s)
        }
    elif role == "user":
        chosen = {
            t for t, st in threads.items() if any(map(_engine_frame, (f for s in st for f in s)))
        }
    else:
        chosen = set()
    return chosen or set(threads)


def _startup(stack: tuple[str, ...]) -> bool:
    """Building the process: a child's build (model loading, tokenizer) or Engine() in the user process."""
    return any(_func(f).endswith((".build", "Engine.__init__")) for f in stack)


def breakdown(stacks: Counter, top: int = 10, idle: bool = True, role: str | None = None) -> dict:
    """idle: the samples include waiting threads (py-spy --idle). Without them there is no wall
    time to share out: the shares are of on-CPU samples and "waiting on ZMQ" is not measured.
    role: which threads count (counted_threads); None counts every thread."""
    threads: dict[str | None, Counter] = {}
    for key, count in stacks.items():
        thread, frames = split_thread(key)
        if frames and not any(_func(f).endswith(HOUSEKEEPING) for f in frames):
            threads.setdefault(thread, Counter())[frames] += count
    counted = counted_threads(role, threads)
    stacks = Counter()
    for thread in counted:
        stacks.update(threads[thread])
    total = sum(stacks.values())
    per_stage: Counter = Counter()
    own: Counter = Counter()
    startup = 0
    for stack, count in stacks.items():
        stage = stage_of(stack)
        per_stage[stage] += count
        own[stack[-1]] += count
        if stage == "other" and _startup(stack):  # waiting during start-up stays "waiting"
            startup += count
    shares = {s: (100.0 * per_stage[s] / total if total else 0.0) for s in STAGES}
    busy = total - per_stage["waiting on ZMQ"] - startup
    per_stage["other"] -= (
        startup  # start-up is "other" in the shares of all samples, left out of the busy ones
    )
    busy_shares = {
        s: (100.0 * per_stage[s] / busy if busy else 0.0) for s in STAGES if s != "waiting on ZMQ"
    }
    listed = sorted(
        ((sum(st.values()), t) for t, st in threads.items() if t is not None),
        key=lambda x: (-x[0], x[1]),
    )
    return {
        "samples": total,  # of the counted threads: what the shares are of
        "all_samples": sum(
            sum(st.values()) for st in threads.values()
        ),  # every thread's (the lifeline's left out)
        "threads": [{"thread": t, "samples": n, "counted": t in counted} for n, t in listed],
        "idle_sampled": idle,  # False: shares are of on-CPU samples, not of wall time
        "busy_samples": busy,
        "stages_pct": shares,  # of all samples: sums to 100 (of wall time only when idle_sampled)
        "busy_stages_pct": busy_shares,  # of the samples neither waiting nor starting up: where the work goes
        "startup_pct": 100.0 * startup / total if total else 0.0,
        "stage_samples": {s: per_stage[s] for s in STAGES},  # counts ("other" without start-up)
        "top_own": [
            {"function": f, "samples": n, "pct": 100.0 * n / total} for f, n in own.most_common(top)
        ],
    }


# A share resting on fewer samples than this is noise (at 100 samples/s, half a second of work):
# the reading says so instead of giving advice.
MIN_SAMPLES = 50


def _too_few(role: str, what: str, n: int) -> str:
    return (
        f"{role}: only {n} {what}, too few for a reading (profile a longer run, or raise --rate); "
        "the flamegraph still shows where they fell"
    )


def reading(role: str, b: dict) -> str:
    """One line in the spirit of the reference's symptom table. It speaks of wall time only when
    idle samples were taken, and gives no advice from fewer than MIN_SAMPLES samples."""
    if not b["samples"]:
        return f"{role}: no samples"
    if b["samples"] < MIN_SAMPLES:
        return _too_few(role, "samples", b["samples"])
    idle = b.get("idle_sampled", True)
    s, w, busy_n = b["stages_pct"], b["busy_stages_pct"], b.get("busy_samples", b["samples"])
    if role == "detokenizer":
        if idle and s["detokenize"] >= 30:
            return (
                f"detokenizer busy {s['detokenize']:.0f}% of wall in batch decode: if nobody "
                "reads the text, try ENGINE_PLUGINS=skipdetok"
            )
        if busy_n < MIN_SAMPLES:
            if idle:
                return (
                    f"detokenizer waits {s['waiting on ZMQ']:.0f}% of wall; its {busy_n} working "
                    "samples are too few to say more"
                )
            return _too_few(role, "working samples (idle time was not sampled: --no-idle)", busy_n)
        where = (
            f"waits {s['waiting on ZMQ']:.0f}% of wall; "
            if idle
            else "idle time not sampled (--no-idle); "
        )
        if w["detokenize"] >= 50:
            return (
                f"detokenizer {where}{w['detokenize']:.0f}% of its work is batch decode: "
                "if nobody reads the text, ENGINE_PLUGINS=skipdetok removes it"
            )
        return f"detokenizer {where}{w['detokenize']:.0f}% of its work is batch decode: decoding is not a bottleneck"
    if role == "scheduler":
        if busy_n < MIN_SAMPLES:
            return _too_few(role, "samples of work once serving", busy_n)
        if w["sample"] >= 20:
            return (
                f"scheduler spends {w['sample']:.0f}% of its work sampling: a slow custom logit "
                "processor or a heavy sample hook?"
            )
        if w["process_results"] >= 15:
            return (
                f"scheduler spends {w['process_results']:.0f}% of its work in process_results: "
                "per-request bookkeeping in Python"
            )
        if w["schedule"] >= 15:
            return (
                f"scheduler spends {w['schedule']:.0f}% of its work in schedule: admission or "
                "prefix matching is expensive"
            )
        if w["forward"] >= 50:
            return (
                f"scheduler spends {w['forward']:.0f}% of its work in the model forward: "
                "compute-bound, as it should be"
            )
        return f"scheduler: forward {w['forward']:.0f}% of its work, other {w['other']:.0f}%: look at its top functions"
    of = "of samples" if idle else "of its on-CPU samples (idle time not sampled: --no-idle)"
    if b["stage_samples"]["tokenize"] >= MIN_SAMPLES // 5 and s["tokenize"] >= 20:
        return f"user process spends {s['tokenize']:.0f}% {of} tokenizing: pass input_ids, or batch prompts in one call"
    if idle and s["waiting on ZMQ"] >= 60:
        return (
            f"user process waits on the engine {s['waiting on ZMQ']:.0f}% of samples: the engine "
            "is the bottleneck, as it should be"
        )
    if idle:
        return (
            f"user process busy {100.0 - s['waiting on ZMQ']:.0f}% of samples outside the "
            "engine's stages: look at its top functions"
        )
    return (
        "user process: idle time not sampled (--no-idle), so its waiting on the engine is not "
        "measured: look at its top functions"
    )
