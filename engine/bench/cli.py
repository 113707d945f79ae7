"""Throughput benchmark: the engine against transformers `generate` and against the machine's matmul bound.

Why: a tokens/s figure alone says little. Side by side in one run (this machine is shared, so figures
move from run to run) it shows how the engine compares with a plain transformers baseline on the same
workload and dtype, and how far it is from what the machine's matrix-multiply rate allows at the
model's own shapes. The workload is deterministic: seeded windows of standard-library docstrings
(engine/bench/prompts.py), one batch of requests, every request generating exactly --max-new-tokens.

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
import time
from pathlib import Path

import torch

from engine.bench.beam import parse_shapes, print_beam, run_beam
from engine.bench.cpu_speed import print_cpu, run_cpu
from engine.bench.dtype_quality import print_dtype_quality, run_dtype_quality
from engine.bench.grammar import print_grammar, run_grammar
from engine.bench.layers import add_args as add_layers_args, print_layers, run_layers
from engine.bench.logits_head import print_logits_head, run_logits_head
from engine.bench.machine import machine_line
from engine.bench.prompts import build_prompts
from engine.bench.quality import print_quality, run_quality
from engine.bench.plugins import print_plugins, run_plugins
from engine.bench.scale import add_args as add_scale_args, print_scale, run_scale
from engine.bench.serve import print_serve, run_serve
from engine.bench.shared_prefix import print_shared_prefix, run_shared_prefix
from engine.bench.soak import print_soak, run_soak
from engine.bench.tracing import print_tracing, run_tracing

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
PREFILL_M = 512  # rows of the prefill matmuls: a few hundred prompt tokens in one step


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
    p.add_argument(
        "--out", default="bench-results/bench.json", help="where to write all figures as JSON"
    )
    p.add_argument(
        "--workload",
        choices=(
            "all",
            "throughput",
            "shared-prefix",
            "plugins",
            "tracing",
            "serve",
            "beam",
            "grammar",
            "cpu",
            "quality",
            "dtype-quality",
            "logits-head",
            "soak",
            "scale",
            "layers",
        ),
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
    add_scale_args(p)
    add_layers_args(p)
    p.add_argument(
        "--serve-concurrency", type=int, default=64, help="serve workload: concurrent streams"
    )
    p.add_argument("--serve-dtype", default="auto", help="serve workload: engine dtype")
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
    p.add_argument(
        "--beam-dtype", default="float32", help="beam workload: engine and transformers dtype"
    )
    p.add_argument(
        "--beam-shapes",
        default="8x32x4,200x3x1",
        help="beam workload: comma-separated beam width x new tokens x prompts",
    )
    p.add_argument(
        "--beam-prompt-len", type=int, default=32, help="beam workload: tokens in every prompt"
    )
    p.add_argument(
        "--beam-rounds",
        type=int,
        default=2,
        help="beam workload: timed runs per path (the best is kept)",
    )
    p.add_argument(
        "--beam-eos",
        action="store_true",
        help="beam workload: EOS ends hypotheses (default: ignored)",
    )
    p.add_argument("--grammar-dtype", default="float32", help="grammar workload: engine dtype")
    p.add_argument(
        "--grammar-prompts",
        type=int,
        default=64,
        help="grammar workload: requests, all in one generate call",
    )
    p.add_argument(
        "--grammar-rounds",
        type=int,
        default=2,
        help="grammar workload: timed runs per mode, constrained and unconstrained (the best is kept)",
    )
    p.add_argument(
        "--cpu-quantizations",
        default="none,int8,gguf,gguf-q8",
        help="cpu workload: engine quantization modes, one engine each; mode@dtype for a dtype other than auto "
        "(none@float32,none@bfloat16)",
    )
    p.add_argument(
        "--cpu-prompt-len", type=int, default=128, help="cpu workload: single-stream prompt tokens"
    )
    p.add_argument(
        "--cpu-new-tokens",
        type=int,
        default=256,
        help="cpu workload: single-stream new tokens (EOS ignored)",
    )
    p.add_argument(
        "--cpu-hf-batch-sizes",
        default="64,16",
        help="cpu workload: transformers batch sizes to try on the batch workload (the best is kept)",
    )
    p.add_argument("--cpu-skip-hf", action="store_true", help="cpu workload: skip transformers")
    p.add_argument(
        "--cpu-engine-again",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="cpu workload: the first engine mode again after the baselines (A, B, A: how far this "
        "machine's speed moved between the runs each ratio compares)",
    )
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
    p.add_argument(
        "--head-rounds",
        type=int,
        default=5,
        help="logits-head workload: alternating rounds per row count",
    )
    p.add_argument(
        "--quality-window-len",
        type=int,
        default=512,
        help="quality workload: tokens per held-out window",
    )
    p.add_argument("--cpu-skip-llama", action="store_true", help="cpu workload: skip llama.cpp")
    p.add_argument(
        "--soak-rounds", type=int, default=20, help="soak workload: rounds of one crowd each"
    )
    p.add_argument(
        "--soak-requests",
        type=int,
        default=200,
        help="soak workload: concurrent requests per round",
    )
    p.add_argument(
        "--soak-warmup", type=int, default=3, help="soak workload: rounds left out of the slopes"
    )
    p.add_argument("--soak-dtype", default="auto", help="soak workload: engine dtype")
    p.add_argument(
        "--soak-max-total-tokens",
        type=int,
        default=32768,
        help="soak workload: KV pool tokens (small enough for the warm-up rounds to touch all of it)",
    )
    args = p.parse_args(argv)
    args.dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    bad = [d for d in args.dtypes if d not in TORCH_DTYPES]
    if bad or not args.dtypes:
        p.error(f"--dtypes must list some of {sorted(TORCH_DTYPES)}, got {bad or 'nothing'}")
    for name in (
        "num_prompts",
        "min_len",
        "max_len",
        "max_new_tokens",
        "prefix_len",
        "prefix_requests",
        "prefix_new_tokens",
        "plugin_rounds",
        "plugin_new_tokens",
        "serve_concurrency",
        "beam_prompt_len",
        "beam_rounds",
        "grammar_prompts",
        "grammar_rounds",
        "cpu_prompt_len",
        "cpu_new_tokens",
        "soak_rounds",
        "soak_requests",
        "layers_rounds",
    ):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.min_len > args.max_len:
        p.error("--min-len must not exceed --max-len")
    if Path(args.out).is_dir():  # found at the end otherwise, after a run of up to half an hour
        p.error(f"--out must be the path of the JSON file to write, got the directory {args.out!r}")
    if args.beam_dtype not in TORCH_DTYPES:
        p.error(f"--beam-dtype must be one of {sorted(TORCH_DTYPES)}, got {args.beam_dtype!r}")
    if args.grammar_dtype not in TORCH_DTYPES:
        p.error(
            f"--grammar-dtype must be one of {sorted(TORCH_DTYPES)}, got {args.grammar_dtype!r}"
        )
    for flag, value in (
        ("--cpu-hf-batch-sizes", args.cpu_hf_batch_sizes),
        ("--hf-batch-size", args.hf_batch_size),
    ):
        if not all(b.strip().isdigit() and int(b) >= 1 for b in value.split(",")):
            p.error(f"{flag} must list positive integers, got {value!r}")
    modes = [q.strip() for q in args.cpu_quantizations.split(",") if q.strip()]
    if not modes:
        p.error("--cpu-quantizations must name at least one mode")
    from engine.config import DTYPES, QUANTIZATIONS

    for q in modes:
        mode, _, dtype = q.partition("@")
        if mode not in QUANTIZATIONS or (dtype and dtype not in DTYPES):
            p.error(
                f"--cpu-quantizations: {q!r} is not a mode of {QUANTIZATIONS}, optionally @ a dtype of {DTYPES}"
            )
    try:
        parse_shapes(args.beam_shapes)
    except ValueError as exc:
        p.error(str(exc))
    return args


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
        model_dir, dtype=TORCH_DTYPES[dtype], attn_implementation="sdpa"
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
    tdtype = TORCH_DTYPES[dtype]
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


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    print(f"machine: {machine_line()}", flush=True)
    from engine.cores import usable_cores

    threads = usable_cores()
    torch.set_num_threads(threads)
    results: dict[str, dict] = {}
    prompts: list[list[int]] | None = None
    for dtype in args.dtypes if args.workload in ("all", "throughput") else []:
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
    shared_prefix = None
    if args.workload in ("all", "shared-prefix"):
        from engine.tokenizer import load_hf_tokenizer
        from engine.model.resolve import resolve_model_dir

        shared_prefix = run_shared_prefix(args, load_hf_tokenizer(resolve_model_dir(None)))
        print_shared_prefix(shared_prefix)
    extra: dict[str, dict | None] = {}  # the side-by-side workloads, each its own module
    for name, run, show in (
        ("plugins", run_plugins, print_plugins),
        ("tracing", run_tracing, print_tracing),
        ("serve", run_serve, print_serve),
        ("beam", run_beam, print_beam),
        ("grammar", run_grammar, print_grammar),
        ("cpu", run_cpu, print_cpu),
        ("quality", run_quality, print_quality),
        ("dtype-quality", run_dtype_quality, print_dtype_quality),
        ("logits-head", run_logits_head, print_logits_head),
        ("soak", run_soak, print_soak),
        ("scale", run_scale, print_scale),
        ("layers", run_layers, print_layers),
    ):
        extra[name] = None
        # slow: when asked
        if args.workload == name or (
            args.workload == "all" and name not in ("soak", "dtype-quality", "scale", "layers")
        ):
            extra[name] = run(args)
            show(extra[name])
    lens = [len(p) for p in prompts or []]
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
        "workload": {
            "num_prompts": len(lens),
            "prompt_tokens": sum(lens),
            "min_len": min(lens),
            "max_len": max(lens),
            "max_new_tokens": args.max_new_tokens,
            "seed": args.seed,
            "hf_batch_sizes": hf_batch_sizes(args),
        }
        if lens
        else None,
        "results": results,
        "shared_prefix": shared_prefix,
        **extra,
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
