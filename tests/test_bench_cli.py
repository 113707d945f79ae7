"""The benchmark's command line refuses bad arguments before it runs anything (a run takes up to half an hour)."""

from __future__ import annotations

import pytest

from engine.bench.cli import parse_args


def test_out_that_is_a_directory_is_refused_at_once(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(["--workload", "cpu", "--out", str(tmp_path)])
    assert exc.value.code == 2
    assert "--out must be the path of the JSON file" in capsys.readouterr().err


def test_out_that_is_a_file_path_is_taken(tmp_path):
    assert parse_args(["--out", str(tmp_path / "cpu.json")]).out == str(tmp_path / "cpu.json")


def test_cpu_engine_runs_again_after_the_baselines_unless_told_not_to(capsys, monkeypatch):
    """A, B, A: the first engine mode runs again after transformers and llama.cpp (the machine's speed moves
    between runs a quarter of an hour apart), and each ratio is printed against both engine runs. The
    children are stubbed here (a real run takes half an hour): what is checked is the order of the runs."""
    from engine.bench.cpu_speed import print_cpu

    assert parse_args(["--workload", "cpu"]).cpu_engine_again is True
    assert parse_args(["--workload", "cpu", "--no-cpu-engine-again"]).cpu_engine_again is False

    def figures(tok_s: float) -> dict:
        return {
            "startup": {"import_s": 0.1, "load_s": 1.0, "total_s": 1.1},
            "memory": {"rss_mb": 600.0, "pss_mb": 500.0},
            "single": {"ttft_s": 0.1, "decode_tokens_per_s": 50.0, "new_tokens": 256},
            "batch": {"tokens_per_s": tok_s, "wall_s": 8192 / tok_s, "setting": "one call"},
        }

    from engine.bench import cpu_speed

    order = []
    monkeypatch.setattr(
        cpu_speed,
        "_child",
        lambda backend, fn, cfg: order.append((backend, cfg.get("mode"))) or figures(1.0),
    )
    monkeypatch.setattr(cpu_speed, "hf_dtypes", lambda modes: ["float32"])
    for again in (True, False):
        order.clear()
        args = parse_args(
            ["--workload", "cpu", "--cpu-quantizations", "none,int8", "--cpu-skip-llama"]
            + ([] if again else ["--no-cpu-engine-again"])
        )
        result = cpu_speed.run_cpu(args)
        runs = [("engine", "none"), ("engine", "int8"), ("transformers", None)] + (
            [("engine", "none")] if again else []
        )
        assert order == runs and ("engine none again" in result["backends"]) == again

    backends = {
        "engine none": figures(330.0),
        "transformers bfloat16": figures(100.0),
        "engine none again": figures(300.0),
    }
    settings = {
        "prompt_len": 128,
        "new_tokens": 256,
        "num_prompts": 64,
        "min_len": 32,
        "max_len": 512,
        "max_new_tokens": 128,
    }
    print_cpu({"machine": "test", "backends": backends, "settings": settings})
    out = capsys.readouterr().out
    assert (
        "engine none / transformers bfloat16" in out
        and "engine none again / transformers bfloat16" in out
    )
    batch = out[out.index("batch (generated tokens / wall)") :]
    assert "3.30x" in batch and "3.00x" in batch


def test_layers_workload_prints_each_configuration_against_the_untapped_one(engine, capsys):
    """A short form of `--workload layers` on the shared engine (one round, two tiny requests): every
    configuration runs and prints its row with a ratio to the untapped one; capture returns its rows."""
    from engine.bench.layers import CONFIGS, measure, print_layers

    args = parse_args(
        ["--workload", "layers", "--layers-rounds", "1", "--num-prompts", "2"]
        + ["--min-len", "8", "--max-len", "16", "--max-new-tokens", "3"]
    )
    r = measure(engine, args)
    print_layers(r)
    table = capsys.readouterr().out
    assert f"decode path the engine chose: {r['decode_path']} " in table
    rows = [line.split() for line in table.splitlines() if " tok/s " in line]
    assert [" ".join(row[: row.index("tok/s") - 1]) for row in rows] == list(CONFIGS)
    assert all(row[row.index("tok/s") + 1].endswith("x") for row in rows) and rows[0][3] == "1.000x"
    assert r["tokens"] == dict.fromkeys(CONFIGS, 6) and not any(r["short_requests"].values())
    assert r["state_rows"] == {"none": 0, "capture last": 2, "capture generated": 6, "steer": 0}
