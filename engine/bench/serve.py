"""The server against the in-process engine, side by side in one run.

The same prompts (the benchmark's seeded prompts), each a streaming request, all sent at once
(--serve-concurrency at a time): once through `engine serve` over HTTP on 127.0.0.1 (Server-Sent
Events from /v1/completions, read by an httpx client in this process), once through
`Engine.async_generate(stream=True)` in this process. Per mode: generated tokens over wall time,
time to first token and inter-token latency (p50, p99). Modes alternate over --plugin-rounds
rounds; each has its own engine, started before and stopped after its runs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time

from engine.bench.checks import at_least_one
from engine.bench.prompts import build_prompts


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--serve-concurrency", type=int, default=64, help="serve workload: concurrent streams"
    )
    p.add_argument("--serve-dtype", default="auto", help="serve workload: engine dtype")


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    at_least_one(p, args, "serve_concurrency")


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


class _Timing:
    """Arrival times of every stream's pieces: time to first token and the gaps between pieces."""

    def __init__(self) -> None:
        self.firsts: list[float] = []
        self.gaps: list[float] = []
        self.tokens = 0
        self.t0 = time.perf_counter()

    def stream(self) -> "_Stream":
        return _Stream(self)

    def summary(self) -> dict:
        seconds = time.perf_counter() - self.t0
        return {
            "tokens": self.tokens,
            "seconds": seconds,
            "tokens_per_s": self.tokens / seconds,
            "ttft_p50": _percentile(self.firsts, 50),
            "ttft_p99": _percentile(self.firsts, 99),
            "itl_p50": _percentile(self.gaps, 50),
            "itl_p99": _percentile(self.gaps, 99),
        }


class _Stream:
    def __init__(self, timing: _Timing) -> None:
        self.timing, self.start, self.last = timing, time.perf_counter(), None

    def piece(self) -> None:
        now = time.perf_counter()
        (self.timing.firsts if self.last is None else self.timing.gaps).append(
            now - (self.last or self.start)
        )
        self.last = now


async def _run_in_process(
    engine, prompts: list[list[int]], new_tokens: int, concurrency: int
) -> dict:
    params = {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}
    gate = asyncio.Semaphore(concurrency)
    timing = _Timing()

    async def one(ids: list[int]) -> None:
        async with gate:
            stream = timing.stream()
            async for chunk in await engine.async_generate(
                input_ids=ids, sampling_params=params, stream=True
            ):
                if chunk["output_ids"]:
                    stream.piece()
                    timing.tokens += len(chunk["output_ids"])

    await asyncio.gather(*(one(p) for p in prompts))
    return timing.summary()


async def _run_server(
    url: str, prompts: list[list[int]], new_tokens: int, concurrency: int
) -> dict:
    import httpx

    gate = asyncio.Semaphore(concurrency)
    timing = _Timing()
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=3600, limits=limits) as client:

        async def one(ids: list[int]) -> None:
            body = {
                "prompt": ids,
                "max_tokens": new_tokens,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            async with gate:
                stream = timing.stream()
                async with client.stream("POST", "/v1/completions", json=body) as r:
                    r.raise_for_status()
                    async for line in r.aiter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        event = json.loads(line[6:])
                        if event.get("usage") and not event["choices"]:
                            # the server's own count
                            timing.tokens += event["usage"]["completion_tokens"]
                        else:
                            stream.piece()

        await asyncio.gather(*(one(p) for p in prompts))
        return timing.summary()


def _start_server(dtype: str) -> tuple[subprocess.Popen, str]:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "engine.serve", "--port", str(port), "--dtype", dtype],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    for line in proc.stdout:
        if "engine serve: ready on" in line:
            return proc, f"http://127.0.0.1:{port}"
    raise RuntimeError(f"engine serve did not start (exit code {proc.wait()})")


def run_serve(args: argparse.Namespace) -> dict:
    from engine import Engine

    results: dict[str, list[dict]] = {"server": [], "in_process": []}
    prompts = None
    for r in range(args.plugin_rounds):
        for mode in ("in_process", "server") if r % 2 == 0 else ("server", "in_process"):
            print(f"[serve] round {r + 1}: {mode} ...", flush=True)
            if mode == "server":
                proc, url = _start_server(args.serve_dtype)
                try:
                    if prompts is None:
                        from engine.model.resolve import resolve_model_dir
                        from engine.tokenizer import load_hf_tokenizer

                        tok = load_hf_tokenizer(resolve_model_dir(None))
                        prompts = build_prompts(
                            tok, args.num_prompts, args.min_len, args.max_len, args.seed
                        )
                    asyncio.run(_run_server(url, [p[:8] for p in prompts[:2]], 4, 2))  # warm-up
                    results[mode].append(
                        asyncio.run(
                            _run_server(url, prompts, args.max_new_tokens, args.serve_concurrency)
                        )
                    )
                finally:
                    proc.terminate()
                    proc.wait(60)
            else:
                with Engine(dtype=args.serve_dtype) as engine:
                    if prompts is None:
                        prompts = build_prompts(
                            engine.tokenizer,
                            args.num_prompts,
                            args.min_len,
                            args.max_len,
                            args.seed,
                        )
                    asyncio.run(_run_in_process(engine, [p[:8] for p in prompts[:2]], 4, 2))
                    results[mode].append(
                        asyncio.run(
                            _run_in_process(
                                engine, prompts, args.max_new_tokens, args.serve_concurrency
                            )
                        )
                    )
    med = {
        m: {k: statistics.median(run[k] for run in runs) for k in runs[0]}
        for m, runs in results.items()
    }
    return {
        "concurrency": args.serve_concurrency,
        "dtype": args.serve_dtype,
        "rounds": args.plugin_rounds,
        "runs": results,
        "median": med,
        "server_over_in_process": med["server"]["tokens_per_s"] / med["in_process"]["tokens_per_s"],
    }


def print_serve(r: dict) -> None:
    print(
        f"\nserver against in-process, {r['concurrency']} concurrent streams, dtype {r['dtype']}, "
        f"medians of {r['rounds']} runs each"
    )
    print(
        f"  {'':<12}{'tokens/s':>10}{'TTFT p50':>10}{'TTFT p99':>10}{'ITL p50':>10}{'ITL p99':>10}"
    )
    for mode in ("in_process", "server"):
        m = r["median"][mode]
        print(
            f"  {mode:<12}{m['tokens_per_s']:10.1f}{m['ttft_p50']:10.3f}{m['ttft_p99']:10.3f}"
            f"{m['itl_p50']:10.3f}{m['itl_p99']:10.3f}"
        )
    print(
        f"  server / in-process throughput: {r['server_over_in_process']:.3f} (target >= 0.90)",
        flush=True,
    )
