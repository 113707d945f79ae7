"""CPU speed and footprint: the engine (each --cpu-quantizations mode) against transformers
(float32, and the engine's `auto` dtype where that differs) and llama.cpp.

Why: on a CPU a user picks a runtime by start-up and memory, one stream's speed and batch throughput.
One run measures all three for every backend on the same model (the embedded SmolLM2 GGUF: llama.cpp
loads it, transformers its converted directory) and the same token ids, greedy, EOS ignored. Each
backend runs alone in a fresh interpreter, so its imports count and nothing else is resident.
Memory, after one short request: VmRSS per process (the engine's three summed) and PSS, which splits
pages shared between processes (torch's libraries, in all three of the engine's) instead of counting them thrice.
Single stream: decode tokens/s = (tokens - 1) / (last token time - first token time), and TTFT.
Batch: generated tokens over wall time; transformers at its kindest of a few settings (length-sorted
static batches, left padding, sdpa, the best batch size), llama.cpp all prompts as parallel sequences.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# torch-free (the package imports nothing heavy): the baselines' children too
from engine.cores import (
    usable_cores,
)

MARK = (
    "CPU_BENCH_RESULT "  # the child's one result line on stdout; other lines are the backend's own
)
LLAMA_MISSING = "not installed: run make bench"
# The child times its backend's import first, then runs this file by path: importing the engine package
# would add to llama.cpp's and transformers' memory. With -c, spawned engine children re-import no main file.
CHILD = """import time; t0 = time.perf_counter(); {imports}; t_import = time.perf_counter() - t0
import runpy; runpy.run_path({path!r})[{fn!r}]({cfg!r}, t_import)"""
IMPORTS = {
    "engine": "from engine import Engine",
    "transformers": "import transformers",
    "llama.cpp": "import llama_cpp",
}


def add_args(p: argparse.ArgumentParser) -> None:
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
    p.add_argument("--cpu-skip-llama", action="store_true", help="cpu workload: skip llama.cpp")


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Also the quality workload's modes: --cpu-quantizations. Imports here: children load this file."""
    from engine.bench.checks import at_least_one, batch_sizes

    at_least_one(p, args, "cpu_prompt_len", "cpu_new_tokens")
    batch_sizes(p, "--cpu-hf-batch-sizes", args.cpu_hf_batch_sizes)
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


def _field_mb(path: str, name: str) -> float | None:
    try:
        line = next(ln for ln in Path(path).read_text().splitlines() if ln.startswith(name + ":"))
        return int(line.split()[1]) / 1024
    except (OSError, StopIteration):
        return None  # not Linux, or a kernel without smaps_rollup


def memory(pids: dict[str, int]) -> dict:
    """VmRSS and PSS (Linux /proc) per process and summed, in MB; None where /proc does not say."""
    per = {
        r: {
            "rss_mb": _field_mb(f"/proc/{p}/status", "VmRSS"),
            "pss_mb": _field_mb(f"/proc/{p}/smaps_rollup", "Pss"),
        }
        for r, p in pids.items()
    }
    sums = {
        k: None if None in (v := [m[k] for m in per.values()]) else sum(v)
        for k in ("rss_mb", "pss_mb")
    }
    return {"processes": per, **sums}


def _stream(t0: float, marks: list[float], tokens: int) -> dict:
    """Figures of one stream from the times its chunks arrived (the first chunk: the first token)."""
    span = marks[-1] - marks[0] if len(marks) > 1 else 0.0
    return {
        "new_tokens": tokens,
        "ttft_s": marks[0] - t0 if marks else None,
        "decode_tokens_per_s": (tokens - 1) / span if span else None,
    }


def _emit(
    t_import: float, load: float, **figures
) -> None:  # the children below each run in a fresh interpreter
    startup = {"import_s": t_import, "load_s": load, "total_s": t_import + load}
    print(MARK + json.dumps({"startup": startup, **figures}), flush=True)


