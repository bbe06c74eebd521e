"""Ring attention: softmax attention over a sequence split across the ranks of a communicator.

Each rank keeps its queries; the key/value blocks travel the ring (rank r sends to r + 1 and
receives from r - 1) by non-blocking send/receive, the next transfer started before the flash
kernel runs on the block in hand, and a helper thread keeps MPI moving it while the kernel
runs. The parts merge by their log-sum-exps. The backward reruns
the flash backward per block with the global output and log-sum-exp (so every block's
probabilities are the global ones and nothing drifts), keeps dq, and carries dK/dV around the
ring with the blocks until they reach their owner.
"""
from __future__ import annotations

import contextlib
import threading
import time

import numpy as np
from mpi4py import MPI

from .._engines import softmax_backward, softmax_forward, softmax_prepare
from ..autodiff import register_vjp, split_cotangent
from ._agree import agree

LAYOUTS = ("contiguous", "zigzag")
_waited_s = [0.0]


def comm_wait_seconds() -> float:
    """Seconds this process has spent waiting for ring transfers to finish (the part of the
    communication the flash kernel did not hide), summed over all calls so far."""
    return _waited_s[0]


def _wait(requests):
    start = time.perf_counter()
    MPI.Request.Waitall(requests)
    _waited_s[0] += time.perf_counter() - start


def _polling_allowed() -> bool:
    """Whether the MPI library lets a helper thread make MPI calls (one thread at a time)."""
    return MPI.Query_thread() >= MPI.THREAD_SERIALIZED


@contextlib.contextmanager
def _progressing(requests):
    """Moves ``requests`` while the block's kernels run. MPI advances a large message only
    inside MPI calls (the receiver copies it once it has matched the sender's header), so
    without help a transfer would start only in the wait after the kernel, and each rank's
    sends would complete only when its successor got there. A helper thread tests the
    requests every millisecond until they complete; the main thread makes no MPI call in the
    meantime, so MPI_THREAD_SERIALIZED is enough (below it, nothing is started)."""
    if not requests or not _polling_allowed():
        yield
        return
    stop = threading.Event()

    def poll():
        while not MPI.Request.Testall(requests) and not stop.wait(1e-3):
            pass

    helper = threading.Thread(target=poll, name="pyattn-ring-progress", daemon=True)
    helper.start()
    try:
        yield
    finally:
        stop.set()
        helper.join()


class _Hop:
    """One ring transfer in flight: the arrays arriving from the previous rank and the
    requests moving them; the sends' requests are the call's to finish (``_Call.sends``)."""

    def __init__(self, got, recvs, sends):
        self.got, self.recvs, self.requests = got, recvs, recvs + sends

    def received(self):
        """The arrays from the previous rank, once they are all here."""
        _wait(self.recvs)
        return self.got


def _segments(layout, rank, size, lengths):
    """The rank's positions as (global start, length, local start) segments, in local order."""
    if layout == "contiguous":
        return [(sum(lengths[:rank]), lengths[rank], 0)]
    chunk = lengths[rank] // 2
    return [(rank * chunk, chunk, 0), ((2 * size - 1 - rank) * chunk, chunk, chunk)]


def _sees(q_seg, k_seg, causal):
    """Whether queries q_seg see all of keys k_seg (True) or none (False); segments of
    different ranks never overlap, so there is no third case."""
    (qa, lq, _), (ka, lk, _) = q_seg, k_seg
    if not causal or ka + lk - 1 < qa:
        return True
    if ka > qa + lq - 1:
        return False
    raise AssertionError(f"segments {q_seg} and {k_seg} of different ranks overlap")


_UNBOUNDED = 1 << 62


def _windowed(q_seg, k_seg, left, right):
    """(q range, k range, False, kernel window) for queries q_seg under a window (left, right)
    (-1 unbounded; causal already folded into right = 0) over keys k_seg, or None where no
    query sees a key. The ranges are trimmed to the queries that see some key and the keys
    some query sees; then the window shifted by the pair's position offset has both bounds
    >= 0, so the kernel's bottom-right aligned window is exact."""
    (qa, lq, q_local), (ka, lk, k_local) = q_seg, k_seg
    d = qa - ka  # query i sees key j iff lo <= j - i <= hi
    lo = d - left if left >= 0 else -_UNBOUNDED
    hi = d + right if right >= 0 else _UNBOUNDED
    i0, i1 = max(0, -hi), min(lq - 1, lk - 1 - lo)
    j0, j1 = max(0, lo), min(lk - 1, lq - 1 + hi)
    if i0 > i1 or j0 > j1:
        return None
    window = (j1 - (i1 + lo) if left >= 0 else -1, (i1 + hi) - j1 if right >= 0 else -1)
    return (q_local + i0, i1 - i0 + 1), (k_local + j0, j1 - j0 + 1), False, window


