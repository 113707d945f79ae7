"""Plugin costs and the skipdetok saving, side by side in one script.

Hook cost: two engines alive at once, one without plugins and one with `noop` (every hook
implemented, doing nothing), the same throughput workload timed on each in turn, several rounds.
The empty call sites are timed directly too: a `has()` check per call site, times the call sites a
step passes, against the step time.

skipdetok: a user-side beam search shaped like the reference's: 200 candidates that share one
prompt, 3 new tokens each, ten rounds (each round's candidates are the last round's plus their new
tokens), with and without skipdetok; wall time and the detokenizer's CPU time.
"""

from __future__ import annotations

import argparse
import statistics
import time

from engine.bench.checks import at_least_one
from engine.bench.prompts import build_prompts

# forward before/after, process_logits, sample_after, step_end, detokenize, detokenize_after, ...
HOOK_SITES_PER_STEP = 11


def add_args(p: argparse.ArgumentParser) -> None:
    """--plugin-rounds is the tracing workload's too."""
    p.add_argument("--plugin-dtype", default="auto", help="plugins workload: engine dtype")
    p.add_argument(
        "--plugin-rounds",
        type=int,
        default=3,
        help="plugins and tracing workloads: rounds per configuration",
    )
    p.add_argument(
        "--plugin-new-tokens", type=int, default=64, help="plugins workload: new tokens per request"
    )


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    at_least_one(p, args, "plugin_rounds", "plugin_new_tokens")


def throughput(eng, prompts: list[list[int]], new_tokens: int) -> float:
    params = {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}
    eng.flush_cache()
    t0 = time.perf_counter()
    outs = eng.generate(input_ids=prompts, sampling_params=params)
    return sum(o["meta_info"]["completion_tokens"] for o in outs) / (time.perf_counter() - t0)