def child_engine(cfg_path: str, t_import: float) -> None:
    """The engine in one quantization mode: time until Engine() returns (ready), memory, one stream, the batch."""
    from engine import Engine

    cfg = json.loads(Path(cfg_path).read_text())
    t0 = time.perf_counter()
    mode, _, dtype = cfg["mode"].partition("@")  # "none@bfloat16": a dtype other than auto
    # the baselines run on the CPU
    eng = Engine(quantization=mode, dtype=dtype or "auto", device="cpu")
    ready = time.perf_counter() - t0
    greedy = {"temperature": 0, "ignore_eos": True}
    try:
        one, n = cfg["single"], cfg["new_tokens"]
        # warm-up, short request
        eng.generate(input_ids=one[::-1], sampling_params={**greedy, "max_new_tokens": 8})
        mem, _, t0 = memory(eng.pids), eng.flush_cache(), time.perf_counter()
        chunks = [
            (time.perf_counter(), len(c["output_ids"]))
            for c in eng.generate(
                input_ids=one, sampling_params={**greedy, "max_new_tokens": n}, stream=True
            )
        ]
        single = _stream(t0, [t for t, _ in chunks], sum(k for _, k in chunks))
        prompts, params = cfg["prompts"], {**greedy, "max_new_tokens": cfg["max_new_tokens"]}
        eng.generate(
            input_ids=[p[::-1][:32] for p in prompts[:2]],
            sampling_params={**params, "max_new_tokens": 4},
        )
        _, t0 = eng.flush_cache(), time.perf_counter()
        outs = eng.generate(input_ids=prompts, sampling_params=params)
        wall = time.perf_counter() - t0
        generated, dtype = (
            sum(o["meta_info"]["completion_tokens"] for o in outs),
            eng.server_info.get("dtype"),
        )
    finally:
        eng.shutdown()
    batch = {
        "generated_tokens": generated,
        "wall_s": wall,
        "tokens_per_s": generated / wall,
        "setting": "one call",
    }
    _emit(t_import, ready, memory=mem, single=single, batch=batch, dtype=dtype)


def child_transformers(cfg_path: str, t_import: float) -> None:
    """transformers in cfg["hf_dtype"], sdpa: load time (torch's import included), memory, batch-1 decode, batches."""
    cfg = json.loads(Path(cfg_path).read_text())
    t0 = time.perf_counter()
    import torch
    from transformers import AutoModelForCausalLM

    dtype = getattr(torch, cfg["hf_dtype"])
    model = AutoModelForCausalLM.from_pretrained(
        cfg["model_dir"], dtype=dtype, attn_implementation="sdpa"
    )
    load = time.perf_counter() - t0
    torch.set_num_threads(usable_cores())
    pad = model.generation_config.eos_token_id
    pad = pad[0] if isinstance(pad, list) else pad

    def generate(batch: list[list[int]], n: int) -> float:
        """Seconds for n new tokens on each prompt (left padded; min_new_tokens keeps EOS away)."""
        width = max(map(len, batch))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        t0 = time.perf_counter()
        with torch.inference_mode():
            model.generate(
                input_ids=ids,
                attention_mask=mask,
                do_sample=False,
                max_new_tokens=n,
                min_new_tokens=n,
                pad_token_id=pad,
            )
        return time.perf_counter() - t0

    one, n = cfg["single"], cfg["new_tokens"]
    generate([one[::-1]], 8)  # warm-up, short request
    mem = memory({"process": os.getpid()})
    first, full = generate([one], 1), generate([one], n)  # decode time: the difference
    rate = (n - 1) / (full - first) if full > first else None
    single = {"new_tokens": n, "ttft_s": first, "decode_tokens_per_s": rate}
    prompts, m = sorted(cfg["prompts"], key=len), cfg["max_new_tokens"]
    runs = []
    for size in cfg["hf_batch_sizes"]:
        # warm-up at this size, untimed (the engine gets one too)
        generate([q[::-1][:32] for q in prompts[:size]], 2)
        wall = sum(generate(prompts[i : i + size], m) for i in range(0, len(prompts), size))
        runs.append(
            {
                "generated_tokens": len(prompts) * m,
                "wall_s": wall,
                "tokens_per_s": len(prompts) * m / wall,
                "setting": f"batch {size}",
            }
        )
    batch = max(runs, key=lambda r: r["tokens_per_s"])
    _emit(
        t_import,
        load,
        memory=mem,
        single=single,
        batch={**batch, "all_batch_sizes": runs},
        dtype=cfg["hf_dtype"],
    )