def _joined(ranges):
    """Local (start, length) ranges in order, adjacent ones joined."""
    out = []
    for start, length in ranges:
        if out and sum(out[-1]) == start:
            out[-1] = (out[-1][0], out[-1][1] + length)
        else:
            out.append((start, length))
    return out


class _Call:
    """A ring_attention call checked on every rank: local arrays, layout and block geometry."""

    def __init__(self, q, k, v, comm, causal, scale, window, softcap, layout):
        fn = "ring_attention"
        self.comm, self.rank, self.size = comm, comm.Get_rank(), comm.Get_size()
        facts, error = self._local_facts(fn, q, k, v, causal, scale, window, softcap, layout)
        agree(comm, fn, facts)
        if error is not None:  # the same on every rank
            raise error
        self.lengths = comm.allgather(self.q.shape[1])
        self.sends = {}  # tag -> the requests of the last hop's sends under it
        self.segments = [_segments(layout, s, self.size, self.lengths) for s in range(self.size)]

    def _local_facts(self, fn, q, k, v, causal, scale, window, softcap, layout):
        """(the summary every rank must share, None), or (the local error as text, the error):
        agree then raises on every rank where the ranks differ, and the error where they
        all have it."""
        try:
            if layout not in LAYOUTS:
                raise ValueError(f"{fn}(): 'layout' must be one of {LAYOUTS}, got {layout!r}")
            self.q, self.k, self.v, opts = softmax_prepare(
                q, k, v, causal, scale, window, 0, None, 0.0 if softcap is None else softcap, None,
                None, None, "flash")
            B, T, H, Dk = self.q.shape
            _, Tk, Hk, Dv = self.v.shape
            if Tk != T:
                raise ValueError(f"{fn}(): q, k and v of a rank must hold the same positions, got "
                                 f"{T} queries and {Tk} keys")
            if layout == "zigzag" and T % 2:
                raise ValueError(f"{fn}(): layout 'zigzag' holds two equal chunks per rank, got an "
                                 f"odd length {T} (the sequence length must divide by 2 x ranks)")
            self.causal, self.softcap, self.layout = bool(causal), opts[-2], layout
            self.scale, self.window = opts[-1], (opts[4], opts[5])
            return ("ok", B, H, Hk, Dk, Dv, str(self.q.dtype), self.causal, float(self.scale),
                    float(opts[-2]), self.window, layout, T if layout == "zigzag" else None), None
        except (TypeError, ValueError) as e:
            return ("error", f"{type(e).__name__}: {e}"), e

    def blocks(self, rank, source):
        """(q range, k range, causal, window) for the block pairs that rank's queries see
        among the keys of source; ranges as (local start, length), as few and as large as the
        segments allow (fewer, larger kernel calls); window None where there is none."""
        if self.window != (-1, -1):
            left, right = self.window
            right = 0 if self.causal else right
            pairs = (_windowed(qs, ks, left, right) for qs in self.segments[rank] for ks in self.segments[source])
            return [p for p in pairs if p is not None]
        if rank == source:
            # local order follows global order in both layouts, so one causal call is exact: an
            # earlier segment's keys are all visible to a later one's queries, and none back
            n = self.lengths[rank]
            return [((0, n), (0, n), self.causal, None)]
        pairs = []
        for qs in self.segments[rank]:
            seen = [ks for ks in self.segments[source] if _sees(qs, ks, self.causal)]
            for k_range in _joined([(ks[2], ks[1]) for ks in seen]):
                if pairs and pairs[-1][1] == k_range and sum(pairs[-1][0]) == qs[2]:
                    pairs[-1] = ((pairs[-1][0][0], pairs[-1][0][1] + qs[1]), k_range, False, None)
                else:
                    pairs.append(((qs[2], qs[1]), k_range, False, None))
        return pairs

    def opts(self, q, k, v, causal, window):
        return softmax_prepare(q, k, v, causal, self.scale, window, 0, None, self.softcap, None, None,
                               None, "flash")

    def ring_transfer(self, arrays, shapes, tag=0):
        """Start sending ``arrays`` to the next rank and receiving arrays of ``shapes`` from the
        previous one, with tags from ``tag`` on: a ``_Hop``. The sends of the previous hop
        under the same tags are finished first (a step's compute after they started, they
        are done but for the bookkeeping), which bounds the buffers held to two hops each."""
        _wait(self.sends.pop(tag, []))
        nxt, prv = (self.rank + 1) % self.size, (self.rank - 1) % self.size
        got = [np.empty(s, dtype=a.dtype) for a, s in zip(arrays, shapes)]
        sends = [self.comm.Isend(np.ascontiguousarray(a), dest=nxt, tag=tag + i) for i, a in enumerate(arrays)]
        self.sends[tag] = sends
        return _Hop(got, [self.comm.Irecv(g, source=prv, tag=tag + i) for i, g in enumerate(got)], sends)

    def finish_sends(self):
        """Waits for every send still in flight (their buffers may then go)."""
        _wait([r for reqs in self.sends.values() for r in reqs])
        self.sends.clear()

    def kv_shapes(self, source):
        B, _, Hk, Dk = self.k.shape
        T = self.lengths[source]
        return (B, T, Hk, Dk), (B, T, Hk, self.v.shape[3])


