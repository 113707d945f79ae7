"""Beam search: the scheduler's native beam search against the client-side loop and transformers.

Why: before Engine.beam_search, users wrote beam search on top of generate (the SGLang deep-dive in
shared/reference, lines 340-410): every step one 1-token request per live beam, the top logprobs read
back, the K best continuations picked in Python, the next step resubmitted. Every such request pays
admission, a prefill step, a detokenizer round trip and its decode. Native beam search keeps the
beams as decode rows in the scheduler and detokenizes only the returned hypotheses. One run measures,
on one engine, both of them, and transformers' generate(num_beams=K) on the same model and dtype,
and checks that all three find the same best hypothesis.

Work is fixed by default: EOS is an ordinary token for all three (native and the loop: ignore_eos;
transformers: eos_token_id=None), so every search generates exactly N tokens; --beam-eos makes EOS
end hypotheses in all three. All prompts of a shape have the same length (seeded corpus windows of
--beam-prompt-len tokens), so each path runs them as one batch: native one beam_search call, the loop
one generate call per step for all searches' beams, transformers one generate without padding.

The engine caps top_logprobs_num at 100, so past K=50 the loop sees 100 candidates per beam, not 2K:
at K=200 its first step (one request, the prompt) yields 100 beams, not 200. That is less work for
the loop, never more; whether its best hypothesis still matches native's is printed all the same.
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.bench.checks import at_least_one, torch_dtype
from engine.bench.prompts import build_prompts

# the most top_logprobs_num a request may ask for (engine/frontend/request_checks.py)
ENGINE_TOP_LOGPROBS = 100


def add_args(p: argparse.ArgumentParser) -> None:
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


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    at_least_one(p, args, "beam_prompt_len", "beam_rounds")
    torch_dtype(p, "--beam-dtype", args.beam_dtype)
    try:
        parse_shapes(args.beam_shapes)
    except ValueError as exc:
        p.error(str(exc))


@dataclass
class Shape:
    width: int  # K
    new_tokens: int  # N
    prompts: int


def parse_shapes(text: str) -> list[Shape]:
    """'8x32x4,200x3x1' -> beam width x new tokens x prompts, per shape."""
    shapes = []
    for part in text.split(","):
        figures = part.strip().split("x")
        if len(figures) != 3 or not all(f.isdigit() and int(f) >= 1 for f in figures):
            raise ValueError(
                f"--beam-shapes: each shape is KxNxPROMPTS with positive integers, got {part!r}"
            )
        shapes.append(Shape(*(int(f) for f in figures)))
    return shapes


# ------------------------------------------------------------------ the client-side loop


@dataclass
class ClientSearch:
    """One beam search as a user writes it over generate: transformers' rules on the top logprobs that
    come back (length_penalty 1, early_stopping False), in plain Python."""

    prompt: list[int]
    width: int
    new_tokens: int
    stop_ids: frozenset[int]
    # (tokens, cumulative logprob)
    beams: list[tuple[list[int], float]] = field(default_factory=lambda: [([], 0.0)])
    # (score, logprob, tokens), best first
    finished: list[tuple[float, float, list[int]]] = field(default_factory=list)
    steps: int = 0
    improvable: bool = True
    done: bool = False

    def inputs(self) -> list[list[int]]:
        """This step's requests: the prompt plus each live beam's tokens (at the start: the prompt once)."""
        return [self.prompt + ids for ids, _ in self.beams]

    def step(self, tops: list[list[tuple[float, int]]]) -> None:
        """tops: per live beam its top (logprob, token) pairs. Selection as transformers' _beam_search."""
        k, t = self.width, self.steps
        keep = max(2, 1 + len(self.stop_ids)) * k
        cands = sorted(
            (
                (score + lp, b, tok)
                for b, (_, score) in enumerate(self.beams)
                for lp, tok in tops[b]
            ),
            key=lambda c: -c[0],
        )[:keep]
        hits = [t + 1 >= self.new_tokens or tok in self.stop_ids for _, _, tok in cands]
        if self.improvable:  # hitting candidates among the first K become hypotheses
            new = [
                (total / (t + 1), total, self.beams[b][0] + [tok])
                for (total, b, tok), hit in list(zip(cands, hits))[:k]
                if hit
            ]
            self.finished = sorted(self.finished + new, key=lambda h: -h[0])[:k]
        live = [c for c, hit in zip(cands, hits) if not hit][:k]
        self.beams = [(self.beams[b][0] + [tok], total) for total, b, tok in live]
        self.steps = t + 1
        # can the best live beam still beat the worst hypothesis?
        if live and len(self.finished) == k:
            self.improvable = live[0][0] / self.steps > self.finished[-1][0]
        self.done = not live or not self.improvable

    def best(self) -> list[int]:
        return self.finished[0][2]