def child_llama(cfg_path: str, t_import: float) -> None:
    """llama.cpp on the GGUF: load time, memory, one create_completion stream, the batch in parallel."""
    import llama_cpp

    cfg = json.loads(Path(cfg_path).read_text())
    one, n, threads = cfg["single"], cfg["new_tokens"], usable_cores()
    # single stream; the check
    n_ctx = max(len(one) + n, max(map(len, cfg["prompts"])) + cfg["max_new_tokens"]) + 64
    if not cfg.get("llama_extra_bufts", True):
        _no_extra_buffer_types()
    t0 = time.perf_counter()
    llm = llama_cpp.Llama(model_path=cfg["gguf"], n_ctx=n_ctx, n_threads=threads, verbose=False)
    load = time.perf_counter() - t0
    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    eog = [
        t
        for t in range(llama_cpp.llama_vocab_n_tokens(vocab))
        if llama_cpp.llama_vocab_is_eog(vocab, t)
    ]
    sampled: list[int] = []

    def no_eog(_ids, scores):
        """What logit_bias does (a logits processor), counting the tokens sampled on the way."""
        sampled.append(1)
        scores[eog] = -1e9
        return scores

    def complete(ids: list[int], max_tokens: int) -> tuple[float, list[float], int]:
        sampled.clear()
        t0, ban = time.perf_counter(), llama_cpp.LogitsProcessorList([no_eog])
        stream = llm.create_completion(
            prompt=ids, max_tokens=max_tokens, temperature=0, stream=True, logits_processor=ban
        )
        return t0, [time.perf_counter() for c in stream if c["choices"][0]["text"]], len(sampled)

    complete(one[::-1], 8)  # warm-up, short request
    mem = memory({"process": os.getpid()})
    single = _stream(*complete(one, n))
    batch = llama_parallel(llm, cfg["prompts"], cfg["max_new_tokens"], threads)
    _emit(
        t_import, load, memory=mem, single=single, batch=batch, dtype="GGUF (embedded quantization)"
    )


def _no_extra_buffer_types() -> None:
    """Load weights into plain CPU buffers: llama.cpp's extra buffer types (its AMX repack on CPUs that
    report AMX) crashed llama_decode with SIGSEGV on one of our machines (an Intel Xeon under KVM)."""
    import llama_cpp.llama_cpp as raw

    default = raw.llama_model_default_params

    def params():
        p = default()
        p.use_extra_bufts = False
        return p

    raw.llama_model_default_params = params


def llama_parallel(llm, prompts: list[list[int]], n: int, threads: int) -> dict:
    """All prompts as parallel sequences of one new context on llm's model: prompts packed into n_batch-token
    decodes, then one decode a step with a token per sequence, greedy argmax. EOS is an ordinary token, so
    each sequence gets exactly n. Past llama.cpp's sequence limit, groups of that many, one after another.
    Each sequence has a KV buffer of its own (kv_unified off, llama.cpp's high-throughput mode): in one
    unified buffer every sequence's attention ran over every sequence's cells, masked, about 28,000 of
    them at the end of this workload, which is no kindness to llama.cpp."""
    import llama_cpp as lc
    import numpy as np

    n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(llm.model))
    limit = lc.llama_max_parallel_sequences()
    wall, outputs = 0.0, []
    for g in range(0, len(prompts), limit):
        group = prompts[g : g + limit]
        p = lc.llama_context_default_params()
        # each sequence gets n_ctx / n_seq_max cells: room for the longest
        p.n_ctx, p.n_seq_max, p.kv_unified = (
            len(group) * (max(len(q) for q in group) + n + 8),
            len(group),
            False,
        )
        p.n_batch = p.n_ubatch = max(512, len(group))
        p.n_threads = p.n_threads_batch = threads
        ctx = lc.llama_init_from_model(llm.model, p)
        batch = lc.llama_batch_init(p.n_batch, 0, 1)

        def decode(entries: list[tuple[int, int, int, bool]]) -> list[int]:
            """(token, pos, seq, wants logits) in n_batch chunks; the argmax of each wanted row, in order."""
            out = []
            for i in range(0, len(entries), p.n_batch):
                chunk = entries[i : i + p.n_batch]
                batch.n_tokens = len(chunk)
                for j, (tok, pos, seq, want) in enumerate(chunk):
                    batch.token[j], batch.pos[j], batch.n_seq_id[j], batch.logits[j] = (
                        tok,
                        pos,
                        1,
                        want,
                    )
                    batch.seq_id[j][0] = seq
                if lc.llama_decode(ctx, batch) != 0:
                    raise RuntimeError("llama_decode failed")
                out += [
                    int(
                        np.ctypeslib.as_array(
                            lc.llama_get_logits_ith(ctx, j), shape=(n_vocab,)
                        ).argmax()
                    )
                    for j, e in enumerate(chunk)
                    if e[3]
                ]
            return out

        try:
            t0 = time.perf_counter()
            outs = [
                [t]
                for t in decode(
                    [
                        (t, i, s, i == len(q) - 1)
                        for s, q in enumerate(group)
                        for i, t in enumerate(q)
                    ]
                )
            ]
            for _ in range(1, n):  # o[-1] sits at position len(q) + len(o) - 1 of its sequence
                nxt = decode(
                    [
                        (o[-1], len(q) + len(o) - 1, s, True)
                        for s, (q, o) in enumerate(zip(group, outs))
                    ]
                )
                outs = [o + [t] for o, t in zip(outs, nxt)]
            wall, outputs = wall + time.perf_counter() - t0, outputs + outs
        finally:
            lc.llama_batch_free(batch)
            lc.llama_free(ctx)
    # the check: the high-level greedy path, EOS ordinary too
    gen = llm.generate(prompts[0], temp=0.0, reset=True)
    agree = next(
        (i for i, (a, b) in enumerate(zip([next(gen) for _ in range(n)], outputs[0])) if a != b), n
    )
    tokens = sum(map(len, outputs))
    return {
        "generated_tokens": tokens,
        "wall_s": wall,
        "tokens_per_s": tokens / wall,
        "setting": f"parallel {min(limit, len(prompts))}",
        "first_prompt_equal_to_generate": f"{agree}/{n}",
    }


