"""The cost of float32 logits in bfloat16: the model's lm_head with bfloat16 logits against Float32Head.

Why: a bfloat16 model computes its logits in float32 (engine/linear/f32_head.py); this times that head
against the bfloat16 layer the loader would otherwise pick here (our bf16 kernel, or oneDNN's packed one),
alternating, at a decode step's row counts, on the embedded model's shape (random weights).

    python -m engine.bench --workload logits-head
"""

from __future__ import annotations

import argparse
import statistics
import time

ROWS = (1, 4, 16, 64)
HIDDEN, VOCAB = 576, 49152  # SmolLM2-135M's lm_head


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--head-rounds",
        type=int,
        default=5,
        help="logits-head workload: alternating rounds per row count",
    )


def run_logits_head(args: argparse.Namespace) -> dict:
    import torch
    from torch import nn

    from engine.bench.machine import machine_line
    from engine.cores import usable_cores
    from engine.kernels.cpu import load_native
    from engine.linear import bf16
    from engine.linear.f32_head import Float32Head
    from engine.linear.onednn import PackedLinear, packing_available

    torch.set_num_threads(usable_cores())
    gen = torch.Generator().manual_seed(args.seed)
    linear = nn.Linear(HIDDEN, VOCAB, bias=False).requires_grad_(False)
    linear.weight.data = (torch.randn(VOCAB, HIDDEN, generator=gen) * 0.05).bfloat16()
    lib = load_native()
    if bf16.runs_here(lib):
        before = bf16.Bf16Linear(linear, lib)
    elif packing_available(torch.bfloat16, "cpu"):
        before = PackedLinear(linear)
    else:
        before = linear
    now = Float32Head(linear, lib)
    rows: dict[int, dict] = {}
    for m in ROWS:
        x = torch.randn(m, HIDDEN, generator=gen)
        xb = x.bfloat16()
        times: dict[str, list[float]] = {"bfloat16": [], "float32": []}
        for _ in range(args.head_rounds):
            for name, call in (
                ("bfloat16", lambda: before(xb).float()),
                ("float32", lambda: now(x)),
            ):
                call()
                t0 = time.perf_counter()
                for _ in range(10):
                    call()
                times[name].append((time.perf_counter() - t0) / 10 * 1e3)
        b, f = statistics.median(times["bfloat16"]), statistics.median(times["float32"])
        rows[m] = {"bfloat16_ms": b, "float32_ms": f, "ratio": f / b}
    return {
        "machine": machine_line(),
        "bfloat16_layer": type(before).__name__,
        "float32_head": now.extra_repr(),
        "rounds": args.head_rounds,
        "rows": rows,
    }


def print_logits_head(r: dict) -> None:
    print(
        f"\nlm_head {VOCAB} x {HIDDEN}: bfloat16 logits ({r['bfloat16_layer']}) against float32 ({r['float32_head']}), "
        f"median of {r['rounds']} rounds of 10 calls\n  {r['machine']}"
    )
    print(f"  {'rows':>6}{'bfloat16 ms':>14}{'float32 ms':>13}{'ratio':>8}")
    for m, row in r["rows"].items():
        print(f"  {m:>6}{row['bfloat16_ms']:14.2f}{row['float32_ms']:13.2f}{row['ratio']:7.2f}x")