def client_loop(engine, prompts: list[list[int]], shape: Shape, stop_ids: frozenset[int]) -> dict:
    """All searches advance together: one generate call per step carrying every live beam of every
    search, max_new_tokens=1, greedy, top logprobs returned. Each request is detokenized as usual."""
    top = min(2 * shape.width, ENGINE_TOP_LOGPROBS)
    searches = [ClientSearch(p, shape.width, shape.new_tokens, stop_ids) for p in prompts]
    params = {"max_new_tokens": 1, "temperature": 0}
    calls = requests = 0
    while running := [s for s in searches if not s.done]:
        batches = [s.inputs() for s in running]
        outs = engine.generate(
            input_ids=[ids for b in batches for ids in b],
            sampling_params=params,
            return_logprob=True,
            top_logprobs_num=top,
        )
        calls, requests = calls + 1, requests + len(outs)
        off = 0
        for s, batch in zip(running, batches):
            s.step(
                [
                    [(lp, tok) for lp, tok, _ in o["meta_info"]["output_top_logprobs"][0]]
                    for o in outs[off : off + len(batch)]
                ]
            )
            off += len(batch)
    return {
        "best": [s.best() for s in searches],
        "generate_calls": calls,
        "requests": requests,
        "top_logprobs_num": top,
    }


# ------------------------------------------------------------------ the three paths, timed


def _native(engine, prompts: list[list[int]], shape: Shape, ignore_eos: bool) -> dict:
    outs = engine.beam_search(
        input_ids=prompts,
        beam_width=shape.width,
        max_new_tokens=shape.new_tokens,
        ignore_eos=ignore_eos,
    )
    return {
        "best": [o["hypotheses"][0]["output_ids"] for o in outs],
        "detokenize_s": sum(o["meta_info"]["detokenize_seconds"] for o in outs),
    }


def _timed(fn, *args) -> dict:
    t0 = time.perf_counter()
    out = fn(*args)
    out["wall_s"] = time.perf_counter() - t0
    return out


def _best_of(runs: list[dict]) -> dict:
    """The fastest run (the machine is shared: a slow run says more about the neighbours)."""
    return min(runs, key=lambda r: r["wall_s"])


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux /proc; 0 elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_engine_paths(
    engine, prompts: list[list[int]], shapes: list[Shape], rounds: int, eos: bool
) -> list[dict]:
    """Native and the client loop on one engine, alternating. Each path is first run once, untimed, at
    the full shape on reversed prompts (the first run at a shape pays first touches of the KV pool and
    allocator growth), and the prefix cache is flushed before every run so each starts cold. The
    detokenizer process's CPU time is read around every timed run: its busy time, IPC included."""
    stop = frozenset() if not eos else frozenset({engine.tokenizer.eos_token_id})
    paths = {"native": (_native, not eos), "client_loop": (client_loop, stop)}
    detok_pid = engine.pids["detokenizer"]
    out = []
    for shape in shapes:
        ps = prompts[: shape.prompts]
        runs: dict[str, list[dict]] = {"native": [], "client_loop": []}
        for name, (fn, extra) in paths.items():
            engine.flush_cache()
            print(f"[beam] K={shape.width} N={shape.new_tokens} warm-up: {name} ...", flush=True)
            fn(engine, [p[::-1] for p in ps], shape, extra)
        for r in range(rounds):
            for name in ("native", "client_loop") if r % 2 == 0 else ("client_loop", "native"):
                engine.flush_cache()
                print(
                    f"[beam] K={shape.width} N={shape.new_tokens} round {r + 1}: {name} ...",
                    flush=True,
                )
                fn, extra = paths[name]
                cpu0 = _cpu_seconds(detok_pid)
                run = _timed(fn, engine, ps, shape, extra)
                runs[name].append({**run, "detokenizer_cpu_s": _cpu_seconds(detok_pid) - cpu0})
        out.append({name: _best_of(rs) for name, rs in runs.items()})
    return out


