"""HybridLM.to_torch() and from_torch (pyattn.torch.nn): the torch module computes pyattn.nn's
logits and, by autograd, pyattn.nn's gradient of every parameter, for every mixer; from_torch
copies the parameters back exactly; trained by torch.optim.AdamW, clip_grad_norm_ and the same
schedule on the batches pyattn.train draws, it has pyattn.train's losses; torch.compile traces
it whole."""
from __future__ import annotations

import numpy as np
import pytest

import pyattn
from pyattn.data import mqar
from pyattn.nn import MIXERS, HybridLM, cosine_lr

torch = pytest.importorskip("torch", reason="pyattn.torch.nn needs torch (pip install 'pyattn[torch]')")

# Python (torch modules) over the kernels that tests/test_torch.py and the NumPy tests run under
# the sanitizers already: skipped there, where they would add minutes
pytestmark = pytest.mark.skip_under_sanitizer

from conftest import TINY_MIXER_OPTIONS as OPTIONS, TINY_MODEL

V, D, L, H, T = TINY_MODEL

MODELS = {name: [(name, OPTIONS[name])] * L for name in MIXERS}
MODELS["hybrid"] = [("gated_deltanet", OPTIONS["gated_deltanet"]), ("softmax", {})]
MODELS["softmax_gqa_window_sinks"] = [("softmax", {"n_kv_heads": 1, "window": 5, "sinks": 2})] * L
MODELS["mla_absorbed"] = [("mla", {"form": "absorbed"})] * L
MODELS["linear_normalized_taylor"] = [("linear", {"feature_map": "taylor", "normalize": True,
                                                  "chunk_size": 16})] * L
for _name in ("softmax", "linear", "retnet", "gla"):
    MODELS[_name + "_short_conv"] = [(_name, dict(OPTIONS[_name], short_conv=True))] * L


def tiny(kind, dtype="float64", tie_embeddings=True):
    return HybridLM(V, D, L, MODELS[kind], n_heads=H, dtype=dtype, tie_embeddings=tie_embeddings)


def relative(a, b) -> float:
    """The largest difference relative to the largest entry of b."""
    return float(np.abs(np.asarray(a) - b).max() / np.abs(b).max())


