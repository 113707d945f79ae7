"""Throughput workload: the engine against transformers `generate` and the machine's matmul bound.

Why: a tokens/s figure alone says little. Side by side in one run (this machine is shared, so figures
move from run to run) it shows how the engine compares with a plain transformers baseline on the same
workload and dtype, and how far it is from what the machine's matrix-multiply rate allows at the
model's own shapes. The workload is deterministic: seeded windows of standard-library docstrings
(engine/bench/prompts.py), one batch of requests, every request generating exactly --max-new-tokens.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from engine.bench.checks import TORCH_DTYPES, batch_sizes
from engine.bench.prompts import build_prompts

PREFILL_M = 512  # rows of the prefill matmuls: a few hundred prompt tokens in one step


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--dtypes",
        default="float32,bfloat16",
        help="comma-separated dtypes to run: float32, bfloat16",
    )
    p.add_argument(
        "--hf-batch-size",
        default="64,16",
        help="static batch sizes for transformers generate, comma-separated: each is run on the prompts "
        "sorted by length (its kindest batching) and the fastest is reported",
    )
    p.add_argument("--skip-hf", action="store_true", help="skip the transformers baseline")


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Turns --dtypes into a list."""
    args.dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    bad = [d for d in args.dtypes if d not in TORCH_DTYPES]
    if bad or not args.dtypes:
        p.error(f"--dtypes must list some of {sorted(TORCH_DTYPES)}, got {bad or 'nothing'}")
    batch_sizes(p, "--hf-batch-size", args.hf_batch_size)


