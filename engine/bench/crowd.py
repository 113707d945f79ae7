"""A crowd of concurrent requests as production sends them, and the checks that none was lost.

Used by the stress suite (tests/stress/: a short crowd in every run, 1,000 requests under the `stress`
marker) and by `python -m engine.bench --workload soak` (the same crowd for many rounds). Each request
is drawn from a seeded mix: prompt lengths from 1 to ~400 tokens, greedy and sampled, n > 1, stop
strings, logprobs, streaming or not; about a tenth end early in one of three ways (the stream left
after a few chunks, engine.abort(rid) after a random delay, the awaiting task cancelled).
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field

STOP_STRINGS = (["\n\n"], ["."], [" the", "\n"])
EARLY_ENDS = ("leave_stream", "abort_rid", "cancel_task")


@dataclass
class Spec:
    """One request of the crowd: what to send, and how (if at all) it ends early."""

    index: int
    rid: str
    input_ids: list[int]
    params: dict
    stream: bool
    logprobs: bool
    early: str | None = None  # one of EARLY_ENDS
    # chunks to read (leave_stream) or seconds to wait (abort_rid, cancel_task)
    early_after: float = 0.0

    @property
    def greedy(self) -> bool:
        return self.params.get("temperature", 1.0) == 0.0 and self.params.get("n", 1) == 1


@dataclass
class Outcome:
    spec: Spec
    results: list[dict] = field(default_factory=list)  # one per sample (n)
    chunks: int = 0
    finals: int = 0  # chunks carrying a finish_reason, per request: 1 for each completed sample
    error: str | None = None
    cancelled: bool = False


PROMPT_LENGTHS = (1, 3, 8, 20, 40, 80, 160, 400)


def make_crowd(
    n: int,
    seed: int,
    corpus_ids: list[int],
    vocab_size: int,
    abort_share: float = 0.1,
    prefix: str = "crowd",
    max_prompt: int | None = None,
) -> list[Spec]:
    """n requests drawn from the mix; rids are prefix-seed-index, so two crowds never share one.
    max_prompt caps the prompt lengths drawn (the prefill of the 160- and 400-token prompts is most of
    a crowd's time on a CPU): for runs that count requests, not tokens."""
    rng = random.Random(seed)
    lengths = tuple(x for x in PROMPT_LENGTHS if max_prompt is None or x <= max_prompt)
    if not lengths:
        raise ValueError(f"max_prompt must be at least {PROMPT_LENGTHS[0]}, got {max_prompt}")
    specs = []
    for i in range(n):
        length = rng.choice(lengths)
        start = rng.randrange(0, max(1, len(corpus_ids) - length))
        ids = corpus_ids[start : start + length] or [rng.randrange(vocab_size)]
        kind = rng.random()
        params: dict = {"max_new_tokens": rng.choice((1, 4, 8, 16, 24))}
        if kind < 0.35:
            params["temperature"] = 0.0
        else:
            params.update(temperature=rng.choice((0.5, 0.8, 1.0, 1.3)), seed=rng.randrange(1 << 30))
            if rng.random() < 0.5:
                params["top_p"] = rng.choice((0.5, 0.9, 1.0))
            if rng.random() < 0.3:
                params["top_k"] = rng.choice((1, 5, 50))
            if rng.random() < 0.2:
                params["min_p"] = 0.05
            if rng.random() < 0.2:
                params["repetition_penalty"] = 1.2
            if rng.random() < 0.2:
                params["n"] = rng.choice((2, 3))
        if rng.random() < 0.2:
            params["stop"] = list(rng.choice(STOP_STRINGS))
        if rng.random() < 0.3:
            params["ignore_eos"] = True
        spec = Spec(
            i,
            f"{prefix}-{seed}-{i}",
            ids,
            params,
            stream=rng.random() < 0.5,
            logprobs=rng.random() < 0.2,
        )
        if rng.random() < abort_share:
            spec.early = rng.choice(EARLY_ENDS)
            spec.early_after = (
                rng.randrange(0, 4) if spec.early == "leave_stream" else rng.uniform(0.0, 1.5)
            )
            if spec.early == "leave_stream":
                spec.stream = True
        specs.append(spec)
    return specs


def _call_kwargs(spec: Spec) -> dict:
    kwargs = {
        "input_ids": spec.input_ids,
        "sampling_params": dict(spec.params),
        "rid": spec.rid,
        "stream": spec.stream,
    }
    if spec.logprobs:
        kwargs.update(return_logprob=True, top_logprobs_num=2)
    return kwargs


async def _one(engine, spec: Spec) -> Outcome:
    out = Outcome(spec)
    call = engine.async_generate(**_call_kwargs(spec))
    try:
        if spec.early == "cancel_task":
            task = asyncio.ensure_future(_consume(await call, out) if spec.stream else call)
            await asyncio.sleep(spec.early_after)
            task.cancel()
            try:
                got = await task
            except asyncio.CancelledError:
                out.cancelled = True
                return out
            if not spec.stream:
                out.results = got if isinstance(got, list) else [got]
            return out
        if spec.early == "abort_rid":

            async def later() -> None:
                await asyncio.sleep(spec.early_after)
                engine.abort(spec.rid)  # a request of n > 1: the rid names all its samples

            aborter = asyncio.ensure_future(later())
            try:
                if spec.stream:
                    await _consume(await call, out)
                else:
                    got = await call
                    out.results = got if isinstance(got, list) else [got]
            finally:
                aborter.cancel()
            return out
        if spec.stream:
            await _consume(await call, out)
        else:
            got = await call
            out.results = got if isinstance(got, list) else [got]
    except Exception as exc:  # reported, never lost
        out.error = f"{type(exc).__name__}: {exc}"
    return out


async def _consume(stream, out: Outcome) -> None:
    """Read a stream to its end (or, for leave_stream, leave after early_after chunks), rebuilding each
    sample's result from its chunks."""
    per_index: dict[int, dict] = {}
    try:
        async for chunk in stream:
            out.chunks += 1
            got = per_index.setdefault(
                chunk["index"], {"text": "", "output_ids": [], "meta_info": {}}
            )
            if got["meta_info"].get("finish_reason") is not None:
                out.error = f"a chunk after the final one for index {chunk['index']}"
            got["text"] += chunk["text"]
            got["output_ids"] += chunk["output_ids"]
            got["meta_info"] = chunk["meta_info"]
            if chunk["meta_info"].get("finish_reason") is not None:
                out.finals += 1
            if out.spec.early == "leave_stream" and out.chunks > out.spec.early_after:
                break
    finally:
        if hasattr(stream, "aclose"):
            await stream.aclose()
    out.results = [per_index[i] for i in sorted(per_index)]


async def run_crowd(engine, specs: list[Spec]) -> tuple[list[Outcome], float]:
    """All of specs at once; the outcomes in spec order and the wall time."""
    start = time.perf_counter()
    outcomes = await asyncio.gather(*(_one(engine, s) for s in specs))
    return list(outcomes), time.perf_counter() - start


def problems(outcomes: list[Outcome]) -> list[str]:
    """What went wrong, one line a request: every request must end exactly once, with its full result
    (each of its n samples finished, max_new_tokens respected) or the early end it asked for."""
    found = []
    for o in outcomes:
        s, n = o.spec, o.spec.params.get("n", 1)
        where = f"{s.rid} ({s.early or 'plain'}, stream={s.stream}, {s.params})"
        if o.error:
            found.append(f"{where}: {o.error}")
            continue
        if o.cancelled:
            if s.early != "cancel_task":
                found.append(f"{where}: cancelled without asking")
            continue
        if s.early == "leave_stream":
            continue  # it left; what it read is checked above (no chunk after a final one)
        if len(o.results) != n:
            found.append(f"{where}: {len(o.results)} results for n={n}")
            continue
        if s.stream and o.finals != n:
            found.append(f"{where}: {o.finals} final chunks for n={n}")
        for r in o.results:
            reason = r["meta_info"].get("finish_reason")
            if reason is None:
                found.append(f"{where}: a result without finish_reason")
            elif reason["type"] == "abort" and s.early != "abort_rid":
                found.append(f"{where}: aborted without asking: {reason}")
            elif len(r["output_ids"]) > s.params["max_new_tokens"]:
                found.append(
                    f"{where}: {len(r['output_ids'])} tokens for max_new_tokens={s.params['max_new_tokens']}"
                )
            elif reason["type"] == "length" and len(r["output_ids"]) != s.params["max_new_tokens"]:
                found.append(f"{where}: finished by length after {len(r['output_ids'])} tokens")
    return found


def greedy_alone(engine, specs: list[Spec]) -> dict[str, list[int]]:
    """The greedy requests of the crowd that run to the end, each run alone: rid -> output ids."""
    alone = {}
    for s in specs:
        if s.greedy and s.early is None:
            params = {k: v for k, v in s.params.items()}
            alone[s.rid] = engine.generate(input_ids=s.input_ids, sampling_params=params)[
                "output_ids"
            ]
    return alone


def greedy_mismatches(outcomes: list[Outcome], alone: dict[str, list[int]]) -> list[str]:
    return [
        f"{o.spec.rid}: crowd {o.results[0]['output_ids']} alone {alone[o.spec.rid]}"
        for o in outcomes
        if o.spec.rid in alone and o.results and o.results[0]["output_ids"] != alone[o.spec.rid]
    ]


def wait_idle(engine, timeout: float = 30.0) -> dict:
    """get_stats once every per-request structure of the three processes is back to 0 (aborts of left
    streams and cancelled tasks are asynchronous), or the last stats after timeout."""
    deadline = time.monotonic() + timeout
    while True:
        stats = engine.get_stats()
        if not busy(stats) or time.monotonic() > deadline:
            return stats
        time.sleep(0.05)


def busy(stats: dict) -> list[str]:
    """Every per-request structure not back to its idle value, as 'role.name=value'."""
    found = [
        f"{role}.{name}={value}"
        for role, names in stats.get("tracked", {}).items()
        for name, value in names.items()
        if value
    ]
    if stats["free_slots"] != stats["max_running_requests"]:
        found.append(f"free_slots={stats['free_slots']} of {stats['max_running_requests']}")
    if stats["running"] or stats["waiting"]:
        found.append(f"running={stats['running']} waiting={stats['waiting']}")
    if stats.get("cache_lock_refs", 0) or stats.get("cache_locked_tokens", 0):
        found.append(
            f"cache_lock_refs={stats.get('cache_lock_refs')} locked={stats.get('cache_locked_tokens')}"
        )
    if stats["free_tokens"] + stats.get("cache_tokens", 0) != stats["max_total_tokens"]:
        found.append(
            f"free_tokens={stats['free_tokens']} + cache_tokens={stats.get('cache_tokens')} "
            f"!= max_total_tokens={stats['max_total_tokens']}"
        )
    return found
