"""Context parallelism for the linear and delta ops: each rank holds a contiguous slice of the
sequence; the ranks exchange one summary of their slice (its end state from a zero start and
its state transition) and combine them by a scan."""
from __future__ import annotations

import numpy as np

from .. import delta as _delta
from .. import linear as _linear
from ..autodiff import register_vjp, vjp
from ._agree import agree


class _Layout:
    """Where an op keeps what the scan needs: the positional indices of its per-token arrays
    (time on axis 1), of its value array (whose last axis is the state's columns) and of the
    array whose last axis is the state's rows; its per-token keyword arrays; its shared
    (per-head) keyword arrays."""

    def __init__(self, per_token, value, rows, per_token_kw=(), value_gate_kw=None):
        self.per_token, self.value, self.rows = per_token, value, rows
        self.per_token_kw, self.value_gate_kw = per_token_kw, value_gate_kw


_LAYOUTS = {
    _linear.simple_gla: _Layout((0, 1, 2, 3), value=2, rows=1),
    _linear.gla: _Layout((0, 1, 2, 3), value=2, rows=1, per_token_kw=("gv",), value_gate_kw="gv"),
    _linear.retention: _Layout((0, 1, 2), value=2, rows=1),
    _linear.mamba2: _Layout((0, 1, 3, 4), value=0, rows=3),
    _delta.delta_rule: _Layout((0, 1, 2, 3), value=2, rows=1),
    _delta.gated_delta_rule: _Layout((0, 1, 2, 3, 4), value=2, rows=1),
    _delta.kda: _Layout((0, 1, 2, 3, 4), value=2, rows=1),
}
SUPPORTED = tuple(f.__name__ for f in _LAYOUTS)
# gradients of these arguments are the same whole gradient on every rank
_SHARED_GRADIENTS = ("A", "D", "dt_bias", "gamma")


def _summary(x):
    """What the ranks must agree on about one argument: shape and dtype of an array (time axis
    excluded where it is a per-token one, marked by the caller), else its repr."""
    if isinstance(x, np.ndarray) or hasattr(x, "__array__"):
        a = np.asarray(x)
        return ("array", a.shape, str(a.dtype))
    return repr(x)


def _drop_time(summary):
    if isinstance(summary, tuple) and len(summary[1]) >= 2:
        return ("per-token", summary[1][:1] + summary[1][2:], summary[2])
    return summary


def _check_call(op, args, comm, kw):
    """The layout of ``op`` after the ranks agreed on the call; the same error on every rank."""
    name = getattr(op, "__name__", repr(op))
    layout = _LAYOUTS.get(op)
    facts = [name]
    for i, a in enumerate(args):
        s = _summary(a)
        # an op not supported has no layout: its arrays' axis 1 is taken for time, so the ranks
        # agree and all raise the error below
        facts.append(_drop_time(s) if layout is None or i in layout.per_token else s)
    for key in sorted(kw):
        s = _summary(kw[key])
        facts.append((key, _drop_time(s) if layout is not None and key in layout.per_token_kw else s))
    agree(comm, "context_parallel", facts)
    if layout is None:
        raise ValueError(f"context_parallel: {name} is not supported; the ops whose recurrence does not "
                         f"depend on the position are {', '.join(SUPPORTED)}")
    if kw.get("cu_seqlens") is not None:
        raise NotImplementedError("context_parallel: cu_seqlens (packed sequences) is not implemented; "
                                  "give each rank a slice of one batch of equal-length sequences")
    if kw.get("output_final_state", True) is not True:
        raise ValueError("context_parallel always returns the final state; output_final_state must be "
                         "True or left out")
    return layout


class _Transition:
    """The state map of one slice, ``S -> rows @ S * cols`` (``cols`` a per-column decay or
    None), and its adjoint ``C -> rows^T @ C * cols``."""

    def __init__(self, rows, cols):
        self.rows, self.cols = rows, cols

    def apply(self, S):
        out = self.rows @ S
        return out if self.cols is None else out * self.cols[..., None, :]

    def adjoint(self, C):
        out = np.swapaxes(self.rows, -1, -2) @ C
        return out if self.cols is None else out * self.cols[..., None, :]


def _local_summary(op, layout, args, kw):
    """(end state from a zero start, transition) of this rank's slice, from one call of the op:
    the value array gets K zero columns and the initial state an identity in those columns, so
    the extra columns of the end state are the slice's K x K row map (the state map is linear
    and the same for every column; a value gate only scales columns, and is summed here)."""
    args = list(args)
    value = np.asarray(args[layout.value])
    K = np.asarray(args[layout.rows]).shape[-1]
    Vd = value.shape[-1]
    args[layout.value] = np.concatenate([value, np.zeros(value.shape[:-1] + (K,), value.dtype)], axis=-1)
    call = dict(kw, output_final_state=True)
    call.pop("initial_state", None)
    cols = None
    if layout.value_gate_kw is not None and kw.get(layout.value_gate_kw) is not None:
        gate = np.asarray(kw[layout.value_gate_kw])
        call[layout.value_gate_kw] = np.concatenate([gate, np.zeros(gate.shape[:-1] + (K,), gate.dtype)], axis=-1)
        cols = np.exp(gate.sum(axis=1))
    n_states, n_heads = value.shape[0], value.shape[2]
    h0 = np.zeros((n_states, n_heads, K, Vd + K), value.dtype)
    h0[..., Vd:] = np.eye(K, dtype=value.dtype)
    _, end = op(*args, initial_state=h0, **call)
    return end[..., :Vd], _Transition(end[..., Vd:], cols)