def run_engine(dtype: str, args: argparse.Namespace, prompts: list[list[int]] | None):
    """Start an engine, warm it up, time one generate over all prompts. Returns (figures, prompts, model_dir)."""
    from engine import Engine

    eng = Engine(dtype=dtype, device="cpu")  # the baselines run on the CPU
    try:
        if prompts is None:
            prompts = build_prompts(
                eng.tokenizer, args.num_prompts, args.min_len, args.max_len, args.seed
            )
        params = {"max_new_tokens": args.max_new_tokens, "temperature": 0, "ignore_eos": True}
        warm = [p[::-1][:32] for p in prompts[:2]]  # not a prefix of any timed prompt
        eng.generate(input_ids=warm, sampling_params={**params, "max_new_tokens": 4})
        t0 = time.perf_counter()
        outs = eng.generate(input_ids=prompts, sampling_params=params)
        wall = time.perf_counter() - t0
        model_dir = eng.model_dir
    finally:
        eng.shutdown()
    counts = [o["meta_info"]["completion_tokens"] for o in outs]
    short = sum(c != args.max_new_tokens for c in counts)
    if short:
        print(
            f"  warning: engine returned {short} requests without exactly {args.max_new_tokens} tokens",
            flush=True,
        )
    tokens = sum(counts)
    return (
        {"generated_tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall},
        prompts,
        model_dir,
    )


def run_transformers(
    dtype: str, args: argparse.Namespace, prompts: list[list[int]], model_dir: str
) -> dict:
    """transformers generate (sdpa, greedy, left padding) in static batches; tokens over the whole wall time."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=getattr(torch, dtype), attn_implementation="sdpa"
    )
    model.eval()
    pad = tok.eos_token_id
    gen = {
        "do_sample": False,
        "pad_token_id": pad,
        "max_new_tokens": args.max_new_tokens,
        "min_new_tokens": args.max_new_tokens,
    }

    def batch_generate(batch: list[list[int]], new_tokens: int) -> int:
        enc = tok.pad({"input_ids": batch}, padding=True, return_tensors="pt")
        with torch.inference_mode():
            out = model.generate(
                **enc, **{**gen, "max_new_tokens": new_tokens, "min_new_tokens": new_tokens}
            )
        return (out.shape[1] - enc["input_ids"].shape[1]) * out.shape[0]

    # length-sorted batches pad least: transformers' kindest
    ordered, runs = (
        sorted(prompts, key=len),
        [],
    )
    for size in hf_batch_sizes(args):
        batch_generate([p[::-1][:32] for p in ordered[:size]], 2)  # warm-up at this size, untimed
        t0 = time.perf_counter()
        tokens = sum(
            batch_generate(ordered[i : i + size], args.max_new_tokens)
            for i in range(0, len(ordered), size)
        )
        wall = time.perf_counter() - t0
        runs.append(
            {
                "generated_tokens": tokens,
                "wall_s": wall,
                "tokens_per_s": tokens / wall,
                "setting": f"length-sorted batches of {size}",
            }
        )
    return {**max(runs, key=lambda r: r["tokens_per_s"]), "all_batch_sizes": runs}


def hf_batch_sizes(args: argparse.Namespace) -> list[int]:
    return [int(s) for s in str(args.hf_batch_size).split(",") if s.strip()]


def linear_shapes(cfg: dict) -> list[tuple[int, int]]:
    """(in_features, out_features) of one decoder layer's linear layers: q, k, v, o, gate, up, down."""
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    heads, kv = (
        cfg["num_attention_heads"],
        cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
    )
    hd = cfg.get("head_dim") or h // heads
    return [
        (h, heads * hd),
        (h, kv * hd),
        (h, kv * hd),
        (heads * hd, h),
        (h, inter),
        (h, inter),
        (inter, h),
    ]


def matmul_rate(shapes: list[tuple[int, int]], m: int, dtype: torch.dtype, reps: int = 7) -> float:
    """FLOP/s of [m, k] x [k, n] products summed over shapes; per shape the best of reps timed loops.

    Each loop runs enough products to last about 20 ms, so one late thread wake-up on this shared
    machine does not decide the figure; the best loop is kept because the bound is an upper bound.
    """
    flops, seconds = 0.0, 0.0
    for k, n in shapes:
        a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
        t0 = time.perf_counter()
        for _ in range(3):  # warm-up, and a first estimate of one product's time
            torch.matmul(a, b)
        calls = max(1, int(0.02 / ((time.perf_counter() - t0) / 3)))
        best = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            for _ in range(calls):
                torch.matmul(a, b)
            best = min(best, (time.perf_counter() - t0) / calls)
        flops += 2.0 * m * k * n
        seconds += best
    return flops / seconds


def machine_bound(
    dtype: str, args: argparse.Namespace, prompts: list[list[int]], model_dir: str
) -> dict:
    """Tokens/s the measured matmul rates allow for this workload (linear layers only, attention ignored)."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    layers, h, vocab = cfg["num_hidden_layers"], cfg["hidden_size"], cfg["vocab_size"]
    shapes = linear_shapes(cfg)
    layer_flops = 2.0 * sum(k * n for k, n in shapes) * layers  # per token through all layers
    head_flops = 2.0 * h * vocab  # lm_head, per token that needs logits
    tdtype = getattr(torch, dtype)
    prefill_rate = matmul_rate(shapes, PREFILL_M, tdtype)
    decode_rate = matmul_rate(shapes + [(h, vocab)], len(prompts), tdtype)
    n_prompt_tokens = sum(len(p) for p in prompts)
    generated = len(prompts) * args.max_new_tokens
    # The prefill step yields each request's first token; the other max_new_tokens - 1 come from decode steps.
    prefill_flops = n_prompt_tokens * layer_flops + len(prompts) * head_flops
    decode_flops = len(prompts) * (args.max_new_tokens - 1) * (layer_flops + head_flops)
    bound_s = prefill_flops / prefill_rate + decode_flops / decode_rate
    return {
        "prefill_matmul_gflops": prefill_rate / 1e9,
        "prefill_m": PREFILL_M,
        "decode_matmul_gflops": decode_rate / 1e9,
        "decode_m": len(prompts),
        "prefill_gflop": prefill_flops / 1e9,
        "decode_gflop": decode_flops / 1e9,
        "gflop_per_decode_token": (layer_flops + head_flops) / 1e9,
        "bound_s": bound_s,
        "tokens_per_s": generated / bound_s,
        "note": "linear layers and lm_head only; attention FLOPs, norms, rotary and sampling are ignored",
    }


def print_table(dtype: str, r: dict) -> None:
    eng, hf, bound = (
        r["engine"]["tokens_per_s"],
        r.get("transformers", {}).get("tokens_per_s"),
        r["bound"],
    )
    rows = [
        ("engine tokens/s", f"{eng:10.1f}"),
        ("transformers tokens/s", f"{hf:10.1f}" if hf else "   skipped"),
        ("engine / transformers", f"{eng / hf:10.2f}" if hf else "         -"),
        ("bound tokens/s", f"{bound['tokens_per_s']:10.1f}"),
        ("engine % of bound", f"{100 * eng / bound['tokens_per_s']:9.1f}%"),
        (
            f"prefill matmul GFLOP/s (M={bound['prefill_m']})",
            f"{bound['prefill_matmul_gflops']:10.1f}",
        ),
        (
            f"decode matmul GFLOP/s (M={bound['decode_m']})",
            f"{bound['decode_matmul_gflops']:10.1f}",
        ),
    ]
    print(f"\n{dtype}")
    for name, value in rows:
        print(f"  {name:<34}{value}")
    print(f"  (bound: {bound['note']})", flush=True)


def run_throughput(args: argparse.Namespace) -> dict:
    """Each dtype in turn, its table printed as it ends; returns the report's workload and results."""
    results: dict[str, dict] = {}
    prompts: list[list[int]] | None = None
    for dtype in args.dtypes:
        print(f"[{dtype}] engine ...", flush=True)
        r: dict = {}
        r["engine"], prompts, model_dir = run_engine(dtype, args, prompts)
        if not args.skip_hf:
            print(f"[{dtype}] transformers ...", flush=True)
            r["transformers"] = run_transformers(dtype, args, prompts, model_dir)
            r["engine_over_transformers"] = (
                r["engine"]["tokens_per_s"] / r["transformers"]["tokens_per_s"]
            )
        print(f"[{dtype}] matmul bound ...", flush=True)
        r["bound"] = machine_bound(dtype, args, prompts, model_dir)
        r["engine_pct_of_bound"] = 100 * r["engine"]["tokens_per_s"] / r["bound"]["tokens_per_s"]
        results[dtype] = r
        print_table(dtype, r)
    lens = [len(p) for p in prompts or []]
    workload = (
        {
            "num_prompts": len(lens),
            "prompt_tokens": sum(lens),
            "min_len": min(lens),
            "max_len": max(lens),
            "max_new_tokens": args.max_new_tokens,
            "seed": args.seed,
            "hf_batch_sizes": hf_batch_sizes(args),
        }
        if lens
        else None
    )
    return {"workload": workload, "results": results}
