"""Quality of each quantization against the exact weights, measured with the engine itself.

Why: a quantized mode is worth its speed only with its quality known. Two figures per mode, each in
the same run as the exact mode: greedy agreement (share of positions where the greedy tokens equal the
exact mode's, on the parity prompts, plain and through the chat template) and perplexity on held-out
text (standard-library docstrings of modules the throughput prompts do not use), from the prompt
logprobs the engine returns (logprob_start_len=0).

    python -m engine.bench --workload quality
"""

from __future__ import annotations

import argparse
import math
import time

from engine.bench.prompts import PARITY_PROMPTS, build_corpus

HELD_OUT_MODULES = (
    "statistics",
    "heapq",
    "bisect",
    "fractions",
    "string",
    "enum",
    "abc",
    "calendar",
    "difflib",
    "gzip",
    "hashlib",
    "ipaddress",
    "operator",
    "pprint",
    "random",
    "secrets",
)


def add_args(p: argparse.ArgumentParser) -> None:
    """The windows are the dtype-quality workload's too; the modes are --cpu-quantizations."""
    p.add_argument(
        "--quality-new-tokens",
        type=int,
        default=64,
        help="quality workload: greedy tokens per parity prompt",
    )
    p.add_argument(
        "--quality-windows",
        type=int,
        default=8,
        help="quality workload: held-out windows for perplexity",
    )
    p.add_argument(
        "--quality-window-len",
        type=int,
        default=512,
        help="quality workload: tokens per held-out window",
    )


def parity_inputs(tokenizer) -> list[list[int]]:
    """The parity prompts as the parity tests give them: even ones plain, odd ones through the chat template."""
    ids = []
    for i, p in enumerate(PARITY_PROMPTS):
        if i % 2 == 0:
            ids.append(tokenizer.encode(p))
        else:
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False
            )
            ids.append(tokenizer.encode(text, add_special_tokens=False))
    return ids


def held_out_windows(tokenizer, count: int, length: int) -> list[list[int]]:
    ids = tokenizer.encode(build_corpus(HELD_OUT_MODULES), add_special_tokens=False)
    if len(ids) < count * length:
        raise ValueError(f"held-out text has {len(ids)} tokens, fewer than {count} x {length}")
    return [ids[i * length : (i + 1) * length] for i in range(count)]


def measure(quantization: str, args: argparse.Namespace) -> dict:
    """Greedy outputs on the parity prompts and perplexity on the held-out windows, for one mode."""
    from engine import Engine

    with Engine(dtype="float32", quantization=quantization, device="cpu") as eng:
        t0 = time.perf_counter()
        prompts = parity_inputs(eng.tokenizer)
        greedy = eng.generate(
            input_ids=prompts,
            sampling_params={"max_new_tokens": args.quality_new_tokens, "temperature": 0},
        )
        windows = held_out_windows(eng.tokenizer, args.quality_windows, args.quality_window_len)
        perplexity, scored = prompt_perplexity(eng, windows)
        seconds = time.perf_counter() - t0
    return {
        "greedy": [o["output_ids"] for o in greedy],
        "perplexity": perplexity,
        "scored_tokens": scored,
        "seconds": seconds,
    }


def prompt_perplexity(engine, windows: list[list[int]]) -> tuple[float, int]:
    """Perplexity of the windows from the prompt logprobs the engine returns, and how many tokens it scored."""
    outs = engine.generate(
        input_ids=windows,
        sampling_params={"max_new_tokens": 1},
        return_logprob=True,
        logprob_start_len=0,
    )
    logprobs = [
        lp for o in outs for lp, _, _ in o["meta_info"]["input_token_logprobs"] if lp is not None
    ]
    return math.exp(-sum(logprobs) / len(logprobs)), len(logprobs)


def greedy_agreement(exact, other, prompts: list[list[int]], new_tokens: int) -> dict:
    """agreement() of two engines' greedy outputs on the same prompts."""
    greedy = {"max_new_tokens": new_tokens, "temperature": 0}
    a = [o["output_ids"] for o in exact.generate(input_ids=prompts, sampling_params=greedy)]
    b = [o["output_ids"] for o in other.generate(input_ids=prompts, sampling_params=greedy)]
    return agreement(a, b)


def agreement(exact: list[list[int]], other: list[list[int]]) -> dict:
    """Position by position share of equal tokens, and the mean length of the identical prefix."""
    same = total = 0
    prefixes = []
    for a, b in zip(exact, other):
        n = max(len(a), len(b))
        same += sum(x == y for x, y in zip(a, b))
        total += n
        k = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        prefixes.append(k)
    return {
        "token_agreement": same / total if total else 1.0,
        "mean_identical_prefix": sum(prefixes) / len(prefixes),
        "identical_outputs": sum(a == b for a, b in zip(exact, other)),
        "outputs": len(exact),
    }


def run_quality(args: argparse.Namespace) -> dict:
    modes = [m.strip() for m in args.cpu_quantizations.split(",") if m.strip()]
    base = measure("none", args)
    out: dict = {
        "new_tokens": args.quality_new_tokens,
        "windows": args.quality_windows,
        "window_len": args.quality_window_len,
        "modes": {"none": {"perplexity": base["perplexity"]}},
    }
    for mode in modes:
        if mode == "none":
            continue
        r = measure(mode, args)
        out["modes"][mode] = {
            "perplexity": r["perplexity"],
            "perplexity_change_pct": 100 * (r["perplexity"] / base["perplexity"] - 1),
            **agreement(base["greedy"], r["greedy"]),
        }
    out["scored_tokens"] = base["scored_tokens"]
    return out


def print_quality(r: dict) -> None:
    print(
        f"\nquality against the exact weights ({r['scored_tokens']} held-out tokens; greedy {r['new_tokens']} tokens "
        f"on the parity prompts)"
    )
    print(
        f"  {'mode':<8}{'perplexity':>12}{'change':>9}{'token agreement':>17}{'identical outputs':>19}"
    )
    for mode, m in r["modes"].items():
        if mode == "none":
            print(f"  {mode:<8}{m['perplexity']:12.3f}{'-':>9}{'-':>17}{'-':>19}")
        else:
            print(
                f"  {mode:<8}{m['perplexity']:12.3f}{m['perplexity_change_pct']:8.2f}%"
                f"{100 * m['token_agreement']:16.1f}%"
                f"{m['identical_outputs']:>15}/{m['outputs']}"
            )
