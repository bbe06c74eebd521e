"""pyattn.data's tasks (MQAR as Zoology builds it, copying, character text) and the training
loop: pyattn.train, its history, the command line."""
import json
import os
import re
import signal
import subprocess
import sys
import types

import numpy as np
import pytest

import pyattn
from pyattn import data


def test_mqar_structure():
    N, T, P, V = 64, 64, 8, 128
    x, y = data.mqar(N, T, P, V, seed=3)
    assert x.shape == y.shape == (N, T) and x.dtype == y.dtype == np.int64
    keys, values = x[:, 0:2 * P:2], x[:, 1:2 * P:2]
    assert np.all((keys >= 1) & (keys < V // 2)) and np.all((values >= V // 2) & (values < V))
    for n in range(N):
        assert len(set(keys[n])) == P and len(set(values[n])) == P
        asked = np.nonzero(y[n] != -100)[0]
        assert len(asked) == P and np.all(asked >= 2 * P) and np.all((asked - 2 * P) % 2 == 0)
        answer = dict(zip(keys[n], values[n]))
        assert sorted(x[n, asked]) == sorted(keys[n])  # every key queried once
        assert all(y[n, t] == answer[x[n, t]] for t in asked)
    np.testing.assert_array_equal(data.mqar(N, T, P, V, seed=3)[0], x)


def test_mqar_gaps_follow_a_power_law():
    x, y = data.mqar(2000, 256, 4, 512, seed=0)
    gaps = (np.nonzero(y != -100)[1] - 8) // 2
    counts = np.bincount(gaps, minlength=124)
    assert counts[:10].sum() > counts[-60:].sum()  # most queries come soon after the pairs
    with pytest.raises(ValueError, match="seq_len"):
        data.mqar(4, 16, 8, 512)


def test_copy_task():
    x, y = data.copy_task(5, 11, 9, seed=1)
    L = 5
    assert np.all(x[:, L] == 0) and np.all(x[:, :L] >= 1)
    np.testing.assert_array_equal(x[:, L + 1:2 * L + 1], x[:, :L])
    np.testing.assert_array_equal(y[:, L:2 * L], x[:, :L])
    assert np.all(y[:, :L] == -100) and np.all(y[:, 2 * L:] == -100)


def test_char_text(tmp_path):
    path = tmp_path / "t.txt"
    path.write_text("abcabcabd!", encoding="utf-8")
    x, y, vocab = data.char_text(str(path), 3)
    assert vocab == sorted(set("abcabcabd!"))
    text = "".join(vocab[i] for i in x.ravel())
    assert text == "abcabcabd"
    np.testing.assert_array_equal(y.ravel(), [vocab.index(c) for c in "bcabcabd!"])


def test_train_lowers_the_loss_and_records_history():
    x, y = data.mqar(256, 32, 2, 32, seed=0)
    model = pyattn.nn.HybridLM(32, 16, 2, ["gated_deltanet", "softmax"], n_heads=2, seed=1)
    h = pyattn.train(model, (x, y), steps=30, batch_size=16, lr=3e-3, eval_data=(x[:64], y[:64]),
                     eval_every=10, progress=False)
    assert h["step"] == list(range(30)) and len(h["loss"]) == len(h["lr"]) == 30
    assert h["eval_step"] == [9, 19, 29] and len(h["accuracy"]) == 3
    assert np.mean(h["loss"][-5:]) < np.mean(h["loss"][:5])
    assert h["lr"][2] == pytest.approx(3e-3) and h["lr"][-1] < 1e-4  # warm-up 3 steps, cosine to 0


def test_command_line_train(tmp_path, capsys):
    from pyattn.selfcheck import main

    out = tmp_path / "m.npz"
    rc = main(["train", "--steps", "3", "--examples", "32", "--seq-len", "16", "--kv-pairs", "2",
               "--vocab", "16", "--d-model", "16", "--heads", "2", "--mixers", "gated_deltanet,softmax",
               "--out", str(out), "--no-progress"])
    assert rc == 0 and "held-out accuracy" in capsys.readouterr().out
    model = pyattn.nn.HybridLM.load(str(out))
    assert model.forward(np.zeros((1, 4), np.int64)).shape == (1, 4, 16)


def test_command_line_train_resumes_from_its_checkpoint(tmp_path, capsys):
    from pyattn.selfcheck import main

    args = ["train", "--steps", "4", "--examples", "32", "--seq-len", "16", "--kv-pairs", "2",
            "--vocab", "16", "--d-model", "16", "--heads", "2", "--mixers", "deltanet", "--no-progress"]
    assert main(args + ["--out", str(tmp_path / "a.npz")]) == 0
    whole = capsys.readouterr().out.splitlines()[0]
    ckpt = str(tmp_path / "c.npz")
    assert main(args + ["--out", str(tmp_path / "b.npz"), "--checkpoint", ckpt]) == 0
    # a second run finds the finished checkpoint: it trains no step and reports the same model
    assert main(args + ["--out", str(tmp_path / "b.npz"), "--checkpoint", ckpt]) == 0
    lines = capsys.readouterr().out.splitlines()
    strip = lambda line: line.split(" after ")[0]
    assert strip(lines[0]) == strip(lines[2]) == strip(whole)
    a, b = pyattn.nn.HybridLM.load(str(tmp_path / "a.npz")), pyattn.nn.HybridLM.load(str(tmp_path / "b.npz"))
    for name, p in a.params.items():
        np.testing.assert_array_equal(b.params[name], p, err_msg=name)


def test_train_resumes_from_its_checkpoint_with_the_same_bits(tmp_path):
    x, y = data.mqar(128, 24, 2, 32, seed=0)
    make = lambda: pyattn.nn.HybridLM(32, 16, 2, ["gated_deltanet", "softmax"], n_heads=2, seed=1)
    kw = dict(steps=12, batch_size=8, lr=3e-3, eval_data=(x[:32], y[:32]), eval_every=4, progress=False)
    whole = make()
    h_whole = pyattn.train(whole, (x, y), **kw)

    ckpt = str(tmp_path / "run.npz")
    killed = make()
    calls = {"n": 0}
    backward = killed.backward

    def dies_at_step_8(d):
        calls["n"] += 1
        if calls["n"] == 8:  # after the checkpoint of step 5, before step 8's update
            raise KeyboardInterrupt
        return backward(d)

    killed.backward = dies_at_step_8
    with pytest.raises(KeyboardInterrupt):
        pyattn.train(killed, (x, y), checkpoint=ckpt, checkpoint_every=5, **kw)
    resumed = make()  # a fresh process: new model, state only from the file
    h_resumed = pyattn.train(resumed, (x, y), checkpoint=ckpt, checkpoint_every=5, **kw)
    assert h_resumed == h_whole
    for name, p in whole.params.items():
        np.testing.assert_array_equal(resumed.params[name], p, err_msg=name)

    with pytest.raises(ValueError, match="other settings"):
        pyattn.train(make(), (x, y), checkpoint=ckpt, **dict(kw, lr=1e-3))
    with pytest.raises(ValueError, match="another model"):
        other = pyattn.nn.HybridLM(32, 16, 1, "softmax", n_heads=2, seed=1)
        pyattn.train(other, (x, y), checkpoint=ckpt, **kw)


def _tiny_run(**kw):
    x, y = data.mqar(64, 16, 2, 16, seed=0)
    model = pyattn.nn.HybridLM(16, 8, 1, "softmax", n_heads=2, seed=0)
    return pyattn.train(model, (x, y), steps=10, batch_size=4, eval_data=(x[:8], y[:8]), eval_every=5, **kw)


def test_progress_is_a_plain_line_without_tqdm(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tqdm", None)  # makes `import tqdm.auto` fail
    monkeypatch.setitem(sys.modules, "tqdm.auto", None)
    h = _tiny_run()
    lines = capsys.readouterr().err.strip().splitlines()
    assert [l.split(" (")[0] for l in lines] == [f"train {n}/10" for n in range(1, 11)]
    assert lines[-1].endswith(f"loss {h['loss'][-1]:.4f} acc {h['accuracy'][-1]:.3f} @ step 10")


def test_progress_uses_tqdm_when_installed(monkeypatch, capsys):
    seen = {"updates": 0, "closed": False, "post": None}

    class FakeTqdm:
        def __init__(self, total, desc, unit):
            seen.update(total=total, desc=desc, unit=unit)

        def set_postfix_str(self, text):
            seen["post"] = text

        def update(self, k):
            seen["updates"] += k

        def close(self):
            seen["closed"] = True

    auto = types.ModuleType("tqdm.auto")
    auto.tqdm = FakeTqdm
    monkeypatch.setitem(sys.modules, "tqdm", types.ModuleType("tqdm"))
    monkeypatch.setitem(sys.modules, "tqdm.auto", auto)
    h = _tiny_run()
    assert seen["total"] == 10 and seen["updates"] == 10 and seen["closed"] and seen["unit"] == "step"
    assert seen["post"] == f"loss {h['loss'][-1]:.4f} acc {h['accuracy'][-1]:.3f} @ step 10"
    assert capsys.readouterr().err == ""  # no plain line beside the bar


def test_plot_history_draws_loss_and_accuracy(monkeypatch):
    calls = []

    class Axes:
        def __init__(self, i):
            self.i = i

        def plot(self, x, y, **kw):
            calls.append((self.i, list(x), list(y)))

        def __getattr__(self, name):  # set_xlabel, set_ylim, ...
            return lambda *a, **k: None

    class Figure:
        def tight_layout(self):
            pass

    pyplot = types.ModuleType("matplotlib.pyplot")
    pyplot.subplots = lambda rows, cols, figsize: (Figure(), [Axes(i) for i in range(cols)] if cols > 1 else Axes(0))
    monkeypatch.setitem(sys.modules, "matplotlib", types.ModuleType("matplotlib"))
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", pyplot)
    h = {"step": [0, 1, 2], "loss": [3.0, 2.0, 1.0], "lr": [1, 1, 1], "eval_step": [2], "accuracy": [0.5]}
    assert isinstance(pyattn.plot_history(h), Figure)
    assert calls == [(0, [0, 1, 2], [3.0, 2.0, 1.0]), (1, [2], [0.5])]
    calls.clear()
    pyattn.plot_history({"step": [0], "loss": [1.0], "lr": [1]})
    assert calls == [(0, [0], [1.0])]


def test_plot_history_without_matplotlib_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)
    with pytest.raises(ImportError, match="pip install matplotlib"):
        pyattn.plot_history({"step": [0], "loss": [1.0], "lr": [1]})


@pytest.mark.parametrize("task", ["copy", "text"])
def test_command_line_train_other_tasks(tmp_path, capsys, task):
    from pyattn.selfcheck import main

    extra = ["--vocab", "12"] if task == "copy" else ["--text", str(tmp_path / "t.txt")]
    (tmp_path / "t.txt").write_text("the cat sat on the mat. " * 20, encoding="utf-8")
    rc = main(["train", "--task", task, "--steps", "3", "--examples", "16", "--seq-len", "12",
               "--d-model", "16", "--heads", "2", "--mixers", "softmax", "--no-progress",
               "--out", str(tmp_path / "m.npz")] + extra)
    assert rc == 0 and f"task {task}" in capsys.readouterr().out
    vocab = 12 if task == "copy" else len(set("the cat sat on the mat. "))
    model = pyattn.nn.HybridLM.load(str(tmp_path / "m.npz"))
    assert model.forward(np.zeros((1, 4), np.int64)).shape == (1, 4, vocab)


def test_the_training_module_is_not_shadowed_by_the_function():
    import importlib

    training = importlib.import_module("pyattn.training")
    assert isinstance(training, types.ModuleType) and pyattn.train is training.train
    assert pyattn.plot_history is training.plot_history
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("pyattn.train")  # the old name was the module behind the function


SMALL = dict(vocab_size=16, d_model=16, n_layers=2, mixers=["gated_deltanet", "softmax"], n_heads=2, seed=1)


@pytest.mark.parametrize("change", [{"mixers": ["softmax", "softmax"]}, {"n_heads": 4}, {"dtype": "float64"},
                                    {"mixers": ["gated_deltanet", ("softmax", {"window": 4})]}])
def test_a_checkpoint_of_another_model_is_refused_before_anything_changes(tmp_path, change):
    """Other mixers (other parameter names), other heads (other shapes for the Gated DeltaNet
    layer), another dtype, or the same shapes under another config (a window): refused, naming
    the checkpoint and the difference, and the caller's model is left as it was."""
    x, y = data.mqar(64, 16, 2, 16, seed=0)
    kw = dict(steps=4, batch_size=4, progress=False)
    ckpt = str(tmp_path / "run.npz")
    pyattn.train(pyattn.nn.HybridLM(**SMALL), (x, y), checkpoint=ckpt, **kw)
    other = pyattn.nn.HybridLM(**dict(SMALL, **change))
    before = {n: p.copy() for n, p in other.params.items()}
    key = next(iter(change))
    with pytest.raises(ValueError, match=re.escape(ckpt) + ".*another model.*" + key):
        pyattn.train(other, (x, y), checkpoint=ckpt, **kw)
    for name, p in other.params.items():
        np.testing.assert_array_equal(p, before[name], err_msg=name)


def test_a_checkpoint_with_an_array_of_another_shape_is_refused(tmp_path):
    x, y = data.mqar(64, 16, 2, 16, seed=0)
    kw = dict(steps=4, batch_size=4, progress=False)
    ckpt = tmp_path / "run.npz"
    pyattn.train(pyattn.nn.HybridLM(**SMALL), (x, y), checkpoint=str(ckpt), **kw)
    with np.load(ckpt) as f:
        arrays = {k: f[k] for k in f.files}
    arrays["adam_v/norm.w"] = np.ones(3, np.float32)
    np.savez(ckpt, **arrays)
    model = pyattn.nn.HybridLM(**SMALL)
    before = {n: p.copy() for n, p in model.params.items()}
    with pytest.raises(ValueError, match=re.escape(str(ckpt)) + r".*adam_v/norm.w.*\(3,\).*\(16,\)"):
        pyattn.train(model, (x, y), checkpoint=str(ckpt), **kw)
    assert all(np.array_equal(p, before[n]) for n, p in model.params.items())


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning",
                            "ignore:invalid value encountered:RuntimeWarning")  # the run diverges on purpose
def test_a_loss_that_is_not_finite_stops_training_and_keeps_the_last_finite_checkpoint(tmp_path):
    x, y = data.mqar(64, 16, 2, 16, seed=0)
    model = pyattn.nn.HybridLM(**SMALL)
    ckpt = tmp_path / "run.npz"
    with pytest.raises(FloatingPointError, match=r"loss is (nan|inf) at step \d+") as e:
        pyattn.train(model, (x, y), steps=20, batch_size=4, lr=1e6, progress=False, checkpoint=str(ckpt),
                     checkpoint_every=1)
    step = int(re.search(r"at step (\d+)", str(e.value)).group(1))
    assert 0 < step < 19 and str(ckpt) in str(e.value)
    assert all(np.all(np.isfinite(p)) for p in model.params.values())  # the bad step updated nothing
    with np.load(ckpt) as f:
        assert json.loads(str(f["__meta__"]))["step"] == step
        assert all(np.all(np.isfinite(f[k])) for k in f.files if k != "__meta__")


def test_progress_says_when_the_accuracy_was_measured(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tqdm", None)
    monkeypatch.setitem(sys.modules, "tqdm.auto", None)
    x, y = data.mqar(64, 16, 2, 16, seed=0)
    model = pyattn.nn.HybridLM(16, 8, 1, "softmax", n_heads=2, seed=0)
    h = pyattn.train(model, (x, y), steps=10, batch_size=4, eval_data=(x[:8], y[:8]), eval_every=4)
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[0].endswith(f"loss {h['loss'][0]:.4f}")  # nothing measured yet
    assert lines[4].endswith(f"loss {h['loss'][4]:.4f} acc {h['accuracy'][0]:.3f} @ step 4")
    assert lines[-1].endswith(f"acc {h['accuracy'][-1]:.3f} @ step 10")


def test_ctrl_c_ends_the_step_saves_a_checkpoint_and_the_run_resumes_with_the_same_bits(tmp_path, sigint_raises):
    x, y = data.mqar(128, 24, 2, 32, seed=0)
    make = lambda: pyattn.nn.HybridLM(32, 16, 2, ["gated_deltanet", "softmax"], n_heads=2, seed=1)
    kw = dict(steps=12, batch_size=8, lr=3e-3, eval_data=(x[:32], y[:32]), eval_every=4, progress=False)
    whole = make()
    h_whole = pyattn.train(whole, (x, y), **kw)

    def ctrl_c_in_step(model, n):
        calls, backward = [], model.backward

        def backward_with_sigint(d):
            calls.append(1)
            if len(calls) == n:
                os.kill(os.getpid(), signal.SIGINT)
            return backward(d)

        model.backward = backward_with_sigint
        return model

    ckpt = tmp_path / "run.npz"
    with pytest.raises(KeyboardInterrupt, match="after 7 of 12 steps; .*run.npz holds them"):
        pyattn.train(ctrl_c_in_step(make(), 7), (x, y), checkpoint=str(ckpt), checkpoint_every=5, **kw)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    with np.load(ckpt) as f:
        assert json.loads(str(f["__meta__"]))["step"] == 7  # not 5: the step under way finished and was saved
    resumed = make()
    assert pyattn.train(resumed, (x, y), checkpoint=str(ckpt), checkpoint_every=5, **kw) == h_whole
    for name, p in whole.params.items():
        np.testing.assert_array_equal(resumed.params[name], p, err_msg=name)
    with pytest.raises(KeyboardInterrupt, match="after 3 of 12 steps$"):
        pyattn.train(ctrl_c_in_step(make(), 3), (x, y), **kw)


def test_train_passes_its_betas_to_adamw(monkeypatch):
    """betas reach AdamW (default (0.9, 0.95)); values outside [0, 1) are refused."""
    import pyattn.training as training

    seen = []
    real = training.AdamW

    def spy(params, **kw):
        seen.append(kw["betas"])
        return real(params, **kw)

    monkeypatch.setattr(training, "AdamW", spy)
    data = pyattn.data.mqar(16, 16, 2, 16)
    model = pyattn.nn.HybridLM(16, 16, 1, "softmax", n_heads=2)
    pyattn.train(model, data, steps=1, batch_size=4, progress=False)
    pyattn.train(model, data, steps=1, batch_size=4, betas=(0.9, 0.999), progress=False)
    assert seen == [(0.9, 0.95), (0.9, 0.999)]
    with pytest.raises(ValueError, match="betas"):
        pyattn.train(model, data, steps=1, betas=(0.9, 1.0), progress=False)


def test_command_line_untied_embeddings_and_beta2(tmp_path):
    out = tmp_path / "m.npz"
    args = ["train", "--mixers", "softmax", "--layers", "1", "--d-model", "16", "--heads", "2", "--steps", "2",
            "--examples", "32", "--seq-len", "16", "--kv-pairs", "2", "--vocab", "16", "--untied-embeddings",
            "--beta2", "0.999", "--no-progress", "--out", str(out)]
    subprocess.run([sys.executable, "-m", "pyattn", *args], check=True, capture_output=True, timeout=300,
                   cwd=tmp_path)
    model = pyattn.nn.HybridLM.load(str(out))
    assert "lm_head.w" in model.params and not model.config["tie_embeddings"]

