"""Structured output: requests under one JSON schema against the same requests unconstrained.

Why: a constraint costs the scheduler a bitmask fill and a logits mask every step for its rows, and
a compile per distinct schema. One run measures, on one engine, what that costs in throughput and
latency, and checks that every constrained output is valid JSON under the schema (the `jsonschema`
library).

The requests are short English chat prompts (the model's chat template) asking for a JSON object
describing a thing (SUBJECTS), all under one schema (SCHEMA: bounded strings, an enum, an integer
with minimum and maximum, a short array, all fields required), greedy. The work is the same in both
modes: the constrained batch runs first, then each unconstrained request gets max_new_tokens = that
request's constrained completion_tokens and ignore_eos=True, so it generates exactly as many tokens.
The two modes alternate after a warm-up of each, the prefix cache flushed before every run; the
fastest run of each is kept.

Compile: on the fresh engine (after an unconstrained warm-up) the first constrained request
compiles the schema (grammar_compile_seconds gets its first entry; the scheduler's figure includes
the xgrammar backend's one-time setup for the vocabulary, split out here by timing both in this
process). A second request with the identical schema compiles nothing (the list does not grow); its
first-token latency is set against an unconstrained request's, one request at a time.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from engine.bench.checks import at_least_one, torch_dtype

SCHEMA: dict = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 32},
        "kind": {
            "type": "string",
            "enum": ["animal", "plant", "food", "place", "tool", "vehicle", "instrument", "other"],
        },
        "description": {"type": "string", "minLength": 1, "maxLength": 100},
        "rating": {"type": "integer", "minimum": 1, "maximum": 10},
        "tags": {
            "type": "array",
            "items": {"type": "string", "minLength": 1, "maxLength": 16},
            "minItems": 1,
            "maxItems": 3,
        },
    },
    "required": ["name", "kind", "description", "rating", "tags"],
    "additionalProperties": False,
}

# The longest object SCHEMA allows is about 260 characters, so no output is cut by this cap.
MAX_NEW_TOKENS = 320

SUBJECTS: tuple[str, ...] = (
    "a red fox",
    "an oak tree",
    "a loaf of sourdough bread",
    "the city of Lisbon",
    "a claw hammer",
    "a bicycle",
    "a violin",
    "a honeybee",
    "a sunflower",
    "a bowl of ramen",
    "a lighthouse",
    "a screwdriver",
    "a sailboat",
    "a grand piano",
    "an elephant",
    "a cactus",
    "a slice of pizza",
    "the Sahara desert",
    "a pair of scissors",
    "a steam locomotive",
    "an acoustic guitar",
    "a penguin",
    "a bamboo plant",
    "a cup of espresso",
    "Mount Fuji",
    "a chef's knife",
    "a hot air balloon",
    "a trumpet",
    "an octopus",
    "a rose bush",
    "a croissant",
    "a public library",
    "a sewing machine",
    "a motorcycle",
    "a harp",
    "a barn owl",
    "a maple tree",
    "a bowl of guacamole",
    "Venice",
    "a garden hose",
    "a submarine",
    "a drum kit",
    "a dolphin",
    "a tulip",
    "a wheel of cheese",
    "an old castle",
    "a telescope",
    "a city bus",
    "a flute",
    "a tortoise",
    "a pine forest",
    "a mango",
    "a lakeside cabin",
    "a wrench",
    "a helicopter",
    "a cello",
    "a hummingbird",
    "a field of lavender",
    "a chocolate cake",
    "a train station",
    "a pocket watch",
    "a canoe",
    "a saxophone",
    "a snow leopard",
)


def add_args(p: argparse.ArgumentParser) -> None:
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


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    at_least_one(p, args, "grammar_prompts", "grammar_rounds")
    torch_dtype(p, "--grammar-dtype", args.grammar_dtype)


def build_messages(n: int) -> list[list[dict]]:
    """n one-message chats, one subject each (the subjects repeat, numbered, past len(SUBJECTS))."""
    chats = []
    for i in range(n):
        subject = SUBJECTS[i % len(SUBJECTS)] + (
            "" if i < len(SUBJECTS) else f" (number {i // len(SUBJECTS) + 1})"
        )
        text = (
            f"Describe {subject} as a JSON object: its name, what kind of thing it is, a one-sentence "
            f"description, a rating from 1 to 10 and up to three tags."
        )
        chats.append([{"role": "user", "content": text}])
    return chats


# ------------------------------------------------------------------ runs


def _constrained_params() -> dict:
    return {"max_new_tokens": MAX_NEW_TOKENS, "temperature": 0, "json_schema": SCHEMA}


def _unconstrained_params(counts: list[int]) -> list[dict]:
    """Each request exactly the tokens its constrained twin generated."""
    return [{"max_new_tokens": c, "temperature": 0, "ignore_eos": True} for c in counts]


def _run(engine, chats: list[list[dict]], params) -> dict:
    """One generate over all chats, the prefix cache flushed first; wall time and the grammar counters' deltas."""
    engine.flush_cache()
    s0 = engine.get_stats()
    t0 = time.perf_counter()
    outs = engine.generate(messages=chats, sampling_params=params)
    wall = time.perf_counter() - t0
    s1 = engine.get_stats()
    counts = [o["meta_info"]["completion_tokens"] for o in outs]
    return {
        "wall_s": wall,
        "generated_tokens": sum(counts),
        "tokens_per_s": sum(counts) / wall,
        "decode_steps": s1["decode_steps"] - s0["decode_steps"],
        "mask_s": s1["grammar_mask_seconds"] - s0["grammar_mask_seconds"],
        "mask_steps": s1["grammar_mask_steps"] - s0["grammar_mask_steps"],
        "compiles": len(s1["grammar_compile_seconds"]) - len(s0["grammar_compile_seconds"]),
        "counts": counts,
        "texts": [o["text"] for o in outs],
        "finish": [(o["meta_info"]["finish_reason"] or {}).get("type") for o in outs],
    }


