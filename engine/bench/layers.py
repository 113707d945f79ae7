"""Layer taps' cost, side by side in one run: the throughput workload untapped, capturing, steered.

Why: a request that taps a layer takes the batch off the fused decode path (the rows of every layer
must exist in Python), and capture also carries the states back to the user. One engine serves every
configuration (taps and steering are per request), the configurations alternating round after round
on the same prompts (the throughput workload's: --num-prompts, --min-len, --max-len, --seed), every
request generating exactly --max-new-tokens (EOS ignored), the prefix cache flushed before each run:

- none: no request taps anything (the fused decode path, where the table chose it);
- capture last: every request returns the last layer's state at the prompt's last token (prefill only);
- capture generated: every request returns the last layer's state for each generated token;
- steer: every request adds a small seeded random vector to the residual stream after the middle layer.

    python -m engine.bench --workload layers
"""

from __future__ import annotations

import argparse
import statistics
import time

from engine.bench.checks import at_least_one
from engine.bench.prompts import build_prompts

BASELINE = "none"
CONFIGS: tuple[str, ...] = (BASELINE, "capture last", "capture generated", "steer")
STEER_SCALE = 1.0
STEER_STD = (
    0.01  # per entry: a vector of norm about 0.24 on SmolLM2's 576, small beside its residuals
)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--layers-dtype", default="auto", help="layers workload: engine dtype")
    p.add_argument(
        "--layers-rounds",
        type=int,
        default=3,
        help="layers workload: alternating rounds, one timed run of every configuration each",
    )


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    at_least_one(p, args, "layers_rounds")


def steering_vector(hidden: int, seed: int) -> list[float]:
    """A seeded random vector of the model's hidden size."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(hidden, generator=gen) * STEER_STD).tolist()


def request_kwargs(config: str, hidden: int, num_layers: int, seed: int) -> dict:
    """The generate() keyword arguments that make every request of the batch tap as config says."""
    if config == BASELINE:
        return {}
    if config == "capture last":
        return {"return_hidden_states": {"layers": [-1], "tokens": "last"}}
    if config == "capture generated":
        return {"return_hidden_states": {"layers": [-1], "tokens": "generated"}}
    if config == "steer":
        vector = steering_vector(hidden, seed)
        return {"steering": [{"layer": num_layers // 2, "vector": vector, "scale": STEER_SCALE}]}
    raise ValueError(f"unknown layers configuration {config!r}")


def timed_run(eng, prompts: list[list[int]], new_tokens: int, kwargs: dict) -> dict:
    """One generate over every prompt; tokens/s over its wall time, and what came back."""
    params = {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}
    eng.flush_cache()
    t0 = time.perf_counter()
    outs = eng.generate(input_ids=prompts, sampling_params=params, **kwargs)
    wall = time.perf_counter() - t0
    counts = [o["meta_info"]["completion_tokens"] for o in outs]
    states = [o["meta_info"].get("hidden_states") for o in outs]
    rows = sum(
        s[part].shape[1] for s in states if s for part in ("prompt", "generated") if part in s
    )
    return {
        "tokens": sum(counts),
        "short": sum(c != new_tokens for c in counts),
        "state_rows": rows,
        "tokens_per_s": sum(counts) / wall,
    }


def run_layers(args: argparse.Namespace) -> dict:
    from engine import Engine

    with Engine(dtype=args.layers_dtype) as eng:
        return measure(eng, args)


def measure(eng, args: argparse.Namespace) -> dict:
    """Every configuration on eng, a warm-up of each, then --layers-rounds rounds; the order turns
    round every other round, so no configuration always runs first or last."""
    info = eng.server_info
    hidden, num_layers = info["hidden_size"], info["num_layers"]
    prompts = build_prompts(eng.tokenizer, args.num_prompts, args.min_len, args.max_len, args.seed)
    kwargs = {c: request_kwargs(c, hidden, num_layers, args.seed) for c in CONFIGS}
    warm = [p[::-1][:32] for p in prompts[:2]]  # not a prefix of any timed prompt
    for config in CONFIGS:
        timed_run(eng, warm, 4, kwargs[config])
    rates: dict[str, list[float]] = {c: [] for c in CONFIGS}
    last: dict[str, dict] = {}
    for r in range(args.layers_rounds):
        for config in CONFIGS if r % 2 == 0 else CONFIGS[::-1]:
            print(f"[layers] round {r + 1}: {config} ...", flush=True)
            last[config] = timed_run(eng, prompts, args.max_new_tokens, kwargs[config])
            rates[config].append(last[config]["tokens_per_s"])
    medians = {c: statistics.median(rates[c]) for c in CONFIGS}
    return {
        "dtype": info["dtype"],
        "decode_path": info["decode_path"].split(":")[0],
        "num_prompts": len(prompts),
        "prompt_tokens": sum(len(p) for p in prompts),
        "max_new_tokens": args.max_new_tokens,
        "rounds": args.layers_rounds,
        "steer": {"layer": num_layers // 2, "scale": STEER_SCALE, "std": STEER_STD},
        "tokens_per_s": rates,
        "median": medians,
        "ratio": {c: medians[c] / medians[BASELINE] for c in CONFIGS},
        "tokens": {c: last[c]["tokens"] for c in CONFIGS},
        "short_requests": {c: last[c]["short"] for c in CONFIGS},
        "state_rows": {c: last[c]["state_rows"] for c in CONFIGS},
    }


def print_layers(r: dict) -> None:
    print(
        f"\nlayers: throughput workload ({r['num_prompts']} prompts, {r['prompt_tokens']} prompt tokens, "
        f"{r['max_new_tokens']} new each), {r['dtype']}, median of {r['rounds']} alternating rounds"
    )
    print(f"  decode path the engine chose: {r['decode_path']} (taken while no request taps)")
    for config in CONFIGS:
        runs = ["%.1f" % x for x in r["tokens_per_s"][config]]
        print(
            f"  {config:<20}{r['median'][config]:10.1f} tok/s {r['ratio'][config]:7.3f}x   rounds {runs}"
        )
    s = r["steer"]
    print(
        f"  (capture: layer -1, resid_post; steer: layer {s['layer']}, a random vector of std {s['std']}, "
        f"scale {s['scale']}; ratios are medians over the none row's)"
    )
    short = {c: n for c, n in r["short_requests"].items() if n}
    if short:
        print(f"  warning: requests without exactly {r['max_new_tokens']} tokens: {short}")
    print(f"  hidden-state rows returned: {r['state_rows']}", flush=True)
