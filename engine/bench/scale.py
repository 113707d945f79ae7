"""Scale-out, side by side in one run: one `engine serve` replica against two behind the SGLang model
gateway (`smg`), the second under round robin and under cache-aware routing, on a seeded, shuffled
workload of prefix groups (engine/bench/prefix_groups.py) sent by the `openai` client.

Per configuration: wall time, requests and generated tokens per second, and the prefix-cache hit
rate the engines report (their /stats before and after). The machine is shared out alike: the one
replica gets all the cores and twice --scale-pool KV tokens, each of two half the cores and
--scale-pool tokens, sized to hold about four of the workload's prefixes, so that where a group is
sent decides whether its prefix is still cached. Tensor-parallel rows (TP=1 against TP=2) belong
in `tp_rows`, beside these.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import threading
import time

from engine.bench.prefix_groups import hit_rate, prefix_groups, run_completions


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--scale-groups", type=int, default=8, help="scale workload: prefix groups")
    p.add_argument(
        "--scale-per-group", type=int, default=25, help="scale workload: requests per group"
    )
    p.add_argument(
        "--scale-prefix-words", type=int, default=256, help="scale workload: words per prefix"
    )
    p.add_argument(
        "--scale-pool", type=int, default=1200, help="scale workload: KV tokens per replica"
    )
    p.add_argument(
        "--scale-concurrency", type=int, default=4, help="scale workload: requests at once"
    )
    p.add_argument(
        "--scale-max-tokens", type=int, default=16, help="scale workload: tokens per answer"
    )
    p.add_argument("--scale-dtype", default="auto", help="scale workload: engine dtype")


def _replica(args: argparse.Namespace, threads: int, pool: int) -> tuple[subprocess.Popen, str]:
    """engine serve on a port the system picks; returns once it printed its ready line."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "engine.serve",
            "--port",
            "0",
            "--dtype",
            args.scale_dtype,
            "--max-total-tokens",
            str(pool),
            "--num-threads",
            str(threads),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    for line in proc.stdout:
        if "engine serve: ready on " in line:
            url = line.split("ready on ", 1)[1].split()[0]
            threading.Thread(target=proc.stdout.read, daemon=True).start()  # keep the pipe drained
            return proc, url
    raise RuntimeError(f"engine serve did not start (exit code {proc.wait()})")


def _gateway(urls: list[str], policy: str) -> tuple[subprocess.Popen, str]:
    from engine.serve import gateway
    from engine.serve.replicas import free_port

    port = free_port("127.0.0.1")
    cmd = gateway.launch_command(urls, "127.0.0.1", port, policy, free_port("127.0.0.1"))
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"

    def alive() -> bool:
        return proc.poll() is None

    # routing to every replica, and every replica's load polled (cache-aware places new prefixes by
    # the loads: a coin toss until each replica has one; docs/scale-out.md)
    if not (
        gateway.wait_routing(url, urls, 60, alive=alive)
        and gateway.wait_loads(url, urls, 30, alive=alive)
    ):
        proc.kill()
        raise RuntimeError(f"the gateway did not route to {urls}")
    return proc, url


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.terminate()
    for p in procs:
        try:
            p.wait(60)
        except subprocess.TimeoutExpired:
            p.kill()


def _measure(url: str, replicas: list[str], model: str, workload, args) -> dict:
    import httpx
    import openai

    def stats() -> list[dict]:
        return [httpx.get(u + "/stats", timeout=60).json() for u in replicas]

    for u in replicas:
        httpx.post(u + "/flush_cache", timeout=60)
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
    run_completions(client, model, workload[:2], 2, 2)  # warm-up: first-request costs
    for u in replicas:
        httpx.post(u + "/flush_cache", timeout=60)
    before = stats()
    t0 = time.perf_counter()
    outs = run_completions(client, model, workload, args.scale_concurrency, args.scale_max_tokens)
    seconds = time.perf_counter() - t0
    after = stats()
    tokens = sum(o.usage.completion_tokens for o in outs)
    return {
        "seconds": seconds,
        "requests_per_s": len(outs) / seconds,
        "tokens_per_s": tokens / seconds,
        "hit_rate": hit_rate(before, after),
        "per_replica": [
            a["finished_requests"] - b["finished_requests"] for b, a in zip(before, after)
        ],
    }


