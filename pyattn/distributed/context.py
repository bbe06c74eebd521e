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
    (time on axis 1), of its value array (whose last axis is the state's columns; its name)
    and of the array whose last axis is the state's rows; its per-token keyword arrays and its
    value gate's keyword."""

    def __init__(self, per_token, value, rows, per_token_kw=(), value_gate_kw=None, value_name="v"):
        self.per_token, self.value, self.rows, self.value_name = per_token, value, rows, value_name
        self.per_token_kw, self.value_gate_kw = per_token_kw, value_gate_kw


_LAYOUTS = {
    _linear.simple_gla: _Layout((0, 1, 2, 3), value=2, rows=1),
    _linear.gla: _Layout((0, 1, 2, 3), value=2, rows=1, per_token_kw=("gv",), value_gate_kw="gv"),
    _linear.retention: _Layout((0, 1, 2), value=2, rows=1),
    _linear.mamba2: _Layout((0, 1, 3, 4), value=0, rows=3, value_name="x"),
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


def _per_step(x, m):
    """x_t @ m per step and head: x [B, T, H, K], m [B, H, K, V] -> [B, T, H, V] (BLAS)."""
    return np.swapaxes(np.swapaxes(x, 1, 2) @ m, 1, 2)


def _time_sum(x, y):
    """sum over t of x_t^T y_t per head: [B, T, H, K], [B, T, H, V] -> [B, H, K, V] (BLAS)."""
    return np.swapaxes(x, 1, 2).swapaxes(-1, -2) @ np.swapaxes(y, 1, 2)


class _Slice:
    """One call of the op on this rank's slice from a zero state, with K extra zero value
    columns started at the identity. The state map of a slice is linear in the incoming state
    and acts on every column alike (a value gate only scales columns), so the extra columns
    hold the slice's row maps: those of the end state are its K x K transition ``M``, those
    of the output at step t are ``M_t^T q_t`` (``M_t`` the map up to step t), and the output
    from an incoming state S is ``o_local + (M_t^T q_t)^T S``, times the value gate's decay
    so far. The call's vjp serves the backward."""

    def __init__(self, op, layout, args, kw, differentiable):
        args = list(args)
        value = np.asarray(args[layout.value])
        K = np.asarray(args[layout.rows]).shape[-1]
        self.V = Vd = value.shape[-1]
        args[layout.value] = np.concatenate([value, np.zeros(value.shape[:-1] + (K,), value.dtype)], axis=-1)
        call = dict(kw, output_final_state=True)
        self.col_decay = None  # the value gate's decay up to each step [B, T, H, V]
        gate = kw.get(layout.value_gate_kw) if layout.value_gate_kw is not None else None
        if gate is not None:
            gate = np.asarray(gate)
            call[layout.value_gate_kw] = np.concatenate([gate, np.zeros(gate.shape[:-1] + (K,), gate.dtype)],
                                                        axis=-1)
            self.col_decay = np.exp(np.cumsum(gate, axis=1, dtype=gate.dtype))
        h0 = np.zeros((value.shape[0], value.shape[2], K, Vd + K), value.dtype)
        h0[..., Vd:] = np.eye(K, dtype=value.dtype)
        call["initial_state"] = h0
        if differentiable:
            (o, end), self.pullback = vjp(op, *args, **call)
        else:
            o, end = op(*args, **call)
        self.o_local, self.q_maps = o[..., :Vd], o[..., Vd:]
        self.end_local = end[..., :Vd]
        cols = None if gate is None else np.exp(gate.sum(axis=1))
        self.transition = _Transition(end[..., Vd:], cols)

    def output(self, incoming):
        carried = _per_step(self.q_maps, incoming)
        return self.o_local + (carried if self.col_decay is None else carried * self.col_decay)


def _gathered(comm, what, value):
    """allgather of (value, error message or None): an error on any rank is raised on all."""
    seen = comm.allgather(value)
    for r, (_, err) in enumerate(seen):
        if err is not None:
            raise ValueError(f"context_parallel: {what} failed on rank {r}: {err}")
    return [v for v, _ in seen]


def _forward(comm, op, layout, args, kw, differentiable):
    """(this rank's _Slice, its incoming state, the global final state, every rank's
    transition)."""
    try:
        piece, err = _Slice(op, layout, args, kw, differentiable), None
    except Exception as e:  # any failure here must reach the other ranks, or they wait forever
        piece, err = None, f"{type(e).__name__}: {e}"
    summaries = _gathered(comm, "the slice's forward",
                          (None if piece is None else (piece.end_local, piece.transition), err))
    h0 = kw.get("initial_state")
    state = np.zeros_like(piece.end_local) if h0 is None else np.asarray(h0, dtype=piece.end_local.dtype)
    incoming = None
    for r, (end, transition) in enumerate(summaries):
        if r == comm.Get_rank():
            incoming = state
        state = transition.apply(state) + end
    return piece, incoming, state, [t for _, t in summaries]


def context_parallel(op, *args, comm, **kw):
    """Run a linear or delta op over a sequence cut into contiguous slices, one per rank.

    ``op`` is one of ``pyattn.simple_gla``, ``gla``, ``retention``, ``mamba2``,
    ``delta_rule``, ``gated_delta_rule``, ``kda`` (ops whose recurrence does not depend on the
    position). Every rank of ``comm`` passes its slice ``[B, T_r, ...]`` of the per-token
    arrays, slices in rank order (lengths may differ), and the same ``initial_state``,
    per-head constants (``A``, ``D``, ``dt_bias``, ``gamma``) and options. Returns
    ``(o_slice, final_state)``: the op's output on this rank's positions, and the state after
    the whole sequence (the same on every rank). Equal to one process on the whole sequence.

    Each rank calls the op once on its slice from a zero state, with K extra zero value
    columns started at the identity: the extra columns give the slice's state transition (a
    K x K map of the state's rows, diagonal for the gated linear ops, times a column decay for
    gla's value gate) and, at each step, the map that carries an incoming state into the
    output. One allgather of (end state, transition) lets every rank scan the earlier ranks'
    summaries into its incoming state, whose contribution is then added to the output.

    Under ``pyattn.vjp`` the per-token gradients are this rank's slice; the gradients of
    ``initial_state`` and the per-head constants are the whole gradient on every rank. The
    final state's cotangents of all ranks are summed (the loss is the sum of the ranks'
    losses). Ranks that disagree on the op, shapes (other than T_r), dtypes or options get
    the same ValueError, as does an op not listed above; ``cu_seqlens`` is not implemented.
    """
    layout = _check_call(op, args, comm, kw)
    piece, incoming, final, _ = _forward(comm, op, layout, args, kw, differentiable=False)
    return piece.output(incoming), final


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
    piece, incoming, final, transitions = _forward(comm, op, layout, args, kw, differentiable=True)
    rank, size = comm.Get_rank(), comm.Get_size()
    gate_name = layout.value_gate_kw if piece.col_decay is not None else None

    def pullback(cot):
        do, dfinal = cot if isinstance(cot, (tuple, list)) else (cot, None)
        dfinal = None if dfinal is None else np.asarray(dfinal)
        # the cotangent of a slice's incoming state is its output's part (local) plus its end
        # state's cotangent carried back through the adjoint transition: a reverse scan over
        # the ranks of the local parts
        try:
            do = np.zeros_like(piece.o_local) if do is None else np.asarray(do, dtype=piece.o_local.dtype)
            do_carried = do if piece.col_decay is None else do * piece.col_decay
            mine, err = _time_sum(piece.q_maps, do_carried), None
        except Exception as e:  # as in the forward: the other ranks must hear of it
            mine, err = None, f"{type(e).__name__}: {e}"
        parts = _gathered(comm, "the slice's backward", ((mine, dfinal), err))
        dstate = _sum_in_rank_order([d for _, d in parts])
        if dstate is None:
            dstate = np.zeros_like(final)
        dend = None
        for s in range(size - 1, -1, -1):
            if s == rank:
                dend = dstate
            dstate = transitions[s].adjoint(dstate) + parts[s][0]
        # dstate is now the cotangent of initial_state
        tr = piece.transition
        dend_scaled = dend if tr.cols is None else dend * tr.cols[..., None, :]
        dq_maps = _per_step(do_carried, np.swapaxes(incoming, -1, -2))
        drows = dend_scaled @ np.swapaxes(incoming, -1, -2)
        grads = piece.pullback((np.concatenate([do, dq_maps], axis=-1), np.concatenate([dend, drows], axis=-1)))
        grads.pop("initial_state")
        grads[layout.value_name] = np.ascontiguousarray(grads[layout.value_name][..., :piece.V])
        if gate_name is not None:
            # the value gate's decay scales the carried output and the carried end state
            carried = _per_step(piece.q_maps, incoming)
            step = do_carried * carried
            through_output = np.flip(np.cumsum(np.flip(step, axis=1), axis=1), axis=1)
            through_end = np.einsum("bhkv,bhkv->bhv", dend_scaled, tr.rows @ incoming)[:, None]
            grads[gate_name] = grads[gate_name][..., :piece.V] + through_output + through_end
        shared = {n: grads[n] for n in _SHARED_GRADIENTS if n in grads}
        every = comm.allgather(shared)
        for n in shared:
            grads[n] = _sum_in_rank_order([s[n] for s in every])
        if kw.get("initial_state") is not None:
            grads["initial_state"] = dstate.astype(final.dtype)
        return grads

    return (piece.output(incoming), final), pullback
