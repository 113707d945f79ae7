"""Throughput benchmark: the engine against transformers `generate` and against the machine's matmul bound.

The command: the shared arguments, the workload table (each workload's arguments, run and table
live in its own module) and the dispatch.

    python -m engine.bench                                  # everything: both dtypes, every workload
    python -m engine.bench --workload shared-prefix         # prefix cache on against off only
    python -m engine.bench --workload tracing               # tracing off against on
    python -m engine.bench --workload serve                 # engine serve against in-process streams
    python -m engine.bench --workload beam                  # native beam search against a client loop, transformers
    python -m engine.bench --workload grammar               # one JSON schema against the same requests unconstrained
    python -m engine.bench --workload cpu                   # start-up, memory, one stream, batch
    python -m engine.bench --workload quality               # each quantization against the exact weights
    python -m engine.bench --workload dtype-quality         # float32 and bfloat16 against transformers' float32
    python -m engine.bench --workload logits-head           # bfloat16 logits against float32 ones, the lm_head alone
    python -m engine.bench --workload soak                  # the stress crowd for many rounds: leaks, memory slope
    python -m engine.bench --workload scale                 # one replica against two behind the gateway
    python -m engine.bench --workload layers                # untapped against capture and steering
    python -m engine.bench --num-prompts 4 --max-new-tokens 8 --dtypes float32 --workload throughput  # smoke
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import platform
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.bench import (
    beam,
    cpu_speed,
    dtype_quality,
    grammar,
    layers,
    logits_head,
    plugins,
    quality,
    scale,
    serve,
    shared_prefix,
    soak,
    throughput,
    tracing,
)
from engine.bench.checks import at_least_one
from engine.bench.machine import machine_line

Args = Callable[[argparse.ArgumentParser], None]
Check = Callable[[argparse.ArgumentParser, argparse.Namespace], None]


@dataclass(frozen=True)
class Workload:
    """One side-by-side workload: its report section, run and table, and its own arguments."""

    name: str
    run: Callable[[argparse.Namespace], dict | None]
    show: Callable[[dict | None], None]
    add_args: Args | None = None
    check_args: Check | None = None
    in_all: bool = True  # False: slow, run only when asked by name
    key: str | None = None  # the report's section; the name by default


# run in this order after throughput; arguments listed in --help in this order after throughput's
WORKLOADS: tuple[Workload, ...] = (
    Workload(
        "shared-prefix",
        shared_prefix.run_shared_prefix,
        shared_prefix.print_shared_prefix,
        shared_prefix.add_args,
        shared_prefix.check_args,
        key="shared_prefix",
    ),
    Workload(
        "plugins", plugins.run_plugins, plugins.print_plugins, plugins.add_args, plugins.check_args
    ),
    Workload("tracing", tracing.run_tracing, tracing.print_tracing),  # plugins' arguments
    Workload("serve", serve.run_serve, serve.print_serve, serve.add_args, serve.check_args),
    Workload("beam", beam.run_beam, beam.print_beam, beam.add_args, beam.check_args),
    Workload(
        "grammar", grammar.run_grammar, grammar.print_grammar, grammar.add_args, grammar.check_args
    ),
    Workload(
        "cpu", cpu_speed.run_cpu, cpu_speed.print_cpu, cpu_speed.add_args, cpu_speed.check_args
    ),
    Workload("quality", quality.run_quality, quality.print_quality, quality.add_args),
    Workload(
        "dtype-quality",
        dtype_quality.run_dtype_quality,
        dtype_quality.print_dtype_quality,
        dtype_quality.add_args,
        in_all=False,
    ),
    Workload(
        "logits-head",
        logits_head.run_logits_head,
        logits_head.print_logits_head,
        logits_head.add_args,
    ),
    Workload("soak", soak.run_soak, soak.print_soak, soak.add_args, soak.check_args, in_all=False),
    Workload("scale", scale.run_scale, scale.print_scale, scale.add_args, in_all=False),
    Workload(
        "layers",
        layers.run_layers,
        layers.print_layers,
        layers.add_args,
        layers.check_args,
        in_all=False,
    ),
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m engine.bench",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--num-prompts",
        type=int,
        default=64,
        help="number of requests, all sent in one generate call",
    )
    p.add_argument("--min-len", type=int, default=32, help="shortest prompt, in tokens")
    p.add_argument("--max-len", type=int, default=512, help="longest prompt, in tokens")
    p.add_argument(
        "--max-new-tokens",
        type=int,
        default=128,
        help="tokens generated per request (EOS is ignored)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed for prompt lengths and corpus offsets")
    throughput.add_args(p)
    p.add_argument(
        "--out", default="bench-results/bench.json", help="where to write all figures as JSON"
    )
    p.add_argument(
        "--workload",
        choices=("all", "throughput", *(w.name for w in WORKLOADS)),
        default="all",
        help="throughput: mixed prompts against transformers and the bound; shared-prefix: cache on/off; "
        "plugins: hook cost (no plugin vs noop) and the skipdetok saving; tracing: off against on; "
        "serve: engine serve over HTTP against in-process streams; "
        "beam: native beam search against the client-side loop and transformers; "
        "grammar: requests under one JSON schema against the same requests unconstrained; "
        "cpu: start-up, memory, single stream and batch against transformers float32 and llama.cpp; "
        "quality: each quantization's perplexity and greedy agreement against the exact weights; "
        "dtype-quality: the exact mode and transformers in float32 and bfloat16 against "
        "transformers float32 (not in all); "
        "logits-head: a bfloat16 model's lm_head with bfloat16 logits against float32 ones; "
        "soak: the stress suite's crowd for many rounds, memory and descriptors per process (not in all); "
        "scale: one replica against two behind the smg gateway, round robin and cache-aware (not in all); "
        "layers: the throughput prompts untapped, capturing the last layer and steered (not in all)",
    )
    for w in WORKLOADS:
        if w.add_args:
            w.add_args(p)
    args = p.parse_args(argv)
    throughput.check_args(p, args)
    at_least_one(p, args, "num_prompts", "min_len", "max_len", "max_new_tokens")
    if args.min_len > args.max_len:
        p.error("--min-len must not exceed --max-len")
    if Path(args.out).is_dir():  # found at the end otherwise, after a run of up to half an hour
        p.error(f"--out must be the path of the JSON file to write, got the directory {args.out!r}")
    for w in WORKLOADS:
        if w.check_args:
            w.check_args(p, args)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    print(f"machine: {machine_line()}", flush=True)
    from engine.cores import usable_cores

    threads = usable_cores()
    torch.set_num_threads(threads)
    thr = {"workload": None, "results": {}}
    if args.workload in ("all", "throughput"):
        thr = throughput.run_throughput(args)
    sections: dict[str, dict | None] = {}
    for w in WORKLOADS:
        sections[w.key or w.name] = None
        if args.workload == w.name or (args.workload == "all" and w.in_all):
            sections[w.key or w.name] = w.run(args)
            w.show(sections[w.key or w.name])
    report = {
        "command": [
            sys.executable,
            "-m",
            "engine.bench",
            *(sys.argv[1:] if argv is None else argv),
        ],
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "threads": threads,
        "python": platform.python_version(),
        "machine": machine_line(),
        # the throughput workload's prompts (the others record their own settings in their sections)
        "workload": thr["workload"],
        "results": thr["results"],
        **sections,
    }
    with contextlib.suppress(ImportError):
        import transformers

        report["transformers"] = transformers.__version__
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