def tp_rows(args: argparse.Namespace) -> dict | None:
    """TP=1 against TP=2 within one replica (docs/tensor-parallel.md), by engine/bench/tp.py."""
    from engine.bench.tp import tp_rows as measure_tp

    print("[scale] one replica, TP=1 against TP=2 ...", flush=True)
    return measure_tp()


def run_scale(args: argparse.Namespace) -> dict:
    import httpx

    from engine.cores import usable_cores

    cores = usable_cores()
    workload = prefix_groups(
        args.scale_groups, args.scale_per_group, args.scale_prefix_words, args.seed
    )
    rows: dict[str, dict] = {}
    print("[scale] one replica ...", flush=True)
    proc, url = _replica(args, cores, 2 * args.scale_pool)
    try:
        model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        rows["1 replica"] = _measure(url, [url], model, workload, args)
    finally:
        _stop([proc])
    print("[scale] two replicas ...", flush=True)
    pair = [_replica(args, max(1, cores // 2), args.scale_pool) for _ in range(2)]
    try:
        urls = [u for _, u in pair]
        for policy in ("round_robin", "cache_aware"):
            print(f"[scale] two replicas, gateway {policy} ...", flush=True)
            gw, gw_url = _gateway(urls, policy)
            try:
                rows[f"2 replicas, {policy}"] = _measure(gw_url, urls, model, workload, args)
            finally:
                _stop([gw])
    finally:
        _stop([p for p, _ in pair])
    one, rr, ca = (
        rows["1 replica"],
        rows["2 replicas, round_robin"],
        rows["2 replicas, cache_aware"],
    )
    return {
        "workload": {
            "groups": args.scale_groups,
            "per_group": args.scale_per_group,
            "prefix_words": args.scale_prefix_words,
            "pool_tokens_per_replica": args.scale_pool,  # twice that for the one replica
            "concurrency": args.scale_concurrency,
            "max_tokens": args.scale_max_tokens,
            "cores": cores,
        },
        "rows": rows,
        "two_round_robin_over_one": one["seconds"] / rr["seconds"],
        "two_cache_aware_over_one": one["seconds"] / ca["seconds"],
        "cache_aware_over_round_robin": rr["seconds"] / ca["seconds"],
        "hit_rate_points": 100 * (ca["hit_rate"] - rr["hit_rate"]),
        "tp": tp_rows(args),
    }


def print_scale(r: dict) -> None:
    w = r["workload"]
    print(
        f"\nscale-out: {w['groups']} prefix groups x {w['per_group']} requests, ~{w['prefix_words']} "
        f"token prefixes, {w['pool_tokens_per_replica']} KV tokens per replica of two (twice that for one), "
        f"concurrency "
        f"{w['concurrency']}, {w['max_tokens']} tokens each, {w['cores']} cores shared out"
    )
    print(f"  {'':<28}{'seconds':>9}{'req/s':>8}{'tok/s':>8}{'hit rate':>10}  requests per replica")
    for name, m in r["rows"].items():
        print(
            f"  {name:<28}{m['seconds']:9.1f}{m['requests_per_s']:8.2f}{m['tokens_per_s']:8.1f}"
            f"{100 * m['hit_rate']:9.1f}%  {m['per_replica']}"
        )
    print(
        f"  speed-up over one replica: round robin {r['two_round_robin_over_one']:.2f}x, "
        f"cache-aware {r['two_cache_aware_over_one']:.2f}x; cache-aware over round robin "
        f"{r['cache_aware_over_round_robin']:.2f}x, hit rate {r['hit_rate_points']:+.1f} points"
    )
    if r["tp"] is None:
        print("  tensor parallelism: no TP rows in this run (tp_rows)", flush=True)
    else:
        from engine.bench.tp import print_rows

        print(
            "  tensor parallelism, one replica (on 2 cores: the collectives' cost, not a speed-up)"
        )
        print_rows(r["tp"])
