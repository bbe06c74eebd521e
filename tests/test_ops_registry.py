"""pyattn.OPS lists every public op, docs/ops.md's contents link every section, and the
machinery that iterates OPS handles list arguments (gradcheck) and ops without gradients
(the self-check)."""
from __future__ import annotations

import inspect
import pathlib
import re

import numpy as np
import pytest

import pyattn
from pyattn import reference, selfcheck
from pyattn.autodiff import register_vjp
from pyattn.testing import gradcheck

DOCS = pathlib.Path(__file__).resolve().parent.parent / "docs" / "ops.md"


def test_every_op_with_an_oracle_is_registered():
    """Each public op has a float64 oracle in pyattn.reference; each of them is in OPS."""
    oracles = {n for n, f in vars(reference).items()
               if inspect.isfunction(f) and f.__module__ == reference.__name__ and not n.startswith("_")}
    assert oracles and oracles <= set(pyattn.OPS)
    assert set(pyattn.OPS) <= oracles
    for name in ("rope", "feature_map", "merge_attention_states", "dsa_select", "dsa_index_target"):
        assert name in pyattn.OPS and name in pyattn.__all__


def test_new_entries_describe_their_ops():
    ops = pyattn.OPS
    assert ops["rope"].arrays == ("x", "positions") and ops["rope"].differentiable == ("x",)
    assert ops["feature_map"].differentiable == ("x", "projection")
    assert ops["merge_attention_states"].arrays == ops["merge_attention_states"].differentiable == ("os", "lses")
    assert ops["dsa_select"].differentiable == ops["dsa_index_target"].differentiable == ()
    for name in ("dsa_select", "dsa_index_target"):  # says why there is no gradient
        assert "not differentiable" in pyattn.OPS[name].fn.__doc__.lower()
        args, kwargs = pyattn.OPS[name].example(np.random.default_rng(0), np.float64, tiny=True)
        with pytest.raises(TypeError, match="no registered vjp"):
            pyattn.vjp(pyattn.OPS[name].fn, *args, **kwargs)
    args, kwargs = ops["rope"].example(np.random.default_rng(0), np.float64)
    assert args[1].dtype.kind == "i" and args[1].shape == args[0].shape[:2]  # positions [B, T]
    args, kwargs = ops["feature_map"].example(np.random.default_rng(0), np.float64)
    assert kwargs["kind"] == "performer" and kwargs["projection"].shape[1] == args[0].shape[-1]


def _swap_lses(os, lses):
    """o = os[0] * exp(lses[1]): a list-argument op whose registered vjp swaps the lses
    gradients, for gradcheck to catch."""
    return os[0] * np.exp(lses[1])[..., None]


@register_vjp(_swap_lses)
def _swap_lses_vjp(os, lses):
    o = _swap_lses(os, lses)

    def pullback(do):
        dl = np.sum(do * o, axis=-1)
        return {"os": [do * np.exp(lses[1])[..., None], np.zeros_like(os[1])],
                "lses": [dl, np.zeros_like(lses[1])]}

    return o, pullback


def test_gradcheck_takes_lists_of_arrays():
    info = pyattn.OPS["merge_attention_states"]
    args, _ = info.example(np.random.default_rng(3), np.float64, tiny=True)
    P = len(args[0])
    errs = gradcheck(info.fn, args)
    assert set(errs) == {f"{n}[{p}]" for n in ("os", "lses") for p in range(P)}
    assert set(gradcheck(info.fn, args, wrt=["os"])) == {f"os[{p}]" for p in range(P)}
    assert set(gradcheck(info.fn, args, wrt=["lses[1]"])) == {"lses[1]"}
    with pytest.raises(ValueError, match="wrt"):
        gradcheck(info.fn, args, wrt=["nope"])
    # the inputs are not touched: gradcheck perturbs private copies of every entry
    again, _ = info.example(np.random.default_rng(3), np.float64, tiny=True)
    for a, b in zip(args, again):
        for x, y in zip(a, b):
            np.testing.assert_array_equal(x, y)

    rng = np.random.default_rng(4)
    os = [rng.standard_normal((1, 2, 2, 3)) for _ in range(2)]
    lses = [rng.standard_normal((1, 2, 2)) for _ in range(2)]
    with pytest.raises(AssertionError, match=r"dlses\[0\]|dlses\[1\]"):
        gradcheck(_swap_lses, (os, lses), wrt=["lses"])
    assert set(gradcheck(_swap_lses, (os, lses), wrt=["os"])) == {"os[0]", "os[1]"}


@pytest.mark.parametrize("name", ["dsa_select", "dsa_index_target", "merge_attention_states", "rope", "feature_map"])
def test_selfcheck_rows_of_the_new_ops(name):
    with pyattn.num_threads(1):
        (row,) = selfcheck.check_op(name)
    assert row.ok and row.form == "-" and row.err64 <= 1e-10 and row.err32 <= 1e-5
    if pyattn.OPS[name].differentiable:
        assert row.grad_fd.startswith("ok ") and row.grad32 <= 1e-4 and row.fwd_bwd_ms > 0
    else:  # no gradient: no fake "ok"
        assert row.grad_fd == "-" and row.grad32 is None and row.fwd_bwd_ms is None
        line = selfcheck.format_table([row]).splitlines()[-1].split()
        assert line[0] == name and line[4:6] == ["-", "-"] and line[7] == "-" and line[-1] == "ok"
    if name == "dsa_select":
        assert row.err64 == row.err32 == 0.0  # integer rows: exactly the oracle's


def test_selfcheck_integer_outputs_must_be_exact():
    ref = np.array([[0, 1, -1]])
    assert selfcheck._err(ref.copy(), ref) == 0.0
    assert selfcheck._err(np.array([[0, 2, -1]]), ref) == np.inf
    assert selfcheck._err(ref.astype(np.float64), ref) == np.inf


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but '-' and '_' dropped, spaces
    to '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_docs_contents_link_every_section():
    text = DOCS.read_text()
    body = text[text.index("\n## "):]
    contents = text[:text.index("\n## ")]
    sections = [_slug(h) for h in re.findall(r"^#{2,3} (.+)$", body, flags=re.M)]
    links = re.findall(r"\]\(#([^)]+)\)", contents)
    assert len(sections) > 20
    assert sorted(set(sections)) == sorted(set(links)), set(sections) ^ set(links)
    assert links == sorted(links, key=sections.index)  # in the page's order