def hook_cost(args: argparse.Namespace) -> dict:
    from engine import Engine, hooks

    rates: dict[str, list[float]] = {"none": [], "noop": []}
    with (
        Engine(dtype=args.plugin_dtype, plugins="") as plain,
        Engine(dtype=args.plugin_dtype, plugins="noop") as noop,
    ):
        prompts = build_prompts(
            plain.tokenizer, args.num_prompts, args.min_len, args.max_len, args.seed
        )
        warm = [p[::-1][:32] for p in prompts[:2]]
        for eng in (plain, noop):
            eng.generate(input_ids=warm, sampling_params={"max_new_tokens": 4})
        for r in range(args.plugin_rounds):
            for label, eng in (
                (("none", plain), ("noop", noop))
                if r % 2 == 0
                else (("noop", noop), ("none", plain))
            ):
                print(f"[plugins] hook cost round {r + 1}: {label} ...", flush=True)
                rates[label].append(throughput(eng, prompts, args.plugin_new_tokens))
        steps = plain.get_stats()["decode_steps"] + plain.get_stats()["prefill_steps"]
    n = 200_000
    t0 = time.perf_counter()
    for _ in range(n):
        hooks.has("engine_forward_before")
    per_check = (time.perf_counter() - t0) / n
    # one call through pluggy's hook caller to noop's (still loaded in this process) implementation
    t0 = time.perf_counter()
    for _ in range(n // 10):
        hooks.call("engine_forward_before", batch=None, rids=[])
    per_call = (time.perf_counter() - t0) / (n // 10)
    none, with_noop = statistics.median(rates["none"]), statistics.median(rates["noop"])
    return {
        "rounds": args.plugin_rounds,
        "tokens_per_s": rates,
        "median_none": none,
        "median_noop": with_noop,
        "noop_loss_pct": 100 * (1 - with_noop / none),
        "empty_check_ns": per_check * 1e9,
        "noop_call_ns": per_call * 1e9,
        "hook_sites_per_step": HOOK_SITES_PER_STEP,
        "steps_timed": steps,
    }


def _beam_search(
    eng, prompt: list[int], width: int, rounds: int, new_tokens: int, seed: int
) -> tuple[float, int]:
    candidates = [[] for _ in range(width)]
    t0 = time.perf_counter()
    tokens = 0
    for r in range(rounds):
        params = [
            {
                "max_new_tokens": new_tokens,
                "temperature": 1.0,
                "seed": seed + 1000 * r + i,
                "ignore_eos": True,
            }
            for i in range(width)
        ]
        outs = eng.generate(
            input_ids=[prompt + c for c in candidates], sampling_params=params, return_logprob=True
        )
        candidates = [c + o["output_ids"] for c, o in zip(candidates, outs)]
        tokens += sum(len(o["output_ids"]) for o in outs)
    return time.perf_counter() - t0, tokens


def skipdetok_saving(args: argparse.Namespace) -> dict:
    import psutil

    from engine import Engine

    results: dict[str, dict] = {}
    with (
        Engine(dtype=args.plugin_dtype, plugins="") as plain,
        Engine(dtype=args.plugin_dtype, plugins="skipdetok") as skip,
    ):
        (prompt,) = build_prompts(plain.tokenizer, 1, 120, 120, args.seed + 7)
        engines = {"decode": plain, "skipdetok": skip}
        for eng in engines.values():
            _beam_search(eng, prompt, 8, 1, 2, 0)  # warm-up
        for trial in range(args.plugin_rounds):
            for label, eng in (
                engines.items() if trial % 2 == 0 else reversed(list(engines.items()))
            ):
                print(f"[plugins] beam search trial {trial + 1}: {label} ...", flush=True)
                detok = psutil.Process(eng.pids["detokenizer"])
                cpu0 = sum(detok.cpu_times()[:2])
                wall, tokens = _beam_search(eng, prompt, 200, 10, 3, trial)
                cpu = sum(detok.cpu_times()[:2]) - cpu0
                entry = results.setdefault(
                    label, {"wall_s": [], "detokenizer_cpu_s": [], "tokens": tokens}
                )
                entry["wall_s"].append(wall)
                entry["detokenizer_cpu_s"].append(cpu)
    decode, skipped = results["decode"], results["skipdetok"]
    wall_decode, wall_skip = (
        statistics.median(decode["wall_s"]),
        statistics.median(skipped["wall_s"]),
    )
    return {
        "workload": {
            "candidates": 200,
            "new_tokens": 3,
            "rounds": 10,
            "prompt_tokens": len(prompt),
        },
        "runs": results,
        "median_wall_decode_s": wall_decode,
        "median_wall_skipdetok_s": wall_skip,
        "wall_saved_pct": 100 * (1 - wall_skip / wall_decode),
        "detokenizer_cpu_saved_pct": 100
        * (
            1
            - statistics.median(skipped["detokenizer_cpu_s"])
            / statistics.median(decode["detokenizer_cpu_s"])
        ),
    }


def run_plugins(args: argparse.Namespace) -> dict:
    return {"hook_cost": hook_cost(args), "skipdetok": skipdetok_saving(args)}


def print_plugins(r: dict) -> None:
    c, s = r["hook_cost"], r["skipdetok"]
    print("\nplugins: hook cost (throughput workload, median of rounds)")
    print(
        f"  no plugin                   {c['median_none']:10.1f} tok/s   "
        f"rounds {['%.1f' % x for x in c['tokens_per_s']['none']]}"
    )
    print(
        f"  noop on every hook          {c['median_noop']:10.1f} tok/s   "
        f"rounds {['%.1f' % x for x in c['tokens_per_s']['noop']]}"
    )
    print(f"  loss with noop              {c['noop_loss_pct']:9.1f}%")
    print(f"  empty call site             {c['empty_check_ns']:9.0f} ns per has() check")
    print(
        f"  call site with noop         {c['noop_call_ns']:9.0f} ns per call (pluggy's caller, one implementation)"
    )
    print("plugins: skipdetok on a user-side beam search (200 candidates x 3 tokens x 10 rounds)")
    print(
        f"  wall, decoding              {s['median_wall_decode_s']:9.2f} s   "
        f"{['%.2f' % x for x in s['runs']['decode']['wall_s']]}"
    )
    print(
        f"  wall, skipdetok             {s['median_wall_skipdetok_s']:9.2f} s   "
        f"{['%.2f' % x for x in s['runs']['skipdetok']['wall_s']]}"
    )
    print(f"  wall saved                  {s['wall_saved_pct']:9.1f}%")
    print(f"  detokenizer CPU saved       {s['detokenizer_cpu_saved_pct']:9.1f}%", flush=True)