def _gathered(comm, what, value):
    """allgather of (value, error message or None): an error on any rank is raised on all."""
    seen = comm.allgather(value)
    for r, (_, err) in enumerate(seen):
        if err is not None:
            raise ValueError(f"context_parallel: {what} failed on rank {r}: {err}")
    return [v for v, _ in seen]


def _incoming_states(comm, op, layout, args, kw):
    """(this rank's incoming state, the global final state, every rank's transition)."""
    try:
        mine, err = _local_summary(op, layout, args, kw), None
    except (ValueError, TypeError, MemoryError) as e:
        mine, err = None, f"{type(e).__name__}: {e}"
    summaries = _gathered(comm, "the slice's forward", (mine, err))
    end0, _ = summaries[0]
    h0 = kw.get("initial_state")
    state = np.zeros_like(end0) if h0 is None else np.asarray(h0, dtype=end0.dtype)
    incoming = None
    for r, (end, transition) in enumerate(summaries):
        if r == comm.Get_rank():
            incoming = state
        state = transition.apply(state) + end
    return incoming, state, [t for _, t in summaries]


def context_parallel(op, *args, comm, **kw):
    """Run a linear or delta op over a sequence cut into contiguous slices, one per rank.

    ``op`` is one of ``pyattn.simple_gla``, ``gla``, ``retention``, ``mamba2``,
    ``delta_rule``, ``gated_delta_rule``, ``kda`` (ops whose recurrence does not depend on the
    position). Every rank of ``comm`` passes its slice ``[B, T_r, ...]`` of the per-token
    arrays, slices in rank order (lengths may differ), and the same ``initial_state``,
    per-head constants (``A``, ``D``, ``dt_bias``, ``gamma``) and options. Returns
    ``(o_slice, final_state)``: the op's output on this rank's positions, and the state after
    the whole sequence (the same on every rank). Equal to one process on the whole sequence.

    Each rank summarises its slice by its end state from a zero start and its state
    transition (a K x K map of the state's rows, diagonal for the gated linear ops, times a
    column decay for gla's value gate), got from one call of the op with K extra zero value
    columns started at the identity; one allgather of the summaries lets every rank scan them
    into its incoming state; the op then runs on the slice from that state.

    Under ``pyattn.vjp`` the per-token gradients are this rank's slice; the gradients of
    ``initial_state`` and the per-head constants are the whole gradient on every rank. The
    final state's cotangents of all ranks are summed (the loss is the sum of the ranks'
    losses). Ranks that disagree on the op, shapes (other than T_r), dtypes or options get
    the same ValueError, as does an op not listed above; ``cu_seqlens`` is not implemented.
    """
    layout = _check_call(op, args, comm, kw)
    incoming, final, _ = _incoming_states(comm, op, layout, args, kw)
    o, _ = op(*args, **dict(kw, initial_state=incoming, output_final_state=True))
    return o, final


def _sum_in_rank_order(parts):
    """Sum of the ranks' arrays (None is zero), in rank order so every rank gets the same bits."""
    present = [p for p in parts if p is not None]
    if not present:
        return None
    total = np.array(present[0], copy=True)
    for p in present[1:]:
        total += p
    return total


@register_vjp(context_parallel)
def _context_parallel_vjp(op, *args, comm, **kw):
    layout = _check_call(op, args, comm, kw)
    incoming, final, transitions = _incoming_states(comm, op, layout, args, kw)
    (o, _), local_pullback = vjp(op, *args, **dict(kw, initial_state=incoming, output_final_state=True))
    rank, size = comm.Get_rank(), comm.Get_size()
    has_initial_state = kw.get("initial_state") is not None

    def pullback(cot):
        do, dfinal = cot if isinstance(cot, (tuple, list)) else (cot, None)
        # the state cotangent entering each slice is linear in (do, the cotangent of its end
        # state): the do part is local, the rest arrives from later ranks through the
        # adjoint transitions (a reverse scan)
        dfinal = None if dfinal is None else np.asarray(dfinal)
        try:
            mine, err = local_pullback((do, None))["initial_state"], None
        except (ValueError, TypeError, MemoryError) as e:
            mine, err = None, f"{type(e).__name__}: {e}"
        parts = _gathered(comm, "the slice's backward", ((mine, dfinal), err))
        local_parts = [p for p, _ in parts]
        dend = _sum_in_rank_order([d for _, d in parts])
        if dend is None:
            dend = np.zeros_like(final)
        for s in range(size - 1, rank, -1):
            dend = transitions[s].adjoint(dend) + local_parts[s]
        grads = local_pullback((do, dend))
        dh0 = grads.pop("initial_state")
        shared = {n: grads[n] for n in _SHARED_GRADIENTS if n in grads}
        every = comm.allgather((shared, dh0 if rank == 0 else None))
        for n in shared:
            grads[n] = _sum_in_rank_order([s[n] for s, _ in every])
        if has_initial_state:
            grads["initial_state"] = every[0][1]
        return grads

    return (o, final), pullback