def client_detokenize_seconds(
    dtype: str, prompts: list[list[int]], shapes: list[Shape], eos: bool
) -> list[dict]:
    """The client loop once more per shape, on an engine with the stagetimer plugin: the detokenizer
    process's own decode time (engine_detokenize .. engine_detokenize_after) over the run."""
    from engine import Engine
    from engine.plugins.stagetimer import summary

    def detok(engine) -> tuple[float, int]:
        stats = engine.get_stats()
        mine = stats.get("plugins", {}).get("detokenizer", {}).get("stagetimer", {})
        return summary(stats)["per_process"].get("detokenizer", {}).get(
            "detokenize", 0.0
        ), mine.get("calls", {}).get("detokenize", 0)

    out = []
    with Engine(dtype=dtype, plugins="stagetimer") as engine:
        stop = frozenset() if not eos else frozenset({engine.tokenizer.eos_token_id})
        for shape in shapes:
            engine.flush_cache()
            client_loop(engine, [p[::-1] for p in prompts[: shape.prompts]], shape, stop)  # warm-up
            engine.flush_cache()
            print(
                f"[beam] K={shape.width} N={shape.new_tokens}: client loop under stagetimer ...",
                flush=True,
            )
            (s0, c0), _, (s1, c1) = (
                detok(engine),
                client_loop(engine, prompts[: shape.prompts], shape, stop),
                detok(engine),
            )
            out.append({"detokenize_s": s1 - s0, "detokenize_batches": c1 - c0})
    return out


def run_transformers(
    model_dir: str,
    dtype: str,
    prompts: list[list[int]],
    shapes: list[Shape],
    rounds: int,
    eos: bool,
) -> list[dict]:
    """transformers generate(num_beams=K, do_sample=False), all prompts of a shape as one unpadded batch."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=getattr(torch, dtype), attn_implementation="sdpa"
    )
    model.eval()
    eos_id = model.generation_config.eos_token_id
    extra = {} if eos else {"eos_token_id": None}  # None: EOS is an ordinary token, as ignore_eos

    def generate(ps: list[list[int]], shape: Shape) -> dict:
        ids = torch.tensor(ps)
        with torch.inference_mode():
            seqs = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                num_beams=shape.width,
                num_return_sequences=1,
                do_sample=False,
                max_new_tokens=shape.new_tokens,
                length_penalty=1.0,
                early_stopping=False,
                pad_token_id=eos_id,
                **extra,
            )
        return {"best": [_trim(s[ids.shape[1] :].tolist(), eos_id if eos else None) for s in seqs]}

    out = []
    for shape in shapes:
        print(f"[beam] K={shape.width} N={shape.new_tokens} warm-up: transformers ...", flush=True)
        generate([p[::-1] for p in prompts[: shape.prompts]], shape)
        runs = []
        for r in range(rounds):
            print(
                f"[beam] K={shape.width} N={shape.new_tokens} round {r + 1}: transformers ...",
                flush=True,
            )
            runs.append(_timed(generate, prompts[: shape.prompts], shape))
        out.append(_best_of(runs))
    return out


def _trim(ids: list[int], eos: int | None) -> list[int]:
    """transformers pads a hypothesis that ended at EOS; the engine's ends at the EOS."""
    return ids[: ids.index(eos) + 1] if eos is not None and eos in ids else ids


# ------------------------------------------------------------------ the workload


def _figures(r: dict, shape: Shape) -> dict:
    seqs = shape.prompts * shape.width
    figures = {k: v for k, v in r.items() if k != "best"}
    return {
        **figures,
        "sequences_per_s": seqs / r["wall_s"],
        "searches_per_s": shape.prompts / r["wall_s"],
    }


