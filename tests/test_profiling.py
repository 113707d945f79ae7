"""engine profile / engine dump with the real py-spy against real engines, and their failures."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path
from xml.etree import ElementTree

import pytest

from engine.profiling.breakdown import MIN_SAMPLES, breakdown, reading
from engine.profiling.stacks import write_flamegraph

ENGINE_CLI = [sys.executable, "-m", "engine.profiling.cli"]

# The profiled workload: 2000 one-token prompts, 24 tokens each, on a micro model (one layer 32 wide,
# a 1024-token vocabulary, the SmolLM2 tokenizer). A step for all 2000 rows costs the scheduler only
# a few times what the detokenizer's batch decode of their 2000 new tokens costs, so a few seconds of
# serving give the detokenizer hundreds of working samples at --rate 500 (on the embedded model the
# forward is about a thousand times the decode: minutes of profiling for as many). One torch thread:
# the scheduler and the detokenizer each keep a core of a small machine.
WORKLOAD = textwrap.dedent(
    """
    import sys
    from engine import Engine

    if __name__ == "__main__":
        model, requests = sys.argv[1], int(sys.argv[2])
        with Engine(model_path=model, dtype="float32", num_threads=1, max_total_tokens=60000,
                    max_running_requests=2048) as engine:
            engine.generate(input_ids=[[100 + i % 900] for i in range(requests)],
                            sampling_params={"max_new_tokens": 24, "temperature": 0, "ignore_eos": True})
    """
)
REQUESTS = 2000


@pytest.fixture(scope="module")
def micro_model(tmp_path_factory, model_dir) -> str:
    import shutil

    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from conftest import TOKENIZER_FILES

    folder = tmp_path_factory.mktemp("micro-llama")
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=1024,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        initializer_range=0.2,
        eos_token_id=2,
        bos_token_id=1,
    )
    AutoModelForCausalLM.from_config(
        config, dtype=torch.float32, attn_implementation="sdpa"
    ).save_pretrained(folder)
    for name in TOKENIZER_FILES:
        if (Path(model_dir) / name).exists():
            shutil.copy(Path(model_dir) / name, folder / name)
    return str(folder)


def profile(
    folder: Path, model: str, env_extra: dict | None = None
) -> tuple[subprocess.CompletedProcess, dict]:
    (folder / "workload.py").write_text(WORKLOAD)
    env = {k: v for k, v in os.environ.items() if k != "ENGINE_PLUGINS"}
    env.update(env_extra or {})
    proc = subprocess.run(
        [
            *ENGINE_CLI,
            "profile",
            "--rate",
            "500",
            "-o",
            "out",
            "--",
            sys.executable,
            "workload.py",
            model,
            f"{REQUESTS}",
        ],
        cwd=folder,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc, json.loads((folder / "out" / "breakdown.json").read_text())


# One profile of the workload as is and one with skipdetok, shared by the tests that read them.
@pytest.fixture(scope="module")
def plain_profile(tmp_path_factory, micro_model) -> tuple[Path, subprocess.CompletedProcess, dict]:
    folder = tmp_path_factory.mktemp("profile-plain")
    return (folder, *profile(folder, micro_model))


@pytest.fixture(scope="module")
def skipdetok_profile(tmp_path_factory, micro_model) -> dict:
    return profile(
        tmp_path_factory.mktemp("profile-skipdetok"), micro_model, {"ENGINE_PLUGINS": "skipdetok"}
    )[1]


def test_profile_writes_three_flamegraphs_and_a_breakdown(plain_profile):
    folder, proc, report = plain_profile
    assert set(report["processes"]) == {"user", "scheduler", "detokenizer"}
    for role, p in report["processes"].items():
        svg = (folder / "out" / f"{role}.svg").read_text()
        assert svg.startswith("<svg") and "<rect" in svg
        ElementTree.parse(folder / "out" / f"{role}.svg")  # well-formed XML, as browsers demand
        speedscope = json.loads((folder / "out" / f"{role}.speedscope.json").read_text())
        assert p["samples"] > 0 and sum(speedscope["profiles"][0]["weights"]) >= p["samples"]
        assert sum(p["stages_pct"].values()) == pytest.approx(100.0)
        assert p["reading"] and p["top_own"]
    assert report["processes"]["scheduler"]["stages_pct"]["forward"] > 0
    assert "per-stage share of samples (%, of all thread samples, idle included)" in proc.stdout
    # py-spy recorded threads: a child's serving thread alone is shared out, the user's engine threads
    counted = {
        role: {t["thread"].split(": ", 1)[1] for t in p["threads"] if t["counted"]}
        for role, p in report["processes"].items()
    }
    assert counted["scheduler"] == counted["detokenizer"] == {"MainThread"}, counted
    assert {"MainThread", "engine-recv"} <= counted["user"], counted
    assert all(p["samples"] <= p["all_samples"] for p in report["processes"].values())


def test_detokenizer_heavy_workload_and_skipdetok(plain_profile, skipdetok_profile):
    detok = plain_profile[2]["processes"]["detokenizer"]
    # enough working samples for the reading to speak
    assert detok["busy_samples"] >= MIN_SAMPLES, detok
    # the decode stage dominates the detokenizer's work
    assert detok["busy_stages_pct"]["detokenize"] > 50, detok
    assert "skipdetok" in detok["reading"]
    # the same workload with skipdetok: the detokenize stage takes far fewer samples
    decode_plain = detok["stage_samples"]["detokenize"]
    decode_skipped = skipdetok_profile["processes"]["detokenizer"]["stage_samples"]["detokenize"]
    assert decode_plain >= MIN_SAMPLES, detok  # enough samples to compare
    assert decode_skipped < decode_plain / 2, (decode_plain, decode_skipped)


def test_dump_lists_the_three_roles(engine):
    proc = subprocess.run(
        [*ENGINE_CLI, "dump", "--pid", str(os.getpid())],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    for role in ("user", "scheduler", "detokenizer"):
        assert f"==== {role} (pid {engine.pids[role]}) ====" in proc.stdout
    assert "serve_forever" in proc.stdout


def test_two_engines_of_one_process_are_found_apart(engine, tiny_engine):
    """One user process, two engines: each scheduler with its own detokenizer (their titles name the
    engine's socket directory). Merged by parent, the second engine's pids replaced the first's, and
    `engine dump --pid` printed another engine's scheduler."""
    from engine.profiling.discover import engine_processes

    found = engine_processes(os.getpid())
    for eng in (engine, tiny_engine):
        assert eng.pids in found, (eng.pids, found)


def test_titles_name_the_role_the_engine_and_rank_0s_count_of_ranks():
    from engine.profiling.discover import parse_title

    assert parse_title("engine::scheduler engine-ab12") == ("scheduler", "engine-ab12", 1)
    assert parse_title("engine::detokenizer engine-ab12") == ("detokenizer", "engine-ab12", 1)
    assert parse_title("engine::scheduler ranks=2 engine-ab12") == ("scheduler", "engine-ab12", 2)
    assert parse_title("engine::tp-rank1 engine-ab12") == ("scheduler-rank1", "engine-ab12", 1)
    assert parse_title("engine::tp-rank3") == ("scheduler-rank3", "", 1)  # another machine's rank
    assert parse_title("engine::schedulerX engine-ab12") is None
    assert parse_title("python run.py") is None and parse_title("") is None


def test_failures_are_one_line_and_non_zero(tmp_path, micro_model):
    def run(args, env_extra=None):
        env = {**os.environ, **(env_extra or {})}
        return subprocess.run(
            [*ENGINE_CLI, *args], capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path
        )

    missing = run(
        ["profile", "--", sys.executable, "-c", "pass"], {"ENGINE_PYSPY": str(tmp_path / "nope")}
    )
    assert (
        missing.returncode == 2
        and "py-spy not found" in missing.stderr
        and len(missing.stderr.strip().splitlines()) == 1
    )

    early = run(["profile", "--start-timeout", "60", "--", sys.executable, "-c", "pass"])
    assert early.returncode == 2 and "exited (code 0) before an engine started" in early.stderr

    fake = tmp_path / "py-spy"  # a py-spy that is refused as in a container without SYS_PTRACE
    fake.write_text("#!/bin/sh\necho 'Error: Permission Denied (os error 13)' >&2\nexit 1\n")
    fake.chmod(0o755)
    (tmp_path / "workload.py").write_text(WORKLOAD)
    denied = run(
        ["profile", "-o", "p", "--", sys.executable, "workload.py", micro_model, "2"],
        {"ENGINE_PYSPY": str(fake)},
    )
    assert denied.returncode == 2 and "ptrace" in denied.stderr and "SYS_PTRACE" in denied.stderr

    no_engine = run(["dump", "--pid", "1"])
    assert (
        no_engine.returncode == 2
        and "pid 1 is not the user process of a running engine" in no_engine.stderr
    )

    # a failed profile leaves no empty output folder behind
    gone = run(
        ["profile", "-o", "never", "--start-timeout", "60", "--", sys.executable, "-c", "pass"]
    )
    assert gone.returncode == 2 and not (tmp_path / "never").exists()

    no_cmd = run(["profile"])
    assert no_cmd.returncode == 2 and "give the command" in no_cmd.stderr


LOOP = textwrap.dedent(
    """
    import sys
    from engine import Engine

    if __name__ == "__main__":
        with Engine(model_path=sys.argv[1], dtype="float32", num_threads=1, max_total_tokens=4096) as engine:
            print("loop: serving", file=sys.stderr, flush=True)
            try:
                while True:  # until Ctrl-C; then the engine shuts down in order
                    engine.generate(input_ids=[[100 + i] for i in range(64)],
                                    sampling_params={"max_new_tokens": 8, "temperature": 0, "ignore_eos": True})
            except KeyboardInterrupt:
                pass
    """
)


def test_ctrl_c_lets_the_command_stop_in_order_and_still_writes_the_profile(tmp_path, micro_model):
    """Ctrl-C (SIGINT to the whole foreground group, as a terminal sends it) killed the command with
    SIGKILL, so its engine never shut down in order, and no flamegraph or breakdown was written."""
    import re
    import signal
    import threading
    import time

    from helpers import wait_gone

    (tmp_path / "loop.py").write_text(LOOP)
    env = {k: v for k, v in os.environ.items() if k != "ENGINE_PLUGINS"}
    proc = subprocess.Popen(
        [
            *ENGINE_CLI,
            "profile",
            "--rate",
            "200",
            "-o",
            "out",
            "--",
            sys.executable,
            "loop.py",
            micro_model,
        ],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 120
        # Engine() is up
        while not any("loop: serving" in line for line in lines) and time.monotonic() < deadline:
            assert proc.poll() is None, "".join(lines)
            time.sleep(0.05)
        found = re.search(r"user (\d+), scheduler (\d+), detokenizer (\d+)", "".join(lines))
        assert found, "".join(lines)
        time.sleep(2)  # some samples
        os.killpg(proc.pid, signal.SIGINT)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    reader.join(10)
    # the command's own code: it stopped in order
    assert proc.returncode == 0, "".join(lines)[-3000:]
    assert wait_gone([int(p) for p in found.groups()], 10) == []
    report = json.loads((tmp_path / "out" / "breakdown.json").read_text())
    assert set(report["processes"]) == {"user", "scheduler", "detokenizer"}
    assert all(
        (tmp_path / "out" / f"{role}.svg").stat().st_size > 0 for role in report["processes"]
    )


def test_dump_with_a_childs_pid_says_which_pid_it_takes(engine):
    for role in ("scheduler", "detokenizer"):
        proc = subprocess.run(
            [*ENGINE_CLI, "dump", "--pid", str(engine.pids[role])],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 2
        assert (
            f"pid {engine.pids[role]} is the {role} of the engine whose user process is {engine.pids['user']}"
            in proc.stderr
        )
        assert f"engine dump --pid {engine.pids['user']}" in proc.stderr


def test_flamegraph_labels_cut_to_the_box_stay_well_formed(tmp_path):
    """py-spy's frames <module>, <listcomp>, f.<locals>.g, cut at every width: never a split entity."""
    frames = [
        "<module> (run.py:1)",
        "<listcomp> (a.py:2)",
        "f.<locals>.g (b.py:3)",
        "h & 'q' \"r\" (c.py:4)",
        "bad\x01char (d.py:5)",
    ]
    for width in range(60, 400, 7):
        stacks = Counter({tuple(frames[: i + 1]): 1 + i for i in range(len(frames))})
        path = tmp_path / f"w{width}.svg"
        write_flamegraph(stacks, "engine::<test> & co", str(path), width=width)
        root = ElementTree.parse(path).getroot()
        texts = [t.text or "" for t in root.iter("{http://www.w3.org/2000/svg}text")]
        # labels are shown unescaped once parsed
        assert any(t.startswith("<") for t in texts[1:]), texts


def test_thread_frames_keep_their_name_and_id_in_every_output(tmp_path):
    """py-spy --threads starts each stack with `thread (<tid>): <name>`, and writes a `;` in a thread's
    name unescaped: the name's second part was taken for a frame, the speedscope file named every
    thread just `thread` (its id taken for a file or a line), and so did the flamegraph's boxes."""
    import json

    from engine.profiling.breakdown import split_thread
    from engine.profiling.stacks import parse_collapsed, write_speedscope

    raw = (
        "thread (6259): my;thread name;Thread.run (threading.py:982);spin (target.py:8);K.w\u00f6rk (target.py:6) 66\n"
        "thread (6256);<module> (<string>:1);main (x.py:3) 4\n"
    )
    stacks = parse_collapsed(raw)
    threads = {split_thread(stack)[0]: split_thread(stack)[1] for stack in stacks}
    assert threads == {
        "thread (6259): my;thread name": (
            "Thread.run (threading.py:982)",
            "spin (target.py:8)",
            "K.w\u00f6rk (target.py:6)",
        ),
        "thread (6256)": ("<module> (<string>:1)", "main (x.py:3)"),
    }
    write_speedscope(stacks, "t", str(tmp_path / "s.json"))
    frames = json.loads((tmp_path / "s.json").read_text())["shared"]["frames"]
    assert {"name": "thread (6259): my;thread name"} in frames and {
        "name": "thread (6256)"
    } in frames, frames
    assert {"name": "K.w\u00f6rk", "file": "target.py", "line": 6} in frames
    write_flamegraph(stacks, "t", str(tmp_path / "f.svg"), width=2000)
    texts = [
        t.text or ""
        for t in ElementTree.parse(tmp_path / "f.svg")
        .getroot()
        .iter("{http://www.w3.org/2000/svg}text")
    ]
    assert "thread (6259): my;thread name" in texts and "thread (6256)" in texts, texts


def _stacks(**stage_counts) -> Counter:
    functions = {
        "detokenize": "DetokenizerManager.detokenize (engine/detokenizer/manager.py:1)",
        "tokenize": "TokenizerManager.tokenize (engine/frontend/tokenizer_manager.py:1)",
        "forward": "Scheduler.forward (engine/scheduler/scheduler.py:1)",
        "wait": "poll (zmq/sugar/poll.py:1)",
        "other": "something_else (x.py:1)",
    }
    return Counter(
        {("<module> (run.py:1)", functions[stage]): n for stage, n in stage_counts.items() if n}
    )


def test_readings_say_when_samples_are_too_few_or_idle_was_not_sampled():
    # the case from the issue: --no-idle, a detokenizer idle nearly all the time, a user process with 5 samples
    detok = breakdown(_stacks(detokenize=3, other=2), idle=False)
    assert "too few" in reading("detokenizer", detok) and "wall" not in reading(
        "detokenizer", detok
    )
    user = breakdown(_stacks(tokenize=4, other=1), idle=False)
    assert "too few" in reading("user", user) and "tokeniz" not in reading("user", user)
    # enough samples, but without idle samples: shares of on-CPU time, never of wall time
    detok = breakdown(_stacks(detokenize=300, other=20), idle=False)
    line = reading("detokenizer", detok)
    assert "wall" not in line and "not sampled" in line and "skipdetok" in line
    user = breakdown(_stacks(tokenize=30, other=300), idle=False)
    assert "wall" not in reading("user", user) and "waits" not in reading("user", user)
    # with idle samples a detokenizer that mostly waits says so, and its few working samples are not read
    detok = breakdown(_stacks(wait=5000, detokenize=3, other=2), idle=True)
    assert "waits 100% of wall" in reading("detokenizer", detok) and "too few" in reading(
        "detokenizer", detok
    )
    sched = breakdown(_stacks(wait=500, forward=MIN_SAMPLES - 1), idle=True)
    assert "too few" in reading("scheduler", sched)
    sched = breakdown(_stacks(wait=500, forward=400, other=20), idle=True)
    assert "compute-bound" in reading("scheduler", sched)


def _line(func, marker: str) -> int:
    """The line of `func` holding `marker`, as py-spy names it in a frame: the line that holds it, or
    where a call the formatter split over lines (`time.sleep(` / `0.001` / `)`) begins."""
    import inspect

    lines, first = inspect.getsourcelines(func)
    flat = [text.strip() for text in lines]
    return first + next(
        i
        for i in range(len(flat))
        if marker in flat[i] or "".join(flat[i : i + 3]).startswith(marker)
    )


def _serve_forever_line(marker: str) -> int:
    from engine.scheduler.scheduler import Scheduler

    return _line(Scheduler.serve_forever, marker)


def test_only_the_threads_that_do_the_engines_work_count_and_idle_frames_wait():
    """A scheduler profile as `engine profile` records it (py-spy --threads): before, the grammar
    pool's idle worker counted as "other" work, the scheduler's 1 ms hold-back sleep as work, and
    OpenTelemetry's export thread (a Condition.wait) as "waiting on ZMQ"."""
    main, grammar, otel = (
        "thread (100): MainThread",
        "thread (101): engine-grammar_0",
        "thread (102): OtelBatchSpanProcessor",
    )
    loop = (
        "<module> (<string>:1)",
        "run_child (engine/processes/child.py:110)",
        f"Scheduler.serve_forever (engine/scheduler/scheduler.py:{_serve_forever_line('self.run_once()')})",
    )
    sleeping = f"Scheduler.serve_forever (engine/scheduler/scheduler.py:{_serve_forever_line('time.sleep(0.001)')})"
    idle_worker = (
        "Thread._bootstrap (threading.py:1002)",
        "Thread.run (threading.py:982)",
        "_worker (concurrent/futures/thread.py:81)",
    )
    stacks = Counter(
        {
            (
                main,
                *loop,
                "Scheduler.run_once (engine/scheduler/scheduler.py:150)",
                "Scheduler.forward (engine/scheduler/scheduler.py:202)",
            ): 100,
            (main, *loop[:2], sleeping): 300,
            (grammar, *idle_worker): 1000,
            (
                otel,
                "Thread._bootstrap (threading.py:1002)",
                "BatchProcessor.worker (opentelemetry/sdk/_shared_internal/__init__.py:170)",
                "Condition.wait (threading.py:331)",
            ): 1000,
        }
    )
    b = breakdown(stacks, role="scheduler")
    # the serving thread's samples are shared out
    assert b["samples"] == 400 and b["all_samples"] == 2400
    assert b["stages_pct"]["forward"] == pytest.approx(25.0) and b["stages_pct"][
        "waiting on ZMQ"
    ] == pytest.approx(75.0)
    assert b["stages_pct"]["other"] == 0.0 and b["busy_stages_pct"]["forward"] == pytest.approx(
        100.0
    )
    threads = {t["thread"]: (t["samples"], t["counted"]) for t in b["threads"]}
    assert threads == {main: (400, True), grammar: (1000, False), otel: (1000, False)}
    # without thread ids (py-spy run by hand, without --threads): an idle pool worker still waits
    b = breakdown(
        Counter(
            {tuple(f for f in s if not f.startswith("thread (")): n for s, n in stacks.items()}
        ),
        role="scheduler",
    )
    assert b["stage_samples"]["other"] == 0 and b["stage_samples"]["forward"] == 100
    # the user process: every thread that ran the engine's code counts (the callers, the receiver)
    from engine.frontend.receiver import Receiver

    polls = _line(Receiver.loop, "poller.poll(")
    user = Counter(
        {
            (
                "thread (1): MainThread",
                "<module> (run.py:5)",
                "Engine.generate (engine/frontend/engine.py:193)",
                "Event.wait (threading.py:622)",
            ): 50,
            (
                "thread (2): engine-recv",
                "Thread._bootstrap (threading.py:1002)",
                f"Receiver.loop (engine/frontend/receiver.py:{polls})",
            ): 50,
            (
                otel,
                "Thread._bootstrap (threading.py:1002)",
                "Condition.wait (threading.py:331)",
            ): 900,
            # the plugins' service threads run engine code too, but none of the engine's own work: the export
            # thread through the tracing plugin's file exporter, the metrics plugin's scrape server
            (
                otel,
                "Thread._bootstrap (threading.py:1002)",
                "FileSpanExporter.export (engine/tracing/file_exporter.py:40)",
            ): 5,
            (
                "thread (3): metrics",
                "Thread._bootstrap (threading.py:1002)",
                "serve (engine/plugins/metrics.py:90)",
                "select (selectors.py:415)",
            ): 800,
        }
    )
    b = breakdown(user, role="user")
    assert b["samples"] == 100 and b["stages_pct"]["waiting on ZMQ"] == pytest.approx(100.0)


def test_profile_records_thread_ids():
    from engine.profiling.pyspy import record_args

    assert "--threads" in record_args("py-spy", 1, "out.txt", 100, None, True, False)
