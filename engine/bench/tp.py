"""TP=1 against TP=2 in one run (docs/tensor-parallel.md): the same engine settings and prompts, one
after the other on the same cores. On a machine of few cores this measures what the collectives
cost (each rank gets cores / tp threads), not a speed-up.

    python -m engine.bench.tp [--quantization none|gguf|gguf-q8|int8] [--new-tokens 64]
"""

from __future__ import annotations

import argparse
import time

from engine.bench.machine import machine_line
from engine.bench.prompts import PARITY_PROMPTS


def measure(
    tp: int,
    quantization: str,
    new_tokens: int,
    overrides: dict | None = None,
    reduce_like: int = 0,
) -> dict:
    """Batch and single-request decode throughput of one engine with tp_size=tp (and reduce_like_tp)."""
    from engine import Engine

    params = {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}
    prompts = list(PARITY_PROMPTS) * 2
    with Engine(
        quantization=quantization,
        max_total_tokens=8192,
        tp_size=tp,
        kernel_overrides=overrides or {},
        reduce_like_tp=reduce_like,
    ) as eng:
        eng.generate(prompts[0], {"max_new_tokens": 4, "temperature": 0})  # warm
        eng.flush_cache()
        t0 = time.perf_counter()
        outs = eng.generate(prompts, params)
        batch = time.perf_counter() - t0
        tokens = sum(len(o["output_ids"]) for o in outs)
        eng.flush_cache()
        t0 = time.perf_counter()
        one = eng.generate(prompts[1], params)
        single = time.perf_counter() - t0
        return {
            "batch_requests": len(prompts),
            "batch_seconds": batch,
            "batch_tokens_per_s": tokens / batch,
            "single_tokens_per_s": len(one["output_ids"]) / single,
            "decode_path": eng.server_info["decode_path"].split(":")[0],
        }


def tp_rows(quantization: str = "none", new_tokens: int = 64) -> dict:
    """TP=1 as the table chooses, TP=1 on the plain forward (the decode path TP=2 must take: the
    collectives' own cost is the difference to it), TP=1 summing like two ranks (reduce_like_tp=2:
    bitwise TP=2's outputs), and TP=2."""
    return {
        "TP=1": measure(1, quantization, new_tokens),
        "TP=1 plain": measure(1, quantization, new_tokens, {"fused-decode": "off"}),
        "TP=1 like 2": measure(1, quantization, new_tokens, reduce_like=2),
        "TP=2": measure(2, quantization, new_tokens),
    }


def print_rows(rows: dict) -> None:
    print(f"  {'':<12}{'batch tok/s':>12}{'1 request tok/s':>17}  decode path")
    for name, m in rows.items():
        print(
            f"  {name:<12}{m['batch_tokens_per_s']:12.1f}{m['single_tokens_per_s']:17.1f}"
            f"  {m['decode_path']}"
        )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m engine.bench.tp", description=__doc__)
    p.add_argument("--quantization", default="none", choices=("none", "gguf", "gguf-q8", "int8"))
    p.add_argument("--new-tokens", type=int, default=64)
    args = p.parse_args(argv)
    print(machine_line(), flush=True)
    rows = tp_rows(args.quantization, args.new_tokens)
    print(
        f"\n{len(PARITY_PROMPTS) * 2} requests x {args.new_tokens} tokens, quantization "
        f"{args.quantization}, float32"
    )
    print_rows(rows)


if __name__ == "__main__":
    main()
