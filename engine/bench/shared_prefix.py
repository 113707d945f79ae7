"""Shared-prefix workload: many requests behind one long system prompt, prefix cache on against off.

Why: this is the workload RadixAttention exists for (a long system prompt, few-shot examples, many
candidates from one prompt). Both engines run the same prompts one after the other in this process,
so the ratio holds even on a noisy machine. Time to first token is measured in the user process,
from submission to the arrival of each request's first token.
"""

from __future__ import annotations

import argparse
import statistics
import time

from engine.bench.checks import at_least_one
from engine.bench.prompts import build_prompts


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--prefix-len", type=int, default=1000, help="shared-prefix workload: shared prompt tokens"
    )
    p.add_argument(
        "--prefix-requests", type=int, default=64, help="shared-prefix workload: requests"
    )
    p.add_argument(
        "--prefix-new-tokens", type=int, default=64, help="shared-prefix workload: new tokens each"
    )
    p.add_argument("--prefix-dtype", default="auto", help="shared-prefix workload: engine dtype")


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    at_least_one(p, args, "prefix_len", "prefix_requests", "prefix_new_tokens")


def build_shared_prefix_prompts(tokenizer, args: argparse.Namespace) -> list[list[int]]:
    """One corpus window of prefix_len tokens, then per request its own short window as the question."""
    (prefix,) = build_prompts(tokenizer, 1, args.prefix_len, args.prefix_len, args.seed)
    questions = build_prompts(tokenizer, args.prefix_requests, 8, 24, args.seed + 1)
    return [prefix + q for q in questions]


def run_one(cache: bool, dtype: str, prompts: list[list[int]], new_tokens: int) -> dict:
    from engine import Engine

    params = {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}
    with Engine(dtype=dtype, enable_prefix_cache=cache) as eng:
        eng.generate(
            input_ids=[p[::-1][:32] for p in prompts[:2]],
            sampling_params={**params, "max_new_tokens": 4},
        )
        eng.flush_cache()
        before = eng.get_stats()
        t0 = time.perf_counter()
        outs = eng.generate(input_ids=prompts, sampling_params=params)
        wall = time.perf_counter() - t0
        after = eng.get_stats()
        dtype_used = eng.server_info["dtype"]
    tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
    ttft = sorted(o["meta_info"]["first_token_latency"] for o in outs)
    return {
        "dtype": dtype_used,
        "generated_tokens": tokens,
        "wall_s": wall,
        "tokens_per_s": tokens / wall,
        "ttft_mean_s": statistics.fmean(ttft),
        "ttft_p50_s": ttft[len(ttft) // 2],
        "ttft_max_s": ttft[-1],
        "cached_tokens": sum(o["meta_info"]["cached_tokens"] for o in outs),
        "prefill_tokens": after["prefill_tokens"] - before["prefill_tokens"],
        "prefill_steps": after["prefill_steps"] - before["prefill_steps"],
        "retracted_requests": after["retracted_requests"] - before["retracted_requests"],
    }


def run_shared_prefix(args: argparse.Namespace) -> dict:
    from engine.model.resolve import resolve_model_dir
    from engine.tokenizer import load_hf_tokenizer

    prompts = build_shared_prefix_prompts(load_hf_tokenizer(resolve_model_dir(None)), args)
    result: dict = {
        "workload": {
            "requests": len(prompts),
            "prefix_len": args.prefix_len,
            "new_tokens": args.prefix_new_tokens,
            "prompt_tokens": sum(len(p) for p in prompts),
            "dtype": args.prefix_dtype,
        },
    }
    for cache in (True, False):
        label = "cache_on" if cache else "cache_off"
        print(f"[shared prefix] {label} ...", flush=True)
        result[label] = run_one(cache, args.prefix_dtype, prompts, args.prefix_new_tokens)
    on, off = result["cache_on"], result["cache_off"]
    result["throughput_ratio"] = on["tokens_per_s"] / off["tokens_per_s"]
    result["ttft_mean_ratio"] = off["ttft_mean_s"] / on["ttft_mean_s"]
    return result


def print_shared_prefix(r: dict) -> None:
    on, off, w = r["cache_on"], r["cache_off"], r["workload"]
    print(
        f"\nshared prefix: {w['requests']} requests, {w['prefix_len']}-token shared prefix, "
        f"{w['new_tokens']} new tokens each, {on['dtype']}"
    )
    rows = [
        ("", "cache on", "cache off"),
        ("tokens/s", f"{on['tokens_per_s']:.1f}", f"{off['tokens_per_s']:.1f}"),
        ("wall s", f"{on['wall_s']:.2f}", f"{off['wall_s']:.2f}"),
        ("TTFT mean s", f"{on['ttft_mean_s']:.2f}", f"{off['ttft_mean_s']:.2f}"),
        ("TTFT p50 s", f"{on['ttft_p50_s']:.2f}", f"{off['ttft_p50_s']:.2f}"),
        ("prefill tokens computed", str(on["prefill_tokens"]), str(off["prefill_tokens"])),
        ("prompt tokens from cache", str(on["cached_tokens"]), str(off["cached_tokens"])),
    ]
    for name, a, b in rows:
        print(f"  {name:<28}{a:>12}{b:>12}")
    print(f"  throughput cache on / off   {r['throughput_ratio']:10.2f}x")
    print(f"  mean TTFT cache off / on    {r['ttft_mean_ratio']:10.2f}x", flush=True)
