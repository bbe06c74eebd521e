"""``python -m pyattn``: an argparse command line (``check``, the default, ``train`` and
``generate``), a header over every column, the shapes it checks, and a non-zero exit on any
failure; ``train`` checks its arguments before any work, stops on a diverging loss, saves a
checkpoint on Ctrl-C, and ``generate`` decodes a saved model."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from pyattn import selfcheck

from conftest import sigint_default_in_child


def test_help_from_the_shell():
    run = subprocess.run([sys.executable, "-m", "pyattn", "--help"], capture_output=True,
                         text=True, timeout=120)
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


# python -m pyattn train / generate, run as a user would: a subprocess, tiny models, few steps
def tiny(steps=4):
    return ["--steps", steps, "--examples", "32", "--seq-len", "16", "--kv-pairs", "2", "--vocab", "16",
            "--d-model", "16", "--heads", "2", "--mixers", "gated_deltanet,softmax", "--no-progress"]


def pyattn_cli(*args, timeout=120, **kw):
    return subprocess.run([sys.executable, "-m", "pyattn", *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, **kw)


@pytest.mark.parametrize("bad, named", [
    (["--heads", "0"], "--heads"), (["--steps", "0"], "--steps"), (["--batch-size", "0"], "--batch-size"),
    (["--d-model", "0"], "--d-model"), (["--examples", "0"], "--examples"), (["--lr", "nan"], "--lr"),
    (["--lr", "-1e-3"], "--lr"), (["--eval-every", "0"], "--eval-every"), (["--seed", "-1"], "--seed"),
    (["--mixers", "softmax,nope"], "nope"), (["--layers", "3"], "--mixers"),
    (["--d-model", "12", "--heads", "8"], "--heads"),  # the mixers' head dim would be 1.5
    (["--kv-pairs", "5"], "seq_len"),  # mqar: 16 tokens hold at most 4 pairs and their queries
    (["--task", "text"], "--text"), (["--task", "text", "--text", "/no/such/file.txt"], "/no/such/file.txt"),
    (["--out", "/no/such/folder/m.npz"], "--out"), (["--out", "."], "--out"),
    (["--checkpoint", "/no/such/folder/c.npz"], "--checkpoint"), (["--beta2", "1"], "--beta2"),
])
def test_train_checks_its_arguments_before_any_work(tmp_path, bad, named):
    """Exit 2 with argparse's usage and one error line naming the culprit, before data or a
    model are built: 10**9 steps would otherwise run past the time limit."""
    run = pyattn_cli("train", *tiny(10**9), "--out", tmp_path / "m.npz", *bad, timeout=60)
    assert run.returncode == 2, run.stderr
    assert "usage: python -m pyattn train" in run.stderr and "Traceback" not in run.stderr
    error = run.stderr.strip().splitlines()[-1]
    assert error.startswith("python -m pyattn train: error:") and named in error, error
    assert not os.listdir(tmp_path)


def test_train_help_shows_the_defaults():
    run = pyattn_cli("train", "--help")
    assert run.returncode == 0, run.stderr
    text = " ".join(run.stdout.split())
    for shown in ("--steps STEPS training steps (default: 500)", "--lr LR", "(default: 0.001)", "--eval-every",
                  "(default: model.npz)", "(default: gated_deltanet,softmax)"):
        assert shown in text, shown


def test_train_eval_every_and_a_checkpoint_of_other_settings(tmp_path):
    ckpt = tmp_path / "c.npz"
    run = pyattn_cli("train", *tiny(), "--eval-every", "2", "--checkpoint", ckpt, "--out", tmp_path / "m.npz")
    assert run.returncode == 0, run.stderr
    with np.load(ckpt) as f:
        meta = json.loads(str(f["__meta__"]))
    assert meta["history"]["eval_step"] == [1, 3] and meta["settings"]["eval_every"] == 2
    run = pyattn_cli("train", *tiny(), "--eval-every", "2", "--checkpoint", ckpt, "--lr", "2e-3",
                     "--out", tmp_path / "m.npz")
    error = run.stderr.strip().splitlines()[-1]
    assert run.returncode == 2 and error.startswith("python -m pyattn train: error: --checkpoint: checkpoint")
    assert "other settings" in error and "'lr': (0.001, 0.002)" in error, error


def test_a_diverging_run_exits_1_without_saving(tmp_path):
    out = tmp_path / "m.npz"
    run = pyattn_cli("train", *tiny(20), "--lr", "1e6", "--out", out)
    assert run.returncode == 1 and "Traceback" not in run.stderr  # numpy's overflow warnings may come first
    last = run.stderr.strip().splitlines()[-1]
    assert re.search(r"loss is (nan|inf) at step \d+", last) and "not saved" in last, last
    assert not out.exists()


def test_ctrl_c_saves_the_checkpoint_and_exits_130_with_one_line(tmp_path):
    ckpt, out = tmp_path / "c.npz", tmp_path / "m.npz"
    args = ["train", *tiny(100000), "--eval-every", "1", "--checkpoint", ckpt, "--out", out]
    proc = subprocess.Popen([sys.executable, "-m", "pyattn", *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, preexec_fn=sigint_default_in_child)
    try:
        deadline = time.monotonic() + 60
        while not ckpt.exists() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)  # training runs once the first checkpoint is there
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and stdout == "", stderr
    done = int(re.search(r"interrupted after (\d+) of 100000 steps", lines[0]).group(1))
    assert str(ckpt) in lines[0] and "resume" in lines[0]
    with np.load(ckpt) as f:
        assert json.loads(str(f["__meta__"]))["step"] == done
    assert not out.exists()


@pytest.mark.skip_under_sanitizer  # a dozen processes of command-line parsing
def test_text_model_keeps_its_vocabulary_and_generate_writes_text(tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("the cat sat on the mat. " * 20, encoding="utf-8")
    out = tmp_path / "m.npz"
    run = pyattn_cli("train", "--task", "text", "--text", text, "--steps", "3", "--seq-len", "12", "--d-model", "16",
                     "--heads", "2", "--mixers", "softmax", "--no-progress", "--out", out)
    assert run.returncode == 0, run.stderr
    from pyattn.nn import HybridLM

    assert HybridLM.load(out).vocab == sorted(set("the cat sat on the mat. "))
    run = pyattn_cli("generate", out, "--prompt", "the c", "--max-new-tokens", "7", "--temperature", "0")
    assert run.returncode == 0, run.stderr
    line = run.stdout.rstrip("\n")
    assert len(line) == 12 and line.startswith("the c") and set(line) <= set("the cat sat on the mat. ")
    run = pyattn_cli("generate", out, "--prompt", "the dog")
    assert run.returncode == 2 and "'d', 'g'" in run.stderr.strip().splitlines()[-1]


@pytest.mark.skip_under_sanitizer  # a dozen processes of command-line parsing
def test_generate_continues_token_ids(tmp_path):
    out = tmp_path / "m.npz"
    assert pyattn_cli("train", *tiny(), "--out", out).returncode == 0
    run = pyattn_cli("generate", out, "--prompt", "3 9,12", "--max-new-tokens", "5", "--top-k", "3", "--seed", "1")
    assert run.returncode == 0, run.stderr
    ids = [int(t) for t in run.stdout.split()]
    assert len(ids) == 8 and ids[:3] == [3, 9, 12] and all(0 <= t < 16 for t in ids)
    assert pyattn_cli("generate", out, "--prompt", "3 9,12", "--max-new-tokens", "5", "--top-k", "3",
                      "--seed", "1").stdout == run.stdout
    for bad, named in ((["--prompt", "3 16"], "16"), (["--prompt", "a b"], "--prompt"), (["--prompt", ""], "--prompt"),
                       (["--prompt", "1", "--temperature", "-1"], "--temperature"),
                       (["--prompt", "1", "--top-k", "0"], "--top-k")):
        run = pyattn_cli("generate", out, *bad)
        assert run.returncode == 2 and named in run.stderr.strip().splitlines()[-1], run.stderr
    (tmp_path / "bad.npz").write_bytes(b"PK\x03\x04 not a model")
    run = pyattn_cli("generate", tmp_path / "bad.npz", "--prompt", "1")
    assert run.returncode == 2 and "bad.npz" in run.stderr and "Traceback" not in run.stderr