def _merge_into(o_acc, lse_acc, o, lse):
    """Fold the part (o, lse) into the running (o_acc, lse_acc) in place (in the inputs'
    dtype: a handful of parts, each exact to the dtype, lose no more than rounding)."""
    new = np.logaddexp(lse_acc, lse)
    empty = new == -np.inf
    with np.errstate(invalid="ignore"):
        w_acc = np.where(empty, 0.0, np.exp(lse_acc - new))
        w = np.where(empty, 0.0, np.exp(lse - new))
    o_acc *= w_acc[..., None]
    o_acc += w[..., None] * o
    lse_acc[...] = new


def _forward(call):
    q, k, v = call.q, call.k, call.v
    B, T, H, _ = q.shape
    o_acc = np.zeros((B, T, H, v.shape[3]), dtype=q.dtype)
    lse_acc = np.full((B, T, H), -np.inf, dtype=q.dtype)
    for step in range(call.size):
        source = (call.rank - step) % call.size
        hop = call.ring_transfer((k, v), call.kv_shapes((source - 1) % call.size)) if step < call.size - 1 else None
        with _progressing(hop.requests if hop else []):
            for (qa, lq), (ka, lk), causal, window in call.blocks(call.rank, source):
                qb, kb, vb, opts = call.opts(q[:, qa:qa + lq], k[:, ka:ka + lk], v[:, ka:ka + lk], causal, window)
                o, lse = softmax_forward(qb, kb, vb, opts)
                _merge_into(o_acc[:, qa:qa + lq], lse_acc[:, qa:qa + lq], o, lse)
        if hop:
            k, v = hop.received()
    call.finish_sends()
    return o_acc, lse_acc


def _backward(call, o, lse, do, dlse):
    q = call.q
    dq = np.zeros_like(q)
    k, v = call.k, call.v
    dkv = None  # the hop bringing this step's block's dK/dV so far from the previous rank
    for step in range(call.size):
        source = (call.rank - step) % call.size
        kv = call.ring_transfer((k, v), call.kv_shapes((source - 1) % call.size)) if step < call.size - 1 else None
        dk, dv = np.zeros_like(k), np.zeros_like(v)
        with _progressing((kv.requests if kv else []) + (dkv.requests if dkv else [])):
            for (qa, lq), (ka, lk), causal, window in call.blocks(call.rank, source):
                rows = slice(qa, qa + lq)
                qb, kb, vb, opts = call.opts(q[:, rows], k[:, ka:ka + lk], v[:, ka:ka + lk], causal, window)
                dqb, dkb, dvb = softmax_backward(
                    qb, kb, vb, np.ascontiguousarray(o[:, rows]), np.ascontiguousarray(lse[:, rows]),
                    np.ascontiguousarray(do[:, rows]),
                    None if dlse is None else np.ascontiguousarray(dlse[:, rows]), opts)
                dq[:, rows] += dqb
                dk[:, ka:ka + lk] += dkb
                dv[:, ka:ka + lk] += dvb
        if dkv is not None:
            dk_in, dv_in = dkv.received()
            dk += dk_in
            dv += dv_in
        # on to the next rank (after the last step, the block's owner), under tags of their own
        # since the next hop's K/V are on the way at the same time
        dkv = call.ring_transfer((dk, dv), call.kv_shapes((source - 1) % call.size), tag=2)
        if kv:
            k, v = kv.received()
    dk, dv = dkv.received()
    call.finish_sends()
    return dq, dk, dv


