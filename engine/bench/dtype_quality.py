"""Quality of each dtype of the exact mode against transformers in float32, beside transformers' own.

Why: a dtype is worth its speed only with its quality known, and the fair bar for the engine in
bfloat16 is transformers in bfloat16. In one run, for the engine and for transformers in each dtype:
perplexity on held-out text (engine/bench/quality.py's windows) and greedy agreement with transformers'
float32 (each prompt alone, no padding) on held-out prompts, half plain text, half chat turns.

    python -m engine.bench --workload dtype-quality
"""

from __future__ import annotations

import argparse
import math
import time

from engine.bench.quality import HELD_OUT_MODULES, agreement, held_out_windows, prompt_perplexity
from engine.bench.prompts import build_corpus

PROMPT_TOKENS = 48  # each held-out prompt's window of text


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--dtype-quality-prompts",
        type=int,
        default=32,
        help="dtype-quality workload: held-out prompts",
    )
    p.add_argument(
        "--dtype-quality-new-tokens",
        type=int,
        default=64,
        help="dtype-quality workload: greedy tokens per prompt (at most; EOS ends one)",
    )


def held_out_prompts(tokenizer, count: int, skip: int) -> list[list[int]]:
    """count prompts from the held-out text past its first `skip` tokens (the perplexity windows): even ones
    the window as it is, odd ones a chat turn asking about it."""
    ids = tokenizer.encode(build_corpus(HELD_OUT_MODULES), add_special_tokens=False)[skip:]
    if len(ids) < count * PROMPT_TOKENS:
        raise ValueError(
            f"held-out text has {len(ids)} tokens past the windows, fewer than {count} x {PROMPT_TOKENS}"
        )
    prompts = []
    for i in range(count):
        window = ids[i * PROMPT_TOKENS : (i + 1) * PROMPT_TOKENS]
        if i % 2 == 0:
            prompts.append(window)
            continue
        turn = [
            {"role": "user", "content": "What does this text say?\n\n" + tokenizer.decode(window)}
        ]
        text = tokenizer.apply_chat_template(turn, add_generation_prompt=True, tokenize=False)
        prompts.append(tokenizer.encode(text, add_special_tokens=False))
    return prompts


def transformers_run(
    model_dir: str, dtype: str, prompts: list[list[int]], windows: list[list[int]], new_tokens: int
) -> dict:
    """transformers' greedy outputs (one prompt at a time, stopping at EOS) and perplexity on the windows."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=getattr(torch, dtype), attn_implementation="sdpa"
    )
    model.eval()
    t0 = time.perf_counter()
    outputs = []
    with torch.inference_mode():
        for p in prompts:
            out = model.generate(torch.tensor([p]), do_sample=False, max_new_tokens=new_tokens)
            outputs.append(out[0, len(p) :].tolist())
        nll = count = 0.0
        for w in windows:
            logits = model(torch.tensor([w])).logits[0, :-1].float()
            nll += float(
                torch.nn.functional.cross_entropy(logits, torch.tensor(w[1:]), reduction="sum")
            )
            count += len(w) - 1
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    outputs = [
        o[: o.index(t) + 1] if (t := next((x for x in o if x in eos), None)) is not None else o
        for o in outputs
    ]
    return {
        "greedy": outputs,
        "perplexity": math.exp(nll / count),
        "seconds": time.perf_counter() - t0,
    }


def engine_run(
    dtype: str, prompts: list[list[int]], windows: list[list[int]], new_tokens: int
) -> dict:
    """The engine's greedy outputs (all prompts in one batch) and perplexity on the windows, exact mode."""
    from engine import Engine

    with Engine(dtype=dtype, device="cpu") as eng:
        t0 = time.perf_counter()
        outs = eng.generate(
            input_ids=prompts, sampling_params={"max_new_tokens": new_tokens, "temperature": 0}
        )
        perplexity, _ = prompt_perplexity(eng, windows)
        kernels = eng.server_info.get("linear_layers")
    return {
        "greedy": [o["output_ids"] for o in outs],
        "perplexity": perplexity,
        "linear_layers": kernels,
        "seconds": time.perf_counter() - t0,
    }


def run_dtype_quality(args: argparse.Namespace) -> dict:
    from engine.bench.machine import machine_line
    from engine.model.resolve import resolve_model_dir
    from engine.tokenizer import load_hf_tokenizer

    model_dir = resolve_model_dir(None)
    tok = load_hf_tokenizer(model_dir)
    windows = held_out_windows(tok, args.quality_windows, args.quality_window_len)
    prompts = held_out_prompts(
        tok, args.dtype_quality_prompts, args.quality_windows * args.quality_window_len
    )
    n = args.dtype_quality_new_tokens
    runs: dict[str, dict] = {}
    for backend in ("transformers", "engine"):
        for dtype in ("float32", "bfloat16"):
            print(f"[dtype-quality] {backend} {dtype} ...", flush=True)
            run = (
                transformers_run(model_dir, dtype, prompts, windows, n)
                if backend == "transformers"
                else engine_run(dtype, prompts, windows, n)
            )
            runs[f"{backend} {dtype}"] = run
    reference, base = runs["transformers float32"], runs["engine float32"]["perplexity"]
    rows = {
        name: {
            "perplexity": r["perplexity"],
            "perplexity_vs_engine_float32_pct": 100 * (r["perplexity"] / base - 1),
            **agreement(reference["greedy"], r["greedy"]),
            "seconds": r["seconds"],
            **({"linear_layers": r["linear_layers"]} if "linear_layers" in r else {}),
        }
        for name, r in runs.items()
    }
    return {
        "machine": machine_line(),
        "prompts": len(prompts),
        "new_tokens": n,
        "windows": args.quality_windows,
        "window_len": args.quality_window_len,
        "rows": rows,
    }


def print_dtype_quality(r: dict) -> None:
    print(
        f"\ndtype quality against transformers float32 ({r['prompts']} held-out prompts, "
        f"greedy up to {r['new_tokens']} "
        f"tokens; perplexity on {r['windows']} x {r['window_len']} held-out tokens)\n  {r['machine']}"
    )
    print(
        f"  {'backend':<24}{'perplexity':>11}{'vs engine f32':>15}{'token agreement':>17}{'mean prefix':>13}"
        f"{'identical':>11}"
    )
    for name, m in r["rows"].items():
        print(
            f"  {name:<24}{m['perplexity']:11.3f}{m['perplexity_vs_engine_float32_pct']:14.2f}%"
            f"{100 * m['token_agreement']:16.1f}%{m['mean_identical_prefix']:13.1f}"
            f"{m['identical_outputs']:>7}/{m['outputs']}"
        )