def _valid(texts: list[str]) -> list[bool]:
    """Each text parses as JSON and validates against SCHEMA (jsonschema, the schema's own draft)."""
    import jsonschema

    validator = jsonschema.validators.validator_for(SCHEMA)(SCHEMA)
    out = []
    for text in texts:
        try:
            out.append(validator.is_valid(json.loads(text)))
        except ValueError:
            out.append(False)
    return out


def _single(engine, chat: list[dict], params: dict) -> dict:
    """One request alone, the prefix cache flushed first: its first-token latency, and whether it compiled."""
    engine.flush_cache()
    before = len(engine.get_stats()["grammar_compile_seconds"])
    out = engine.generate(messages=[chat], sampling_params=[params])[0]
    after = engine.get_stats()["grammar_compile_seconds"]
    return {
        "first_token_latency_s": out["meta_info"]["first_token_latency"],
        "completion_tokens": out["meta_info"]["completion_tokens"],
        "compile_list_len": len(after),
        "compiled": len(after) - before,
    }


def _compile_split(tokenizer, model_dir: str) -> dict:
    """The first compile's parts, timed in this process: the xgrammar backend's setup for the vocabulary
    (tokenizer info, compiler) and the schema's compile on that fresh compiler."""
    import xgrammar as xgr

    from engine.grammar.constraints import normalize

    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    eos = cfg.get("eos_token_id")
    stop = eos if isinstance(eos, list) else [eos] if eos is not None else None
    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(
        tokenizer, vocab_size=cfg["vocab_size"], stop_token_ids=stop
    )
    compiler = xgr.GrammarCompiler(info, max_threads=1)
    t1 = time.perf_counter()
    compiler.compile_json_schema(
        normalize({"json_schema": SCHEMA})["json_schema"], any_whitespace=False
    )
    t2 = time.perf_counter()
    return {"backend_setup_s": t1 - t0, "schema_compile_s": t2 - t1}