def ring_attention(q, k, v, *, comm, causal=True, scale=None, window=None, softcap=None,
                   return_lse=False, layout="contiguous"):
    """Softmax attention over a sequence split across the ranks of ``comm``.

    Every rank calls it with its slice of the sequence: q ``[B, T_r, H, Dk]``, k ``[B, T_r,
    Hk, Dk]``, v ``[B, T_r, Hk, Dv]`` (GQA, MQA and ``Dk != Dv`` as in ``softmax_attention``;
    float32 or float64). ``layout="contiguous"``: rank r holds a contiguous slice, slices in
    rank order, lengths may differ between ranks. ``layout="zigzag"`` balances causal work: the
    sequence is cut into 2N equal chunks (N ranks) and rank r holds chunks r and 2N-1-r
    concatenated (``zigzag_split`` makes these slices from a whole sequence). ``scale``,
    ``window=(left, right)`` (over global positions) and ``softcap`` as in ``softmax_attention``.

    Returns the rank's rows of ``o [B, T_r, H, Dv]`` in its layout, or ``(o, lse)`` with
    ``return_lse=True`` (the log-sum-exp over the whole sequence): what ``softmax_attention``
    on the whole sequence gives for these rows. Key/value blocks travel the ring by
    non-blocking send/receive overlapped with the flash kernel and merge by log-sum-exp.
    Differentiable through ``pyattn.vjp``: each rank's pullback takes its rows' cotangents and
    returns the gradients of its own q, k and v (all ranks run the pullback together).
    Ranks that disagree on shapes, dtypes or options get the same ValueError on every rank.
    """
    call = _Call(q, k, v, comm, causal, scale, window, softcap, layout)
    o, lse = _forward(call)
    return (o, lse) if return_lse else o


@register_vjp(ring_attention)
def _ring_attention_vjp(q, k, v, *, comm, causal=True, scale=None, window=None, softcap=None,
                        return_lse=False, layout="contiguous"):
    call = _Call(q, k, v, comm, causal, scale, window, softcap, layout)
    o, lse = _forward(call)

    def pullback(cot):
        do, dlse = split_cotangent("ring_attention", cot, 2)
        if not return_lse and dlse is not None:
            raise ValueError("ring_attention pullback: got a cotangent for lse, but return_lse=False")
        do = np.zeros_like(o) if do is None else np.ascontiguousarray(do, dtype=o.dtype)
        if do.shape != o.shape:
            raise ValueError(f"ring_attention pullback: 'do' must have shape {o.shape}, got {do.shape}")
        if dlse is not None:
            dlse = np.ascontiguousarray(dlse, dtype=o.dtype)
            if dlse.shape != lse.shape:
                raise ValueError(f"ring_attention pullback: 'dlse' must have shape {lse.shape}, got {dlse.shape}")
        dq, dk, dv = _backward(call, o, lse, do, dlse)
        return {"q": dq, "k": dk, "v": dv}

    return ((o, lse) if return_lse else o), pullback


def _zigzag_checked(fn, x, comm, axis, divisor):
    """(x as an array, axis), after every rank agreed on its shape but the sequence axis, its
    dtype, and a length dividing by ``divisor``."""
    x = np.asarray(x)
    try:
        axis = int(axis)
        if not -x.ndim <= axis < x.ndim:
            raise ValueError(f"{fn}(): 'axis' {axis} is out of range for an array of {x.ndim} dimensions")
        axis %= x.ndim
        if x.shape[axis] % divisor:
            raise ValueError(f"{fn}(): the sequence length {x.shape[axis]} must divide by {divisor}")
        facts, error = ("ok", axis, str(x.dtype), x.shape[:axis] + x.shape[axis + 1:]), None
    except (TypeError, ValueError) as e:
        facts, error = ("error", f"{type(e).__name__}: {e}"), e
    agree(comm, fn, facts)
    if error is not None:  # the same on every rank
        raise error
    return x, axis


def zigzag_split(x, comm, axis=1):
    """The rank's zigzag slice of the whole sequence ``x`` (the same on every rank): the
    sequence axis ``axis`` cut into 2N equal chunks (N ranks), chunks r and 2N-1-r
    concatenated. The length must divide by 2N (ValueError on every rank otherwise)."""
    n = comm.Get_size()
    x, axis = _zigzag_checked("zigzag_split", x, comm, axis, 2 * n)
    chunks = np.split(x, 2 * n, axis=axis)
    r = comm.Get_rank()
    return np.concatenate([chunks[r], chunks[2 * n - 1 - r]], axis=axis)


def zigzag_merge(x, comm, axis=1):
    """The whole sequence, on every rank, from the ranks' zigzag slices ``x`` (the inverse of
    ``zigzag_split``; one allgather)."""
    n = comm.Get_size()
    x, axis = _zigzag_checked("zigzag_merge", x, comm, axis, 2)
    chunks = [None] * (2 * n)
    for r, part in enumerate(comm.allgather(np.ascontiguousarray(x))):
        chunks[r], chunks[2 * n - 1 - r] = np.split(part, 2, axis=axis)
    return np.concatenate(chunks, axis=axis)
