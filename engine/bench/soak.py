"""The soak workload: the stress suite's crowd (engine/bench/crowd.py) for many rounds on one engine.

After each round every request must have ended once and every per-request structure of the three
processes be back to idle (get_stats()["tracked"], the pool, the slots, the cache locks). Resident
memory and open file descriptors of each process are sampled after each round; after the warm-up
rounds their slope (least squares, per round and per 1,000 requests) must be flat: a leak of one
small object per request would show as a steady climb.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import time

from engine.bench.checks import at_least_one
from engine.bench.crowd import busy, make_crowd, problems, run_crowd, wait_idle


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--soak-rounds", type=int, default=20, help="soak workload: rounds of one crowd each"
    )
    p.add_argument(
        "--soak-requests",
        type=int,
        default=200,
        help="soak workload: concurrent requests per round",
    )
    p.add_argument(
        "--soak-warmup", type=int, default=3, help="soak workload: rounds left out of the slopes"
    )
    p.add_argument("--soak-dtype", default="auto", help="soak workload: engine dtype")
    p.add_argument(
        "--soak-max-total-tokens",
        type=int,
        default=32768,
        help="soak workload: KV pool tokens (small enough for the warm-up rounds to touch all of it)",
    )


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    at_least_one(p, args, "soak_rounds", "soak_requests")


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def slope(ys: list[float]) -> float:
    """Least-squares slope of ys against 0, 1, 2, ... (0 for fewer than two points)."""
    n = len(ys)
    if n < 2:
        return 0.0
    mx, my = (n - 1) / 2, sum(ys) / n
    return sum((i - mx) * (y - my) for i, y in enumerate(ys)) / sum((i - mx) ** 2 for i in range(n))


def touch_pool(engine, vocab: int, prompt_len: int = 400) -> None:
    """Prefill distinct prompts until the prefix cache has held the whole pool, then flush: the pool's
    pages are touched lazily (as its free list cycles), so otherwise resident memory would climb for
    rounds after the warm-up for that reason alone."""
    import random

    rng = random.Random(0)
    size = engine.get_stats()["max_total_tokens"]
    for _ in range(0, size * 11 // 10, prompt_len * 16):
        batch = [[rng.randrange(vocab) for _ in range(prompt_len)] for _ in range(16)]
        engine.generate(input_ids=batch, sampling_params={"max_new_tokens": 1})
    engine.flush_cache()


def run_soak(args) -> dict:
    from engine import Engine

    # a pool the warm-up rounds fill: its pages are touched lazily, so a larger one would still be
    # growing resident memory after the warm-up, which is not a leak
    with Engine(dtype=args.soak_dtype, max_total_tokens=args.soak_max_total_tokens) as engine:
        result = soak(engine, args.soak_rounds, args.soak_requests, args.soak_warmup)
    result["dtype"] = args.soak_dtype
    result["max_total_tokens_option"] = args.soak_max_total_tokens
    return result


def soak(
    engine,
    rounds: int,
    per_round: int,
    warmup: int,
    seed: int = 1000,
    log: bool = True,
    touch: bool = True,
    max_prompt: int | None = None,
) -> dict:
    """rounds crowds of per_round requests on engine; samples, failures and slopes after warmup rounds.
    touch=False skips touch_pool: for runs whose memory slope nobody reads (the suite's short form; the
    pool's prefill was 30-40 s of it on a 2-core AMD EPYC Zen 1). max_prompt caps the crowds' prompt
    lengths (make_crowd)."""
    from engine.bench.prompts import build_corpus

    corpus = engine.tokenizer(build_corpus()[:60_000])["input_ids"]
    vocab = len(engine.tokenizer)
    if touch:
        touch_pool(engine, vocab)
    samples: list[dict] = []
    failures: list[str] = []
    start = time.perf_counter()
    for r in range(rounds):
        specs = make_crowd(
            per_round,
            seed=seed + r,
            corpus_ids=corpus,
            vocab_size=vocab,
            prefix="soak",
            max_prompt=max_prompt,
        )
        outcomes, wall = asyncio.run(run_crowd(engine, specs))
        found = problems(outcomes)
        stats = wait_idle(engine)
        left = busy(stats)
        failures += [f"round {r}: {p}" for p in found + left]
        pids = engine.pids
        gc.collect()  # what is garbage already (an earlier test's sockets, in a suite) closes now, not mid-run
        sample = {
            "round": r,
            "wall_s": wall,
            "requests": per_round,
            "problems": len(found),
            "not_idle": left,
            "cancelled": sum(o.cancelled for o in outcomes),
            "early": sum(o.spec.early is not None for o in outcomes),
            "generated_tokens": stats["generated_tokens"],
        }
        for role, pid in pids.items():
            sample[f"{role}_rss_mb"] = _rss_mb(pid)
            sample[f"{role}_fds"] = _fds(pid)
        samples.append(sample)
        if log:
            print(
                f"[soak] round {r + 1}/{rounds}: {per_round} requests in {wall:.1f} s, problems {len(found)}, "
                f"rss MB "
                + ", ".join(f"{k}={sample[f'{k}_rss_mb']:.0f}" for k in pids)
                + ", fds "
                + ", ".join(f"{k}={sample[f'{k}_fds']}" for k in pids),
                flush=True,
            )
    engine.flush_cache()
    final = engine.get_stats()
    roles = list(engine.pids)
    steady = samples[warmup:]
    slopes = {}
    for role in roles:
        for what in ("rss_mb", "fds"):
            s = slope([x[f"{role}_{what}"] for x in steady])
            slopes[f"{role}_{what}_per_round"] = s
            slopes[f"{role}_{what}_per_1000_requests"] = s * 1000 / per_round
    return {
        "rounds": rounds,
        "requests_per_round": per_round,
        "warmup_rounds": warmup,
        "dtype": None,
        "total_requests": rounds * per_round,
        "seconds": time.perf_counter() - start,
        "failures": failures[:50],
        "failure_count": len(failures),
        "samples": samples,
        "slopes": slopes,
        "tracked_at_end": final.get("tracked", {}),
        "free_tokens_at_end": final["free_tokens"],
        "max_total_tokens": final["max_total_tokens"],
        "structures_checked": sorted(
            f"{role}.{name}" for role, names in final.get("tracked", {}).items() for name in names
        )
        + [
            "free_tokens + cache_tokens == max_total_tokens",
            "free_slots == max_running_requests",
            "cache_lock_refs == 0",
        ],
    }


def print_soak(r: dict | None) -> None:
    if not r:
        return
    print(
        f"\n  soak: {r['rounds']} rounds of {r['requests_per_round']} concurrent requests "
        f"({r['total_requests']} in all, "
        f"{r['seconds']:.0f} s, {r['dtype']}); problems: {r['failure_count']}"
    )
    for line in r["failures"][:10]:
        print(f"    {line}")
    first, last = r["samples"][r["warmup_rounds"]], r["samples"][-1]
    print(
        f"  after {r['warmup_rounds']} warm-up rounds      first      last     slope/round   slope/1000 requests"
    )
    for key in sorted(k for k in first if k.endswith(("_rss_mb", "_fds"))):
        print(
            f"  {key:28s} {first[key]:9.1f} {last[key]:9.1f} {r['slopes'][key + '_per_round']:+14.3f} "
            f"{r['slopes'][key + '_per_1000_requests']:+20.3f}"
        )
    print(
        f"  pool at the end: {r['free_tokens_at_end']} of {r['max_total_tokens']} tokens free (cache flushed)"
    )
    print(f"  structures checked idle after every round: {', '.join(r['structures_checked'])}")