def run_grammar(args: argparse.Namespace) -> dict:
    from engine import Engine

    chats = build_messages(args.grammar_prompts)
    rounds = args.grammar_rounds
    with Engine(dtype=args.grammar_dtype) as engine:
        dtype, model_dir, tokenizer = (
            engine.server_info["dtype"],
            engine.model_dir,
            engine.tokenizer,
        )
        print("[grammar] warm-up: unconstrained, 2 requests ...", flush=True)
        engine.generate(
            messages=chats[-2:][::-1], sampling_params={"max_new_tokens": 8, "temperature": 0}
        )
        assert not engine.get_stats()["grammar_compile_seconds"], (
            "a constraint was compiled before the first one"
        )
        print("[grammar] first constrained request (compiles the schema) ...", flush=True)
        first = _single(engine, chats[0], _constrained_params())
        first_compile = engine.get_stats()["grammar_compile_seconds"]
        repeats = {"constrained_cached": [], "unconstrained": []}
        for r in range(rounds + 1):
            for name in (
                ("constrained_cached", "unconstrained")
                if r % 2 == 0
                else ("unconstrained", "constrained_cached")
            ):
                print(f"[grammar] one request, round {r + 1}: {name} ...", flush=True)
                params = (
                    _constrained_params()
                    if name == "constrained_cached"
                    else _unconstrained_params([first["completion_tokens"]])[0]
                )
                repeats[name].append(_single(engine, chats[0], params))
        print(f"[grammar] warm-up: constrained, {len(chats)} requests ...", flush=True)
        warm_c = _run(engine, chats, _constrained_params())
        counts = warm_c["counts"]
        print(f"[grammar] warm-up: unconstrained, {len(chats)} requests ...", flush=True)
        warm_u = _run(engine, chats, _unconstrained_params(counts))
        runs: dict[str, list[dict]] = {"constrained": [], "unconstrained": []}
        for r in range(rounds):
            for name in (
                ("constrained", "unconstrained") if r % 2 == 0 else ("unconstrained", "constrained")
            ):
                print(f"[grammar] round {r + 1}: {name} ...", flush=True)
                params = (
                    _constrained_params()
                    if name == "constrained"
                    else _unconstrained_params(counts)
                )
                runs[name].append(_run(engine, chats, params))
        compile_list = engine.get_stats()["grammar_compile_seconds"]
    split = _compile_split(tokenizer, model_dir)

    all_c = [warm_c, *runs["constrained"]]
    all_u = [warm_u, *runs["unconstrained"]]
    best_c = min(runs["constrained"], key=lambda x: x["wall_s"])
    best_u = min(runs["unconstrained"], key=lambda x: x["wall_s"])
    valid = _valid(best_c["texts"])
    valid_all = [sum(_valid(r["texts"])) for r in all_c]

    def figures(r: dict) -> dict:
        keep = (
            "wall_s",
            "generated_tokens",
            "tokens_per_s",
            "decode_steps",
            "mask_s",
            "mask_steps",
            "compiles",
        )
        return {k: r[k] for k in keep}

    cached_ftl = min(x["first_token_latency_s"] for x in repeats["constrained_cached"])
    plain_ftl = min(x["first_token_latency_s"] for x in repeats["unconstrained"])
    return {
        "dtype": dtype,
        "requests": len(chats),
        "rounds": rounds,
        "schema": SCHEMA,
        "prompts": "chat prompts asking for a JSON object describing a thing (engine/bench/grammar.py SUBJECTS)",
        "max_new_tokens_constrained": MAX_NEW_TOKENS,
        "unconstrained_params": "max_new_tokens = the request's constrained completion_tokens, ignore_eos=True",
        "constrained": figures(best_c),
        "unconstrained": figures(best_u),
        "constrained_runs": [figures(r) for r in all_c],
        "unconstrained_runs": [figures(r) for r in all_u],
        "throughput_loss_pct": 100 * (1 - best_c["tokens_per_s"] / best_u["tokens_per_s"]),
        "mask_ms_per_step": 1000 * best_c["mask_s"] / max(best_c["mask_steps"], 1),
        "mask_share_of_wall_pct": 100 * best_c["mask_s"] / best_c["wall_s"],
        "mask_share_of_gap_pct": (
            100 * best_c["mask_s"] / (best_c["wall_s"] - best_u["wall_s"])
            if best_c["wall_s"] > best_u["wall_s"]
            else None
        ),
        "compile_first_s": first_compile[0] if first_compile else None,
        "compile_first_split": split,
        "compile_list_after_first": first_compile,
        "compile_list_at_end": compile_list,
        "cached_request_compiled": sum(x["compiled"] for x in repeats["constrained_cached"]),
        "first_token_latency_s": {
            "constrained_first": first["first_token_latency_s"],
            "constrained_cached": cached_ftl,
            "unconstrained": plain_ftl,
        },
        "single_requests": repeats,
        "valid": sum(valid),
        "valid_each_constrained_run": valid_all,
        "finish_reasons": {
            t: best_c["finish"].count(t) for t in sorted(set(map(str, best_c["finish"])))
        },
        "constrained_outputs_identical_across_runs": all(
            r["texts"] == warm_c["texts"] for r in all_c
        ),
        "unconstrained_exact_tokens": all(r["counts"] == counts for r in all_u),
        "sample_output": best_c["texts"][0],
        "target_loss_pct": 15.0,
    }