@pytest.fixture(autouse=True)
def one_torch_thread():
    """torch's OpenMP runtime and pyattn's are two pools of threads that spin between parallel
    regions: on shared cores each stalls the other (steps 20x slower). torch's GEMMs of these
    small models run on one thread."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.mark.parametrize("kind,tie", [(kind, True) for kind in MODELS] + [("hybrid", False)])
def test_logits_and_gradients_equal_pyattn(rng, kind, tie):
    """float64: the logits within 1e-12 and every parameter's gradient within 1e-10 of
    pyattn.nn's forward and backward (relative to the largest entry); DSA's indexer loss too."""
    model = tiny(kind, tie_embeddings=tie)
    module = model.to_torch()
    tok = rng.integers(0, V, (2, T))
    logits = model.forward(tok)
    cot = rng.standard_normal(logits.shape)
    model.zero_grad()
    model.backward(cot)
    out = module(torch.from_numpy(tok))
    out.backward(torch.from_numpy(cot))
    assert out.dtype == torch.float64 and out.shape == logits.shape
    assert relative(out.detach().numpy(), logits) <= 1e-12
    grads = model.grads
    for name, p in module.named_parameters():
        assert np.any(grads[name] != 0), name
        assert relative(p.grad.numpy(), grads[name]) <= 1e-10, name
    if kind == "dsa":  # a KL near 0 is a difference of terms near 1: its round-off is absolute
        for block, mirrored in zip(model.blocks, module.blocks):
            assert 0 < block.mixer.index_loss and abs(mirrored.mixer.index_loss.item() - block.mixer.index_loss) <= 1e-14


@pytest.mark.parametrize("kind", list(MIXERS) + ["hybrid"])
def test_from_torch_round_trips(rng, kind):
    """to_torch copies the parameters under model.params' names and order; from_torch copies
    them back bit for bit with the config and vocab; neither shares memory."""
    model = tiny(kind, tie_embeddings=kind != "hybrid")
    model.vocab = [chr(ord("a") + i) for i in range(V)]
    module = model.to_torch()
    assert [name for name, _ in module.named_parameters()] == list(model.params)
    back = HybridLM.from_torch(module)
    assert back.config == model.config and back.vocab == model.vocab
    for name, p in model.params.items():
        assert back.params[name].dtype == p.dtype and np.array_equal(back.params[name], p), name
    tok = rng.integers(0, V, (2, T))
    assert np.array_equal(back.forward(tok), model.forward(tok))
    with torch.no_grad():
        for p in module.parameters():
            p.mul_(2)
    doubled = HybridLM.from_torch(module)
    for name, p in model.params.items():
        assert np.array_equal(back.params[name], p) and np.array_equal(doubled.params[name], 2 * p), name


def test_from_torch_takes_the_parameters_dtype(rng):
    model = tiny("hybrid", dtype="float32")
    module = model.to_torch()
    assert {p.dtype for p in module.parameters()} == {torch.float32}
    back = HybridLM.from_torch(module.double())
    assert back.dtype == np.float64 and back.config["dtype"] == "float64"
    tok = rng.integers(0, V, (2, T))
    assert relative(back.forward(tok), model.forward(tok)) <= 1e-5


def test_from_torch_refuses_other_modules():
    with pytest.raises(TypeError, match="to_torch"):
        HybridLM.from_torch(torch.nn.Linear(2, 2))
    module = tiny("softmax").to_torch()
    module.embed.w.data = module.embed.w.data.float()
    with pytest.raises(TypeError, match="float32 or all float64"):
        HybridLM.from_torch(module)
    other = tiny("hybrid").to_torch()
    other.config = tiny("softmax").config
    with pytest.raises(ValueError, match="missing"):
        HybridLM.from_torch(other)


STEPS, BATCH, LR, WARMUP, WEIGHT_DECAY, CLIP, SEED = 50, 8, 3e-3, 5, 0.1, 1.0, 0


def train_both(dtype):
    """pyattn.train's losses and the torch module's, trained from one initialisation on the
    same batches by torch.optim.AdamW (pyattn's AdamW settings and decay rule: every
    parameter of 2 or more dimensions, embedding included), clip_grad_norm_ and cosine_lr set
    before each step; and the two models after training."""
    inputs, targets = mqar(256, 32, 4, 64, seed=0)
    model = HybridLM(64, 32, 2, ["gated_deltanet", "softmax"], n_heads=2, dtype=dtype, seed=0)
    module = model.to_torch()
    history = pyattn.train(model, (inputs, targets), steps=STEPS, batch_size=BATCH, lr=LR, warmup=WARMUP,
                           weight_decay=WEIGHT_DECAY, clip=CLIP, progress=False, seed=SEED)
    params = list(module.parameters())
    opt = torch.optim.AdamW([{"params": [p for p in params if p.ndim >= 2], "weight_decay": WEIGHT_DECAY},
                             {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}],
                            lr=LR, betas=(0.9, 0.95), eps=1e-8)
    rng = np.random.default_rng(SEED)  # pyattn.train's draw of the rows
    losses = []
    for step in range(STEPS):
        rows = rng.integers(0, len(inputs), BATCH)
        logits = module(torch.from_numpy(inputs[rows]))
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), torch.from_numpy(targets[rows]).flatten())
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, CLIP)
        for group in opt.param_groups:
            group["lr"] = cosine_lr(step, lr=LR, warmup=WARMUP, total=STEPS)
        opt.step()
        losses.append(loss.item())
    return np.array(history["loss"]), np.array(losses), model, module


@pytest.mark.parametrize("dtype,tol", [("float64", 1e-10), ("float32", 1e-4)])
def test_training_parity_with_torch_adamw(dtype, tol):
    """The same losses at every one of 50 steps (relative), while the loss falls; float64
    also ends with the same parameters."""
    ours, theirs, model, module = train_both(dtype)
    assert ours[-5:].mean() < ours[:5].mean() - 0.2
    assert np.max(np.abs(theirs - ours) / ours) <= tol
    if dtype == "float64":
        for name, p in module.named_parameters():
            assert relative(p.detach().numpy(), model.params[name]) <= 1e-10, name


@pytest.mark.parametrize("kind", ["hybrid", "dsa"])
def test_compile_fullgraph(rng, kind):
    """torch.compile(fullgraph=True) traces a to_torch() hybrid, and DSA with its indexer's
    key choice and target, without a graph break: the same logits and gradients as the
    module run eagerly."""
    module = tiny(kind).to_torch()
    tok = torch.from_numpy(rng.integers(0, V, (2, T)))
    compiled = torch.compile(module, backend="aot_eager", fullgraph=True)
    out = compiled(tok)
    out.sum().backward()
    grads = {name: p.grad.clone() for name, p in module.named_parameters()}
    module.zero_grad()
    eager = module(tok)
    eager.sum().backward()
    assert torch.equal(out, eager)
    for name, p in module.named_parameters():
        assert torch.equal(grads[name], p.grad), name