def run_beam(args: argparse.Namespace) -> dict:
    from engine import Engine

    shapes = parse_shapes(args.beam_shapes)
    with Engine(dtype=args.beam_dtype, device="cpu") as engine:  # transformers runs on the CPU
        prompts = build_prompts(
            engine.tokenizer,
            max(s.prompts for s in shapes),
            args.beam_prompt_len,
            args.beam_prompt_len,
            args.seed,
        )
        dtype, model_dir = engine.server_info["dtype"], engine.model_dir
        engine_runs = run_engine_paths(engine, prompts, shapes, args.beam_rounds, args.beam_eos)
    detok = client_detokenize_seconds(args.beam_dtype, prompts, shapes, args.beam_eos)
    hf_runs = run_transformers(model_dir, dtype, prompts, shapes, args.beam_rounds, args.beam_eos)
    results = []
    for shape, er, d, hf in zip(shapes, engine_runs, detok, hf_runs):
        native, client = er["native"], er["client_loop"]
        results.append(
            {
                "beam_width": shape.width,
                "new_tokens": shape.new_tokens,
                "prompts": shape.prompts,
                "native": _figures(native, shape),
                "client_loop": {**_figures(client, shape), **d},
                "transformers": _figures(hf, shape),
                "native_over_client_loop": client["wall_s"] / native["wall_s"],
                "native_over_transformers": hf["wall_s"] / native["wall_s"],
                "best_matches_client_loop": [
                    a == b for a, b in zip(native["best"], client["best"])
                ],
                "best_matches_transformers": [a == b for a, b in zip(native["best"], hf["best"])],
                "best_native": native["best"],
            }
        )
    return {
        "dtype": dtype,
        "prompt_len": args.beam_prompt_len,
        "rounds": args.beam_rounds,
        "ignore_eos": not args.beam_eos,
        "batching": "each shape's prompts as one batch on every path",
        "targets": {"native_over_client_loop": 3.0, "native_over_transformers": 2.0},
        "shapes": results,
    }


def print_beam(r: dict) -> None:
    eos = "EOS ignored by all three" if r["ignore_eos"] else "EOS ends hypotheses"
    print(
        f"\nbeam search, {r['dtype']}, prompts of {r['prompt_len']} tokens, {eos}, best of {r['rounds']} runs; "
        f"seq/s = prompts x K / wall"
    )
    print(
        f"  {'K x N x prompts':<16}{'path':<14}{'wall s':>9}{'seq/s':>10}{'detok s':>9}{'detok CPU':>10}"
        f"{'native x':>10}{'best ==':>9}"
    )
    for s in r["shapes"]:
        label = f"{s['beam_width']} x {s['new_tokens']} x {s['prompts']}"
        c, hf = s["client_loop"], s["transformers"]
        rows = [
            ("native", s["native"], "", ""),
            (
                "client loop",
                c,
                f"{s['native_over_client_loop']:.2f}x",
                f"{sum(s['best_matches_client_loop'])}/{s['prompts']}",
            ),
            (
                "transformers",
                hf,
                f"{s['native_over_transformers']:.2f}x",
                f"{sum(s['best_matches_transformers'])}/{s['prompts']}",
            ),
        ]
        for i, (path, f, ratio, match) in enumerate(rows):
            detok = (
                f"{f['detokenize_s']:9.4f}{f['detokenizer_cpu_s']:10.2f}"
                if "detokenize_s" in f
                else f"{'-':>9}{'-':>10}"
            )
            print(
                f"  {label if i == 0 else '':<16}{path:<14}{f['wall_s']:9.3f}{f['sequences_per_s']:10.1f}{detok}"
                f"{ratio:>10}{match:>9}"
            )
        print(
            f"  {'':<16}client loop: {c['generate_calls']} generate calls, {c['requests']} requests, "
            f"top_logprobs_num {c['top_logprobs_num']}, {c['detokenize_batches']} detokenizer batches"
        )
    print(
        "  detok s: decode stage (native: meta_info detokenize_seconds; client loop: stagetimer, separate run); "
        "detok CPU: detokenizer process CPU seconds over the timed run"
    )
    t = r["targets"]
    print(
        f"  targets: native >= {t['native_over_client_loop']:.0f}x the client loop, "
        f">= {t['native_over_transformers']:.0f}x transformers",
        flush=True,
    )
