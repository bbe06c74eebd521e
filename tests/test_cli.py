"""``python -m pyattn``: an argparse command line (``check``, the default, with room for more
commands), a header over every column, the shapes it checks, and a non-zero exit on any
failure."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from pyattn import selfcheck

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_help_from_the_shell():
    run = subprocess.run([sys.executable, "-m", "pyattn", "--help"], cwd=REPO, capture_output=True,
                         text=True, timeout=120, env={**os.environ, "PYTHONPATH": REPO})
    assert run.returncode == 0, run.stderr
    assert "usage: python -m pyattn" in run.stdout and "check" in run.stdout


def test_check_help_lists_options(capsys):
    with pytest.raises(SystemExit) as e:
        selfcheck.main(["check", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for option in ("--ops", "--threads", "--seed"):
        assert option in out


@pytest.mark.parametrize("argv", [["--bogus"], ["check", "--bogus"], ["--ops", "no_such_op"], ["--threads", "0"],
                                  ["frobnicate"]])
def test_bad_command_lines_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as e:
        selfcheck.main(argv)
    assert e.value.code == 2
    assert "usage: python -m pyattn" in capsys.readouterr().err


def test_report_headers_and_shapes(capsys):
    assert selfcheck.main(["--ops", "efficient_attention", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert "efficient_attention: q[2,120,3,16] k[2,150,3,16] v[2,150,3,12]; finite differences on" in out
    lines = out.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("op "))
    columns = lines[head].split("  ")
    names = [c.strip() for c in columns if c.strip()]
    assert names == ["op", "form", "err f64", "err f32", "grad vs finite diff (f64)", "grad f32 vs f64",
                     "fwd ms", "fwd+bwd ms", "result"]
    row = lines[head + 2].split()
    assert row[0] == "efficient_attention" and row[1] == "parallel" and row[-1] == "ok"
    assert "1 passed, 0 failed" in out


def test_a_failure_exits_1(monkeypatch, capsys):
    real = selfcheck.check_op

    def failing(name, seed=0):
        rows = real(name, seed)
        rows[0].ok = False
        return rows

    monkeypatch.setattr(selfcheck, "check_op", failing)
    assert selfcheck.main(["--ops", "efficient_attention"]) == 1
    assert "0 passed, 1 failed: efficient_attention/parallel" in capsys.readouterr().out


def test_time_warms_up_first():
    calls = []
    selfcheck._time(lambda: calls.append(1), warmup=3, min_time=0.0)
    assert len(calls) == 3 + 3  # the warm-up calls, then at least three timed ones
