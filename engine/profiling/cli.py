"""engine profile [options] -- command ... ; engine dump [--pid PID]

profile runs the command, finds the engine's processes as they start, runs `py-spy record` on each,
and writes per role a flamegraph SVG, a speedscope JSON and the collapsed stacks, then prints and
writes (breakdown.json) the per-stage breakdown. dump prints a py-spy dump of every process of the
running engines, labelled by role.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from engine.profiling.breakdown import STAGES, breakdown, reading
from engine.profiling.discover import engine_processes
from engine.profiling.pyspy import ProfileError, dump, explain, find_pyspy, record_args
from engine.profiling.stacks import parse_collapsed, write_flamegraph, write_speedscope


def _roles(pids: dict[str, int]) -> list[str]:
    """user (or a remote machine's node), scheduler, the other tensor-parallel ranks' schedulers
    (scheduler-rank1, ...), detokenizer: those pids has."""
    first = [r for r in ("user", "node", "scheduler") if r in pids]
    ranks = sorted(
        (r for r in pids if r.startswith("scheduler-rank")),
        key=lambda r: int(r[len("scheduler-rank") :]),
    )
    return [*first, *ranks, *(["detokenizer"] if "detokenizer" in pids else [])]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="engine", description="py-spy profiling of the engine's processes"
    )
    sub = p.add_subparsers(dest="command", required=True)
    prof = sub.add_parser(
        "profile", help="run a command and profile its engine: engine profile [options] -- cmd ..."
    )
    prof.add_argument("--rate", type=int, default=100, help="samples per second")
    prof.add_argument(
        "--duration",
        type=float,
        default=None,
        help="seconds to sample (default: until the command ends)",
    )
    prof.add_argument(
        "--idle",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="include idle (waiting) frames; needed for the 'waiting on ZMQ' share",
    )
    prof.add_argument(
        "--native",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="include native frames",
    )
    prof.add_argument("--output", "-o", default="profile", help="output folder")
    prof.add_argument(
        "--start-timeout", type=float, default=300.0, help="seconds to wait for the engine to start"
    )
    prof.add_argument("cmd", nargs=argparse.REMAINDER, help="the command, after --")
    d = sub.add_parser("dump", help="py-spy dump of every process of the running engines")
    d.add_argument(
        "--pid", type=int, default=None, help="only the engine whose user process is PID"
    )
    return p


def _wait_for_engine(child: subprocess.Popen, timeout: float) -> dict[str, int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if child.poll() is not None:
            raise ProfileError(
                f"the command exited (code {child.returncode}) before an engine started"
            )
        found = engine_processes(child.pid)
        if found:
            return found[0]
        time.sleep(0.05)
    raise ProfileError(f"no engine started within {timeout:.0f}s (--start-timeout)")


def profile(args: argparse.Namespace) -> int:
    cmd = args.cmd[1:] if args.cmd and args.cmd[0] == "--" else args.cmd
    if not cmd:
        raise ProfileError("give the command to run after --, e.g. engine profile -- python run.py")
    pyspy = find_pyspy()
    created = not os.path.isdir(args.output)
    os.makedirs(args.output, exist_ok=True)
    try:
        return _profile(args, cmd, pyspy)
    except BaseException:
        if created:
            _remove_if_empty(args.output)
        raise


def _remove_if_empty(folder: str) -> None:
    """After a failed profile: the folder it created goes, with only the empty files py-spy left."""
    for name in os.listdir(folder):
        path = os.path.join(folder, name)
        if os.path.isfile(path) and os.path.getsize(path) == 0:
            os.remove(path)
    if not os.listdir(folder):
        os.rmdir(folder)


def _profile(args: argparse.Namespace, cmd: list[str], pyspy: str) -> int:
    try:
        child = subprocess.Popen(cmd)
    except OSError as exc:  # a mistyped command: one line, as every other profile error
        raise ProfileError(f"cannot run {cmd[0]!r}: {exc.strerror or exc}") from None
    try:
        pids = _wait_for_engine(child, args.start_timeout)
        print(
            f"engine profile: user {pids['user']}, scheduler {pids['scheduler']}, detokenizer {pids['detokenizer']}",
            file=sys.stderr,
        )
        recorders = {}
        for role in _roles(pids):
            raw = os.path.join(args.output, f"{role}.txt")
            argv = record_args(
                pyspy, pids[role], raw, args.rate, args.duration, args.idle, args.native
            )
            recorders[role] = (
                subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True),
                raw,
            )
        code = _wait_for_command(child)
    except BaseException:
        child.kill()
        child.wait()
        raise
    report: dict = {"command": cmd, "exit_code": code, "pids": pids, "processes": {}}
    failures = []
    for role, (rec, raw) in recorders.items():
        try:
            _, err = rec.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            rec.kill()
            _, err = rec.communicate()
            err = f"py-spy did not stop within 60 s of the command's end; killed. {err}"
        if not os.path.exists(raw) or os.path.getsize(raw) == 0:
            failures.append(f"{role}: {explain(err, pids[role])}")
            continue
        stacks = parse_collapsed(open(raw).read())
        write_flamegraph(
            stacks, f"engine::{role} (pid {pids[role]})", os.path.join(args.output, f"{role}.svg")
        )
        write_speedscope(
            stacks, f"engine::{role}", os.path.join(args.output, f"{role}.speedscope.json")
        )
        kind = "scheduler" if role.startswith("scheduler") else role  # a rank's: a scheduler's
        b = breakdown(stacks, idle=args.idle, role=kind)
        b["reading"] = reading(kind, b)
        report["processes"][role] = b
    with open(os.path.join(args.output, "breakdown.json"), "w") as f:
        json.dump(report, f, indent=2)
    _print(report)
    if failures:
        raise ProfileError("; ".join(failures))
    return code


def _wait_for_command(child: subprocess.Popen) -> int:
    """The command's exit code. On Ctrl-C (a terminal sends it to the whole group: the command and
    py-spy too) the command stops as it would unprofiled (an engine's stop hooks run, a server ends
    its streams, however long its --shutdown-timeout) and the profile is still written. Nothing is
    sent to it: a second SIGINT makes uvicorn drop its connections. A second Ctrl-C kills it."""
    try:
        return child.wait()
    except KeyboardInterrupt:
        print(
            "engine profile: interrupted; waiting for the command to stop (Ctrl-C again kills it)",
            file=sys.stderr,
        )
    try:
        return child.wait()
    except KeyboardInterrupt:
        child.kill()
        return child.wait()


def _print(report: dict) -> None:
    idle = all(p["idle_sampled"] for p in report["processes"].values())
    what = (
        "of all thread samples, idle included"
        if idle
        else "of on-CPU samples only (--no-idle): not of wall time"
    )
    print(f"\nper-stage share of samples (%, {what}), command exit code {report['exit_code']}")
    print(f"  {'stage':<18}" + "".join(f"{r:>13}" for r in report["processes"]))
    for stage in STAGES:
        cells = [
            f"{p['stages_pct'][stage]:13.1f}" if idle or stage != "waiting on ZMQ" else f"{'-':>13}"
            for p in report["processes"].values()
        ]
        print(f"  {stage:<18}" + "".join(cells))
    for role, p in report["processes"].items():
        left = p["all_samples"] - p["samples"]
        others = (
            f", {left} more in other threads, left out (breakdown.json lists them)" if left else ""
        )
        print(f"\n{role} ({p['samples']} samples{others}): {p['reading']}")
        for entry in p["top_own"][:5]:
            print(f"  {entry['pct']:5.1f}%  {entry['function']}")


def dump_all(args: argparse.Namespace) -> int:
    pyspy = find_pyspy()
    engines = engine_processes(node_ranks=True)
    if args.pid is not None:
        chosen = [e for e in engines if e.get("user", e.get("node")) == args.pid]
        if not chosen:
            raise ProfileError(_not_a_user_pid(args.pid, engines))
        engines = chosen
    if not engines:
        raise ProfileError(
            "no running engine found (looked for processes titled engine::scheduler)"
        )
    for pids in engines:
        for role in _roles(pids):
            print(f"==== {role} (pid {pids[role]}) ====")
            print(dump(pyspy, pids[role]))
    return 0


def _not_a_user_pid(pid: int, engines: list[dict[str, int]]) -> str:
    """--pid names an engine by its user process (the one that created Engine()): say what pid was
    given instead, and which pids would do."""
    for e in engines:
        owner = "user" if "user" in e else "node"
        for role, rpid in e.items():
            if rpid == pid and role != owner:
                return (
                    f"pid {pid} is the {role} of the engine whose {owner} process is {e[owner]}: "
                    f"--pid takes the {owner} process's pid (engine dump --pid {e[owner]})"
                )
    users = ", ".join(str(e["user"]) for e in engines if "user" in e)
    running = f"running engines' user processes: {users}" if users else "no engine is running"
    return (
        f"pid {pid} is not the user process of a running engine (--pid takes the pid that created "
        f"Engine()); {running}"
    )


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return profile(args) if args.command == "profile" else dump_all(args)
    except ProfileError as exc:
        print(f"engine {args.command}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
