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