def print_grammar(r: dict) -> None:
    print(
        f"\nstructured output (one json_schema), {r['dtype']}, {r['requests']} requests ({r['prompts']}), "
        f"greedy, best of {r['rounds']} runs"
    )
    print(
        f"  unconstrained twin: {r['unconstrained_params']}: the same tokens per request "
        f"({'exact' if r['unconstrained_exact_tokens'] else 'NOT exact'})"
    )
    print(
        f"  {'mode':<16}{'wall s':>9}{'tokens':>9}{'tokens/s':>11}{'decode steps':>14}{'mask steps':>12}{'mask s':>9}"
    )
    for name in ("constrained", "unconstrained"):
        f = r[name]
        print(
            f"  {name:<16}{f['wall_s']:9.3f}{f['generated_tokens']:9d}{f['tokens_per_s']:11.1f}{f['decode_steps']:14d}"
            f"{f['mask_steps']:12d}{f['mask_s']:9.3f}"
        )
    loss, target = r["throughput_loss_pct"], r["target_loss_pct"]
    verdict = "within" if loss <= target else "MISSES"
    print(
        f"  throughput loss, constrained vs unconstrained: {loss:.1f}% ({verdict} the target <= {target:.0f}%)"
    )
    gap = r["mask_share_of_gap_pct"]
    gap_text = f", {gap:.0f}% of the wall-time gap" if gap is not None else ""
    print(
        f"  mask (fill + apply): {r['mask_ms_per_step']:.3f} ms/step over {r['constrained']['mask_steps']} steps, "
        f"{r['mask_share_of_wall_pct']:.1f}% of the constrained run's wall{gap_text}"
    )
    s = r["compile_first_split"]
    print(
        f"  compile, first (fresh engine, first constrained request): {r['compile_first_s']:.3f} s "
        f"(grammar_compile_seconds {_fmt_list(r['compile_list_after_first'])}; in this process: backend setup "
        f"{s['backend_setup_s']:.3f} s + schema {s['schema_compile_s']:.3f} s)"
    )
    print(
        f"  compile, cached (identical schema): {r['cached_request_compiled']} compiles over "
        f"{len(r['single_requests']['constrained_cached'])} requests; the list at the end "
        f"{_fmt_list(r['compile_list_at_end'])}"
    )
    ftl = r["first_token_latency_s"]
    print(
        f"  first-token latency, one request alone: constrained first {1000 * ftl['constrained_first']:.1f} ms "
        f"(compiles), constrained cached {1000 * ftl['constrained_cached']:.1f} ms, unconstrained "
        f"{1000 * ftl['unconstrained']:.1f} ms (best of {len(r['single_requests']['unconstrained'])})"
    )
    finish = ", ".join(f"{n} {t}" for t, n in r["finish_reasons"].items())
    print(
        f"  valid under the schema (jsonschema): {r['valid']}/{r['requests']} (every constrained run: "
        f"{r['valid_each_constrained_run']}); finish: {finish}; outputs identical across runs: "
        f"{'yes' if r['constrained_outputs_identical_across_runs'] else 'no'}"
    )
    print(f"  sample: {r['sample_output']}", flush=True)


def _fmt_list(xs: list[float]) -> str:
    return "[" + ", ".join(f"{x:.3f}" for x in xs) + "]"
