"""pyattn.data's tasks (MQAR as Zoology builds it, copying, character text) and the training
loop: pyattn.train, its history, the command line."""
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