def _child(backend: str, fn: str, cfg: dict) -> dict:
    """Run one backend in a fresh interpreter; its result line, or what went wrong (never raises)."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(cfg, f)
    try:
        code = CHILD.format(
            imports=IMPORTS[backend], path=str(Path(__file__).resolve()), fn=fn, cfg=f.name
        )
        proc = subprocess.run([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    finally:
        os.unlink(f.name)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(MARK)]
    failed = {"error": f"failed, exit status {proc.returncode} (its stderr is above)"}
    return json.loads(lines[-1][len(MARK) :]) if lines and not proc.returncode else failed


def hf_dtypes(modes: list[str]) -> list[str]:
    """transformers in float32 and in every other dtype an engine mode names ("none@bfloat16"): the
    targets compare each engine with transformers in the same dtype."""
    named = [m.partition("@")[2] for m in modes]
    return ["float32"] + sorted({d for d in named if d and d not in ("auto", "float32")})


def run_cpu(args: argparse.Namespace) -> dict:
    """Every backend in turn, each in its own interpreter; the figures and the settings behind them."""
    from engine.bench.machine import machine_line
    from engine.bench.prompts import build_prompts
    from engine.model.embedded import embedded_gguf_path
    from engine.model.resolve import resolve_model_dir
    from engine.tokenizer import load_hf_tokenizer

    model_dir = resolve_model_dir(None)
    tok, modes = (
        load_hf_tokenizer(model_dir),
        [q.strip() for q in args.cpu_quantizations.split(",") if q.strip()],
    )
    sizes = [int(b) for b in args.cpu_hf_batch_sizes.split(",")]
    cfg = {
        "model_dir": model_dir,
        "gguf": str(embedded_gguf_path()),
        "new_tokens": args.cpu_new_tokens,
        "single": build_prompts(tok, 1, args.cpu_prompt_len, args.cpu_prompt_len, args.seed + 1)[0],
        "prompts": build_prompts(tok, args.num_prompts, args.min_len, args.max_len, args.seed),
        "max_new_tokens": args.max_new_tokens,
        "hf_batch_sizes": sizes,
    }
    backends: dict[str, dict] = {}
    for q in modes:
        print(f"[cpu] engine quantization={q} ...", flush=True)
        backends[f"engine {q}"] = _child("engine", "child_engine", {**cfg, "mode": q})
    hf_runs = [
        (
            f"transformers {d}",
            "child_transformers",
            args.cpu_skip_hf and "--cpu-skip-hf",
            {"hf_dtype": d},
        )
        for d in hf_dtypes(modes)
    ]
    for name, fn, skip, extra in (
        *hf_runs,
        ("llama.cpp", "child_llama", args.cpu_skip_llama and "--cpu-skip-llama", {}),
    ):
        if name == "llama.cpp" and not skip and importlib.util.find_spec("llama_cpp") is None:
            skip = LLAMA_MISSING
        print(f"[cpu] {name} ...", flush=True)
        backends[name] = (
            {"skipped": skip} if skip else _child(name.split()[0], fn, {**cfg, **extra})
        )
        # its kindest setting failed: the plain one
        if name == "llama.cpp" and "error" in backends[name]:
            print(
                "[cpu] llama.cpp failed; again without its extra buffer types (AMX repack) ...",
                flush=True,
            )
            backends[name] = {
                **_child(name, fn, {**cfg, "llama_extra_bufts": False}),
                "setting": "use_extra_bufts=False (the default crashed: "
                + backends[name]["error"]
                + ")",
            }
    baselines_ran = any(
        "startup" in b for name, b in backends.items() if not name.startswith("engine")
    )
    if getattr(args, "cpu_engine_again", False) and modes and baselines_ran:
        # A, B, A: a noisy machine's speed moves between runs a quarter of an hour apart (10-20% on a 2-core
        # cloud guest), and each ratio compares two of them; the engine's first run against its second says
        # how far, and each ratio is printed against both
        print(f"[cpu] engine quantization={modes[0]} again ...", flush=True)
        backends[f"engine {modes[0]} again"] = _child(
            "engine", "child_engine", {**cfg, "mode": modes[0]}
        )
    settings = {
        "prompt_len": args.cpu_prompt_len,
        "new_tokens": args.cpu_new_tokens,
        "hf_batch_sizes": sizes,
        "prompt_tokens": sum(map(len, cfg["prompts"])),
        "greedy": True,
        "ignore_eos": True,
        **{
            k: getattr(args, k)
            for k in ("num_prompts", "min_len", "max_len", "max_new_tokens", "seed")
        },
    }
    return {
        "machine": machine_line(),
        "threads": usable_cores(),
        "quantizations": modes,
        "backends": backends,
        "settings": settings,
    }


TABLES = (  # title, then (column, dotted key, format); the ratio rows are engine / baseline per column
    (
        "start-up and memory (fresh process; MB after one short request): lower is better",
        ("import s", "startup.import_s", "{:.2f}"),
        ("load s", "startup.load_s", "{:.2f}"),
        ("total s", "startup.total_s", "{:.2f}"),
        ("RSS MB", "memory.rss_mb", "{:.0f}"),
        ("PSS MB", "memory.pss_mb", "{:.0f}"),
    ),
    (
        "single stream (greedy, EOS ignored): decode tok/s higher is better",
        ("TTFT s", "single.ttft_s", "{:.3f}"),
        ("decode tok/s", "single.decode_tokens_per_s", "{:.1f}"),
        ("tokens", "single.new_tokens", "{:d}"),
    ),
    (
        "batch (generated tokens / wall): higher is better",
        ("tok/s", "batch.tokens_per_s", "{:.1f}"),
        ("wall s", "batch.wall_s", "{:.2f}"),
        ("setting", "batch.setting", "{}"),
    ),
)


def _get(r: dict, key: str):  # "a.b" -> r["a"]["b"], None where missing
    for part in key.split("."):
        r = r.get(part) if isinstance(r, dict) else None
    return r


def print_cpu(r: dict) -> None:
    s, backends = r["settings"], r["backends"]
    print(
        f"\ncpu: {r['machine']}\n  single stream: {s['prompt_len']} prompt tokens, {s['new_tokens']} new; "
        f"batch: {s['num_prompts']} prompts of {s['min_len']}-{s['max_len']} tokens, {s['max_new_tokens']} new each"
    )
    ran = [n for n, b in backends.items() if "startup" in b]
    baselines = [n for n in ran if n.startswith("transformers") or n == "llama.cpp"]
    pairs = [(e, b) for e in ran if e.startswith("engine") for b in baselines]
    for title, *cols in TABLES:
        print(f"\n  {title}\n  {'':<42}" + "".join(f"{c:>14}" for c, _, _ in cols))
        for name, b in backends.items():
            cells = ["-" if _get(b, k) is None else f.format(_get(b, k)) for _, k, f in cols]
            row = (
                "".join(f"{c:>14}" for c in cells)
                if name in ran
                else b.get("skipped", b.get("error"))
            )
            print(f"  {name:<42}{row}")
        for e, o in pairs:
            ratios = [(_get(backends[e], k), _get(backends[o], k)) for _, k, _ in cols]
            print(
                f"  {e + ' / ' + o:<42}"
                + "".join(
                    f"{f'{a / b:.2f}x' if isinstance(a, float) and b else '':>14}"
                    for a, b in ratios
                )
            )
    print(
        "  RSS counts shared pages in every process, PSS splits them; engine rows sum its 3 processes",
        flush=True,
    )
    if setting := backends.get("llama.cpp", {}).get("setting"):
        print(f"  llama.cpp ran with {setting}")
    if check := _get(backends.get("llama.cpp", {}), "batch.first_prompt_equal_to_generate"):
        print(
            f"  llama.cpp batch: its first prompt agrees with a sequential greedy generate() for {check} tokens"
        )
