"""Sparse softmax attention: MoBA (mixture of block attention), NSA (native sparse
attention), DeepSeek sparse attention with its lightning indexer, and Linformer's attention
over projected keys. Every op is softmax attention over a chosen set of keys, computed by
the flash kernel, the decode kernel over listed key rows, or MoBA's block kernel; none forms
a score matrix.

A MoBA query attends to a few key blocks: its own (causal inside it) and the past blocks
whose mean key best matches it (non-causal: its own, whole, and the best others). One kernel
call each way: the block kernel (_core.moba_forward) runs each (query, head)'s chosen blocks
whole and, causal, its own block up to its position, with one online softmax across them;
_core.moba_backward is its backward.

Size arguments beyond the data (a block longer than every sequence, more blocks or keys
than there are) mean the largest meaningful value and are clamped to it before anything is
allocated: the result is the same, and no buffer follows the argument.
"""
from __future__ import annotations

import numpy as np

from . import _bf16, _core
from . import _validate as V
from ._engines import softmax_backward, softmax_forward, softmax_mask, softmax_options
from .autodiff import register_vjp


def _offsets(fn, B, Tq, Tk, cu_seqlens):
    """(cu_q, cu_k): the query and key rows of each sequence. The queries are the last Tq
    positions of their keys' sequence (bottom-right, so Tq <= Tk); with cu_seqlens (B = 1)
    queries and keys are the same rows."""
    if Tq > Tk:
        raise ValueError(f"{fn}(): the queries are the last Tq positions of the keys' sequence: "
                         f"need Tq <= Tk, got Tq={Tq}, Tk={Tk}")
    if cu_seqlens is None:
        return V.batch_offsets(B, Tq), V.batch_offsets(B, Tk)
    if Tq != Tk:
        raise ValueError(f"{fn}(): with 'cu_seqlens' queries and keys are the same rows, got Tq={Tq}, Tk={Tk}")
    cu = V.cu_seqlens(fn, "cu_seqlens", cu_seqlens, Tk, B)
    return cu, cu


def _block_means(x, cu, bs):
    """[blocks, ...]: the mean of x [rows, ...] over each block of bs rows of every sequence
    (cu), the last of a sequence maybe shorter; the full blocks of a sequence as one reshape."""
    n = len(cu) - 1
    lens = np.diff(cu)
    first = np.concatenate(([0], np.cumsum(-(-lens // bs)))).astype(np.int64)
    out = np.empty((first[-1],) + x.shape[1:], x.dtype)
    for i in range(n):
        full, tail = divmod(int(lens[i]), bs)
        rows = x[cu[i]:cu[i] + full * bs]
        out[first[i]:first[i] + full] = rows.reshape((full, bs) + x.shape[1:]).mean(axis=1)
        if tail:
            out[first[i] + full] = x[cu[i] + full * bs:cu[i + 1]].mean(axis=0)
    return out


def _longest(cu):
    """The most rows of a sequence of cu, at least 1 (the clamp of a size argument)."""
    return max(int(np.diff(cu).max(initial=0)), 1)


def _positions(cu_q, cu_k):
    """(sequence, key position) of every query row: bottom-right, the last query of a
    sequence at its last key."""
    nq = np.diff(cu_q)
    seq = np.repeat(np.arange(len(nq)), nq)
    return seq, np.arange(cu_q[-1]) - cu_q[seq] + np.diff(cu_k)[seq] - nq[seq]


class _MobaCall:
    """A moba_attention call checked, and the kernel's choice array."""

    def __init__(self, q, k, v, block_size, top_k, causal, scale, cu_seqlens):
        fn = "moba_attention"
        arrs, dtype = V.float_arrays(fn, q=q, k=k, v=v)
        q, k, v = arrs["q"], arrs["k"], arrs["v"]
        B, Tq, H, D, Tk, Hk, Dv = V.attention_qkv(fn, q, k, v)
        bs = V.integer(fn, "block_size", block_size, 1)
        top_k = V.integer(fn, "top_k", top_k, 1)
        self.causal = V.boolean(fn, "causal", causal)
        self.scale = V.scale(fn, scale, D ** -0.5, dtype)
        cu_q, cu = _offsets(fn, B, Tq, Tk, cu_seqlens)
        longest = _longest(cu)
        self.bs = min(bs, longest)
        self.top_k = min(top_k, -(-longest // self.bs))
        self.shape, self.kshape, self.vshape = q.shape, k.shape, v.shape
        self.H, self.Hk, self.D, self.Dv = H, Hk, D, Dv
        self.q, self.k, self.v = (x.reshape(x.shape[0] * x.shape[1], x.shape[2], x.shape[3]) for x in (q, k, v))
        self.cu, self.cu_q = cu, cu_q
        self._choose()

    def _choose(self):
        """The kernel's choice [rows, H, slots]: per (query, head) the blocks best by
        q . mean(k_block), best first, ties to the lower block, -1 after them (causal: the
        past blocks only, top_k - 1 of them, the own block being the kernel's to add;
        non-causal: the own block first, then the top_k - 1 best others)."""
        self.slots = max(self.top_k - 1, 0) if self.causal else self.top_k
        self.choice = np.empty((self.q.shape[0], self.H, max(self.slots, 1)), np.int32)
        _core.moba_select(self.q, _block_means(self.k, self.cu, self.bs), self.cu_q, self.cu, self.bs,
                          self.causal, self.slots, self.choice)

    def blocks_args(self):
        """The kernel's arguments after q, k, v."""
        return self.choice, self.cu_q, self.cu, self.bs, self.causal, self.scale


def _moba_forward(c):
    """(o [rows, H, Dv], lse [rows, H])."""
    rows, H, Dv = c.q.shape[0], c.H, c.Dv
    o, lse = np.empty((rows, H, Dv), c.q.dtype), np.empty((rows, H), c.q.dtype)
    _core.moba_forward(c.q, c.k, c.v, *c.blocks_args(), o, lse)
    return o, lse


@_bf16.calls
def moba_attention(q, k, v, *, block_size, top_k, causal=True, scale=None, cu_seqlens=None):
    """MoBA, mixture of block attention: each query attends to ``top_k`` blocks of
    ``block_size`` keys.

    q ``[B, Tq, H, Dk]``, k ``[B, Tk, Hk, Dk]``, v ``[B, Tk, Hk, Dv]`` (``H % Hk == 0``; query
    head h reads KV head ``h // (H // Hk)``); float32 or float64. The queries are the last Tq
    positions of the keys' sequence (``Tq <= Tk``, bottom-right as ``softmax_attention``:
    ``Tq = Tk`` in training, the new tokens in decoding). The keys split into blocks
    of ``block_size`` (the last of a sequence may be shorter), each scored for query i of
    head h by ``q_i . mean(k_block)``. Causal (the default): the query's own block is always
    chosen, counts as one of the ``top_k``, and is attended causally; the other ``top_k -
    1`` are the best-scoring past blocks (ties to the lower block), attended whole; future
    blocks never. ``causal=False``: the own block is still always chosen, and the other
    ``top_k - 1`` are the best of all other blocks, earlier or later (ties to the lower
    block), every chosen block attended whole. Within the chosen keys, ``o_i = sum_j
    softmax_j(scale q_i.k_j) v_j`` (scale ``Dk ** -0.5`` unless given). A ``block_size``
    beyond the longest sequence acts as its length, a ``top_k`` beyond its blocks as their
    count. ``cu_seqlens`` (B = 1, Tq = Tk) packs sequences; blocks restart at each. Returns
    ``o [B, Tq, H, Dv]``. Differentiable in q, k, v through ``pyattn.vjp``; the choice of
    blocks is not differentiated.
    """
    c = _MobaCall(q, k, v, block_size, top_k, causal, scale, cu_seqlens)
    return _moba_forward(c)[0].reshape(c.shape[:3] + (c.Dv,))


@register_vjp(moba_attention)
def _moba_attention_vjp(q, k, v, *, block_size, top_k, causal=True, scale=None, cu_seqlens=None):
    c = _MobaCall(q, k, v, block_size, top_k, causal, scale, cu_seqlens)
    o, lse = _moba_forward(c)

    def pullback(do):
        arrs, _ = V.float_arrays("moba_attention pullback", q=c.q, do=do)
        do = arrs["do"]
        V.shape("moba_attention pullback", "do", do, c.shape[:3] + (c.Dv,), "[B, T, H, Dv]")
        dq, dk, dv = np.empty_like(c.q), np.empty_like(c.k), np.empty_like(c.v)
        _core.moba_backward(c.q, c.k, c.v, o, lse, do.reshape(o.shape), None, *c.blocks_args(),
                            dq, dk, dv)
        return {"q": dq.reshape(c.shape), "k": dk.reshape(c.kshape), "v": dv.reshape(c.vshape)}

    return o.reshape(c.shape[:3] + (c.Dv,)), pullback


def _linformer_prepare(q, k, v, E, F, scale):
    fn = "linformer_attention"
    arrs, dtype = V.float_arrays(fn, q=q, k=k, v=v, E=E, F=F)
    q, k, v, E, F = (arrs[x] for x in ("q", "k", "v", "E", "F"))
    B, Tq, H, D, Tk = V.attention_qkv(fn, q, k, v)[:5]
    V.ndim(fn, "E", E, 2, "[S, T]")
    V.same(fn, "key lengths", {"k": Tk, "E's columns": E.shape[1]})
    V.shape(fn, "F", F, E.shape, "[S, T] as E")
    if E.shape[0] < 1:
        raise ValueError(f"{fn}(): E and F need S >= 1 rows, got S={E.shape[0]}")
    return q, k, v, E, F, V.scale(fn, scale, D ** -0.5, dtype)


def _project(P, x):
    """P [S, T] applied along time to x [B, T, Hk, D]: [B, S, Hk, D]."""
    B, T, Hk, D = x.shape
    return (P @ x.reshape(B, T, Hk * D)).reshape(B, P.shape[0], Hk, D)


def _linformer_call(q, k, v, E, F, scale):
    """The checked arrays, the projected k' = E k and v' = F v, and the flash call's options."""
    q, k, v, E, F, scale = _linformer_prepare(q, k, v, E, F, scale)
    kp, vp = _project(E, k), _project(F, v)
    B, Tq, S = q.shape[0], q.shape[1], E.shape[0]
    opts = softmax_options(V.batch_offsets(B, Tq), V.batch_offsets(B, S), softmax_mask(scale))
    return q, k, v, E, F, kp, vp, opts


@_bf16.calls
def linformer_attention(q, k, v, E, F, *, scale=None):
    """Linformer: softmax attention over S projected keys and values, ``k' = E k`` and ``v' =
    F v`` along time (``E, F [S, T]`` shared by the batch and the heads), non-causal.

    q ``[B, Tq, H, Dk]``, k ``[B, T, Hk, Dk]``, v ``[B, T, Hk, Dv]`` (GQA as
    ``softmax_attention``), one float dtype for all five arrays. ``o_i = sum_s softmax_s(scale
    q_i.k'_s) v'_s`` (scale ``Dk ** -0.5`` unless given), computed by the flash kernel over
    the S projected rows. Returns ``o [B, Tq, H, Dv]``. Differentiable in q, k, v, E and F.
    """
    q, _, _, _, _, kp, vp, opts = _linformer_call(q, k, v, E, F, scale)
    return softmax_forward(q, kp, vp, opts)[0]


@register_vjp(linformer_attention)
def _linformer_attention_vjp(q, k, v, E, F, *, scale=None):
    q, k, v, E, F, kp, vp, opts = _linformer_call(q, k, v, E, F, scale)
    o, lse = softmax_forward(q, kp, vp, opts)

    def pullback(do):
        arrs, _ = V.float_arrays("linformer_attention pullback", q=q, do=do)
        do = arrs["do"]
        V.shape("linformer_attention pullback", "do", do, o.shape, "[B, Tq, H, Dv]")
        dq, dkp, dvp = softmax_backward(q, kp, vp, o, lse, do, None, opts)
        B, T = k.shape[:2]
        grads = {"q": dq}
        for name, pname, x, P, g in (("k", "E", k, E, dkp), ("v", "F", v, F, dvp)):
            C = x.shape[2] * x.shape[3]
            g2, x2 = g.reshape(B, P.shape[0], C), x.reshape(B, T, C)
            grads[name] = (P.T @ g2).reshape(x.shape)
            grads[pname] = np.einsum("bsc,btc->st", g2, x2, optimize=True)
        return grads

    return o, pullback


class _Listed:
    """Query rows each attending to the key rows listed for it, through the decode kernel
    (softmax_decode) and its backward: q ``[R, Hq, Dk]``, every row its own sequence, every
    head of a row reading the same keys; the pool k ``[A, bs, Hk, Dk]``, v ``[A, bs, Hk, Dv]``;
    row r reads keys ``start[r] .. end[r]-1`` of the pool's rows, or, with ``table`` int32
    ``[R, n]``, key j at row ``j % bs`` of block ``table[r, j // bs]``."""

    def __init__(self, q, k, v, start, end, table, scale):
        self.q, self.k, self.v = q[None], k, v
        R = q.shape[0]
        self.rows = (np.arange(R + 1, dtype=np.int64), start.astype(np.int64), end.astype(np.int64),
                     None if table is None else np.ascontiguousarray(table, dtype=np.int32))
        self.mask = softmax_mask(scale)

    def forward(self):
        """(o [R, Hq, Dv], lse [R, Hq])"""
        q = self.q
        self.o = np.empty(q.shape[:3] + (self.v.shape[3],), q.dtype)
        self.lse = np.empty(q.shape[:3], q.dtype)
        _core.softmax_decode(q, self.k, self.v, self.o, self.lse, *self.rows, 0, None, *self.mask)
        return self.o[0], self.lse[0]

    def backward(self, do, dlse=None):
        """(dq [R, Hq, Dk], dk and dv shaped as the pool)"""
        dq, dk, dv = np.empty_like(self.q), np.empty_like(self.k), np.empty_like(self.v)
        _core.softmax_decode_backward(self.q, self.k, self.v, self.o, self.lse, do[None],
                                      None if dlse is None else dlse[None], dq, dk, dv, *self.rows,
                                      *self.mask)
        return dq[0], dk, dv


_SELECT_ROWS = 1024  # queries per slab of NSA's block importances


class _NsaCall:
    """An nsa_attention call checked; its blocks, compressed keys, selection and the three
    branches' calls."""

    GATES = ("g_cmp", "g_slc", "g_swa")

    def __init__(self, q, k, v, g_cmp, g_slc, g_swa, block_size, block_count, window, k_cmp, v_cmp,
                 scale, cu_seqlens):
        fn = "nsa_attention"
        if (k_cmp is None) != (v_cmp is None):
            raise ValueError(f"{fn}(): give both 'k_cmp' and 'v_cmp' or neither")
        arrs, dtype = V.float_arrays(fn, ("k_cmp", "v_cmp"), q=q, k=k, v=v, g_cmp=g_cmp, g_slc=g_slc,
                                     g_swa=g_swa, k_cmp=k_cmp, v_cmp=v_cmp)
        q, k, v = arrs["q"], arrs["k"], arrs["v"]
        B, Tq, H, D, Tk, Hk, Dv = V.attention_qkv(fn, q, k, v)
        for name in self.GATES:
            V.shape(fn, name, arrs[name], (B, Tq, H), "[B, T, H]")
        bs = V.integer(fn, "block_size", block_size, 1)
        nsel = V.integer(fn, "block_count", block_count, 1)
        window = V.integer(fn, "window", window, 1)
        self.scale = V.scale(fn, scale, D ** -0.5, dtype)
        self.cu_q, self.cu_k = _offsets(fn, B, Tq, Tk, cu_seqlens)
        longest = _longest(self.cu_k)
        # a block_size beyond every sequence gives each one block, never complete (nothing
        # for the compressed branch), as longest + 1 does
        self.bs = bs = min(bs, longest + 1)
        self.nsel, self.window = min(nsel, -(-longest // bs)), min(window, longest)
        self.shape, self.kshape, self.vshape = q.shape, k.shape, v.shape
        self.H, self.Hk, self.D, self.Dv = H, Hk, D, Dv
        self.q, self.k, self.v = (x.reshape(-1, x.shape[2], x.shape[3]) for x in (q, k, v))
        self.gates = [arrs[name].reshape(-1, H, 1) for name in self.GATES]
        # blocks of bs keys, restarting at each sequence; the last of a sequence may be shorter
        nbs = -(-np.diff(self.cu_k) // bs)
        self.first = np.concatenate(([0], np.cumsum(nbs))).astype(np.int64)
        NB = int(self.first[-1])
        bseq = np.repeat(np.arange(len(nbs)), nbs)
        self.bstart = self.cu_k[bseq] + (np.arange(NB) - self.first[bseq]) * bs
        self.blen = np.minimum(self.bstart + bs, self.cu_k[bseq + 1]) - self.bstart
        self.given = k_cmp is not None
        if self.given:
            V.shape(fn, "k_cmp", arrs["k_cmp"], (B, NB // max(B, 1), Hk, D), "[B, blocks, Hk, Dk]")
            V.shape(fn, "v_cmp", arrs["v_cmp"], (B, NB // max(B, 1), Hk, Dv), "[B, blocks, Hk, Dv]")
            self.cmp_shapes = arrs["k_cmp"].shape, arrs["v_cmp"].shape
            self.kc, self.vc = (arrs[x].reshape(NB, Hk, arrs[x].shape[3]) for x in ("k_cmp", "v_cmp"))
        else:
            self.kc, self.vc = (_block_means(x, self.cu_k, bs) for x in (self.k, self.v))
        self.seq, self.pos = _positions(self.cu_q, self.cu_k)
        own = self.pos // bs
        # the compressed branch: every head of a query sees the blocks complete at it
        start = self.first[self.seq]
        self.cmp = _Listed(self.q, self.kc[None], self.vc[None], start, start + (self.pos + 1) // bs, None,
                           self.scale)
        # the selection branch: items (query, KV head), the G heads of a group reading its blocks
        self.oc, self.lsec = self.cmp.forward()
        table, count = self._select(own)
        within = np.arange(bs)
        self.block_rows = np.minimum(self.bstart[:, None] + within, self.bstart[:, None] + self.blen[:, None] - 1)
        self.block_valid = within < self.blen[:, None]
        pool = [np.ascontiguousarray(x[self.block_rows].transpose(2, 0, 1, 3).reshape(Hk * NB, bs, 1,
                                                                                      x.shape[2]))
                for x in (self.k, self.v)]
        length = ((count - 1) * bs + (self.pos - own * bs + 1)[:, None]).reshape(-1)
        self.slc = _Listed(self.q.reshape(-1, H // Hk, D), *pool, np.zeros_like(length), length,
                           table.reshape(-1, table.shape[-1]), self.scale)
        window = softmax_mask(self.scale, causal=True, window_left=self.window - 1, window_right=0)
        self.swa_opts = softmax_options(self.cu_q, self.cu_k, window)

    def _select(self, own):
        """Block tables [rows, Hk, block_count] of the selection (past blocks best first, then
        the own block) and the number of blocks of each (row, KV head)."""
        Hk, G, D, NB = self.Hk, self.H // self.Hk, self.D, len(self.bstart)
        rows = self.q.shape[0]
        table = np.empty((rows, Hk, self.nsel), np.int64)
        count = np.ones((rows, Hk), np.int64)
        # a slab of _SELECT_ROWS queries at a time bounds the [Hk, rows G, blocks] scores
        slabs = [(n, r0, min(r0 + _SELECT_ROWS, self.cu_q[n + 1])) for n in range(len(self.cu_q) - 1)
                 for r0 in range(self.cu_q[n], self.cu_q[n + 1], _SELECT_ROWS)]
        for n, r0, r1 in slabs:
            b0, nb = self.first[n], self.first[n + 1] - self.first[n]
            L = r1 - r0
            qn = self.q[r0:r1].reshape(L, Hk, G, D).transpose(1, 0, 2, 3).reshape(Hk, L * G, D)
            s = self.scale * (qn @ self.kc[b0:b0 + nb].transpose(1, 2, 0))          # [Hk, L G, nb]
            lse = self.lsec[r0:r1].reshape(L, Hk, G).transpose(1, 0, 2).reshape(Hk, L * G, 1)
            with np.errstate(over="ignore", invalid="ignore"):
                imp = np.exp(s - lse).reshape(Hk, L, G, nb).sum(axis=2)                # [Hk, L, nb]
            o = own[r0:r1]
            # past blocks only; a NaN importance (a NaN query) ranks below every number but
            # stays a past block
            imp = np.where(np.arange(nb) < o[:, None], np.where(np.isnan(imp), -1, imp), -np.inf)
            want = min(self.nsel - 1, nb)
            best = np.argsort(-imp, axis=-1, kind="stable")[..., :want]               # ties: lower block
            past = np.minimum(want, o)                                                 # [L]
            padded = np.zeros((Hk, L, self.nsel), np.int64)
            padded[..., :want] = best
            slot = np.arange(self.nsel)
            # the past blocks, then the own block (causal: the last, cut at the query)
            blocks = np.where(slot < past[:, None], padded, o[:, None])
            table[r0:r1] = (b0 + np.arange(Hk)[:, None, None] * NB + blocks).transpose(1, 0, 2)
            count[r0:r1] = (past + 1)[:, None]
        return table, count

    def forward(self):
        """o [rows, H, Dv], and the branches' outputs (compressed, selected, window)."""
        rows, H = self.q.shape[0], self.H
        os_ = self.slc.forward()[0].reshape(rows, H, self.Dv)
        self.swa = softmax_forward(self.q[None], self.k[None], self.v[None], self.swa_opts)
        parts = (self.oc, os_, self.swa[0][0])
        return sum(g * x for g, x in zip(self.gates, parts)), parts

    def backward(self, do, parts):
        """The gradients (a dict) from do [rows, H, Dv]."""
        Hk, G, NB, bs = self.Hk, self.H // self.Hk, len(self.bstart), self.bs
        grads = {name: np.sum(do * x, axis=-1) for name, x in zip(self.GATES, parts)}
        dq, dkc, dvc = self.cmp.backward(self.gates[0] * do)
        dqs, dkb, dvb = self.slc.backward((self.gates[1] * do).reshape(-1, G, self.Dv))
        dqw, dk, dv = softmax_backward(self.q[None], self.k[None], self.v[None], *self.swa,
                                       (self.gates[2] * do)[None], None, self.swa_opts)
        dq += dqs.reshape(dq.shape) + dqw[0]
        dk, dv = dk[0], dv[0]
        # the selection's pool back to key rows (each valid (block, offset) is one row)
        for dx, dpool in ((dk, dkb), (dv, dvb)):
            per_row = dpool.reshape(Hk, NB, bs, dpool.shape[3]).transpose(1, 2, 0, 3)
            dx[self.block_rows[self.block_valid]] += per_row[self.block_valid]
        if self.given:
            grads["k_cmp"], grads["v_cmp"] = dkc[0], dvc[0]
        else:  # through the block means
            block_of_row = np.repeat(np.arange(NB), self.blen)
            dk += (dkc[0] / self.blen[:, None, None].astype(dk.dtype))[block_of_row]
            dv += (dvc[0] / self.blen[:, None, None].astype(dv.dtype))[block_of_row]
        grads.update(q=dq, k=dk, v=dv)
        return grads


@_bf16.calls
def nsa_attention(q, k, v, g_cmp, g_slc, g_swa, *, block_size=64, block_count=16, window=512,
                  k_cmp=None, v_cmp=None, scale=None, cu_seqlens=None):
    """NSA, native sparse attention (Yuan et al., 2025): three causal softmax branches per
    query, mixed by per-head gates.

    q ``[B, Tq, H, Dk]``, k ``[B, Tk, Hk, Dk]``, v ``[B, Tk, Hk, Dv]`` (``H % Hk == 0``, query
    head h reads KV head ``h // (H // Hk)``), gates ``g_cmp, g_slc, g_swa [B, Tq, H]`` (applied
    as given: a layer passes them through a sigmoid first); one float dtype. The queries are
    the last Tq positions of the keys' sequence (``Tq = Tk`` in training). Keys split into
    blocks of ``block_size`` (restarting at each sequence; the last may be shorter). For the
    query at position i:

    - compressed: softmax attention over the blocks complete at i (block c with ``(c + 1)
      block_size <= i + 1``), each a key ``k_cmp`` and value ``v_cmp``: the block means of k
      and v, or the rows given (``[B, blocks, Hk, D]``, one per block, then differentiable);
      none complete gives 0;
    - selected: one choice per (query, KV head), shared by its query heads: the query's own
      block (attended causally), and the ``block_count - 1`` past blocks of highest
      importance, the compressed branch's attention probabilities of the block summed over
      the group's heads (ties to the lower block), attended whole;
    - sliding window: the keys ``i - window + 1 .. i``.

    ``o = g_cmp o_cmp + g_slc o_slc + g_swa o_swa``, scale ``Dk ** -0.5`` unless given. A
    ``window`` beyond the longest sequence acts as its length, a ``block_count`` beyond its
    blocks as their count, a ``block_size`` beyond it as its length + 1 (one block per
    sequence, never complete). ``cu_seqlens`` (B = 1, Tq = Tk) packs sequences. Every branch
    is softmax attention over listed keys, run by the flash and decode kernels; no score
    matrix is formed. Returns ``o [B, Tq, H, Dv]``; differentiable in q, k, v, the gates and
    k_cmp, v_cmp through ``pyattn.vjp`` (the choice of blocks is not differentiated).
    """
    c = _NsaCall(q, k, v, g_cmp, g_slc, g_swa, block_size, block_count, window, k_cmp, v_cmp, scale,
                 cu_seqlens)
    return c.forward()[0].reshape(c.shape[:3] + (c.Dv,))


@register_vjp(nsa_attention)
def _nsa_attention_vjp(q, k, v, g_cmp, g_slc, g_swa, *, block_size=64, block_count=16, window=512,
                       k_cmp=None, v_cmp=None, scale=None, cu_seqlens=None):
    c = _NsaCall(q, k, v, g_cmp, g_slc, g_swa, block_size, block_count, window, k_cmp, v_cmp, scale,
                 cu_seqlens)
    o, parts = c.forward()

    def pullback(do):
        arrs, _ = V.float_arrays("nsa_attention pullback", q=c.q, do=do)
        V.shape("nsa_attention pullback", "do", arrs["do"], c.shape[:3] + (c.Dv,), "[B, T, H, Dv]")
        grads = c.backward(arrs["do"].reshape(o.shape), parts)
        out = {"q": grads["q"].reshape(c.shape), "k": grads["k"].reshape(c.kshape),
               "v": grads["v"].reshape(c.vshape)}
        for name in c.GATES:
            out[name] = grads[name].reshape(c.shape[:3])
        if c.given:
            out["k_cmp"] = grads["k_cmp"].reshape(c.cmp_shapes[0])
            out["v_cmp"] = grads["v_cmp"].reshape(c.cmp_shapes[1])
        return out

    return o.reshape(c.shape[:3] + (c.Dv,)), pullback


_INDEX_ROWS = 256  # queries per slab of index scores: a slab is [256, Hi, Tk], never [T, T, Hi]


def _index_arrays(fn, index_q, index_k, index_w, dtype=None):
    """index_q [B, Tq, Hi, Di], index_k [B, Tk, Di], index_w [B, Tq, Hi] checked against
    each other (and against dtype when given)."""
    arrs, got = V.float_arrays(fn, index_q=index_q, index_k=index_k, index_w=index_w)
    if dtype is not None and got != dtype:
        raise TypeError(f"{fn}(): the index arrays must have q's dtype {np.dtype(dtype).name}, got {got.name}")
    iq, ik, iw = arrs["index_q"], arrs["index_k"], arrs["index_w"]
    V.ndim(fn, "index_q", iq, 4, "[B, Tq, Hi, Di]")
    V.ndim(fn, "index_k", ik, 3, "[B, Tk, Di]")
    V.shape(fn, "index_w", iw, iq.shape[:3], "[B, Tq, Hi]")
    V.same(fn, "batch sizes", {"index_q": iq.shape[0], "index_k": ik.shape[0]})
    V.same(fn, "index dims", {"index_q": iq.shape[3], "index_k": ik.shape[2]})
    return iq, ik, iw


def _index_slab(iq, ik, iw):
    """Scores [L, Tk] = sum_j iw[:, j] relu(iq[:, j] . ik) of L queries, and the relu'd
    products [L, Hi, Tk] (the backward's)."""
    L, Hi, Di = iq.shape
    a = np.maximum(iq.reshape(L * Hi, Di) @ ik.T, 0).reshape(L, Hi, -1)
    return (iw[:, None, :] @ a)[:, 0], a


@_bf16.calls
def dsa_index_scores(index_q, index_k, index_w):
    """The lightning indexer of DeepSeek sparse attention: ``I[b, t, s] = sum_j index_w[b,
    t, j] relu(index_q[b, t, j] . index_k[b, s])``.

    index_q ``[B, Tq, Hi, Di]``, index_k ``[B, Tk, Di]``, index_w ``[B, Tq, Hi]``, one float
    dtype. Returns the unmasked scores ``[B, Tq, Tk]``; differentiable in all three through
    ``pyattn.vjp``.
    """
    iq, ik, iw = _index_arrays("dsa_index_scores", index_q, index_k, index_w)
    B, Tq = iq.shape[:2]
    out = np.empty((B, Tq, ik.shape[1]), iq.dtype)
    for b in range(B):
        for t0 in range(0, Tq, _INDEX_ROWS):
            t1 = min(t0 + _INDEX_ROWS, Tq)
            out[b, t0:t1] = _index_slab(iq[b, t0:t1], ik[b], iw[b, t0:t1])[0]
    return out


@register_vjp(dsa_index_scores)
def _dsa_index_scores_vjp(index_q, index_k, index_w):
    iq, ik, iw = _index_arrays("dsa_index_scores", index_q, index_k, index_w)
    out = dsa_index_scores(iq, ik, iw)

    def pullback(dI):
        arrs, _ = V.float_arrays("dsa_index_scores pullback", index_q=iq, dI=dI)
        dI = arrs["dI"]
        V.shape("dsa_index_scores pullback", "dI", dI, out.shape, "[B, Tq, Tk]")
        dq, dk, dw = np.zeros_like(iq), np.zeros_like(ik), np.zeros_like(iw)
        B, Tq, Hi, Di = iq.shape
        for b in range(B):
            for t0 in range(0, Tq, _INDEX_ROWS):
                t1 = min(t0 + _INDEX_ROWS, Tq)
                L = t1 - t0
                _, a = _index_slab(iq[b, t0:t1], ik[b], iw[b, t0:t1])
                dw[b, t0:t1] = (a @ dI[b, t0:t1, :, None])[..., 0]
                da = np.where(a > 0, iw[b, t0:t1, :, None] * dI[b, t0:t1, None, :], 0).reshape(L * Hi, -1)
                dq[b, t0:t1] = (da @ ik[b]).reshape(L, Hi, Di)
                dk[b] += da.T @ iq[b, t0:t1].reshape(L * Hi, Di)
        return {"index_q": dq, "index_k": dk, "index_w": dw}

    return out, pullback


class _DsaSelection:
    """The keys each query of a DSA call attends to (the C kernel dsa_select: the indexer's
    scores in tiles of queries, a quickselect per query): ``rows`` int32 ``[Rq, top_k]``
    (flattened key rows b * Tk + s, ascending, -1 after the last: the decode kernel's block
    table of single rows), their ``count [Rq]``, and ``nan [Rq]``, the queries whose visible
    index scores hold a NaN (their outputs are NaN). A top_k beyond the Tk keys is Tk: no
    query has more to choose from."""

    def __init__(self, iq, ik, iw, top_k, causal, cu_q, cu_k):
        rows, Tk = int(cu_q[-1]), ik.shape[1]
        self.top_k = min(top_k, Tk)
        self.rows = np.empty((rows, self.top_k), np.int32)
        self.count = np.empty(rows, np.int64)
        nan = np.empty(rows, np.uint8)
        if rows:  # a query has a key at least (Tq <= Tk): top_k >= 1 as the kernel needs
            _core.dsa_select(iq.reshape(rows, *iq.shape[2:]), ik.reshape(-1, ik.shape[2]),
                             iw.reshape(rows, iw.shape[2]), cu_q, cu_k, self.top_k, causal, self.rows,
                             self.count, nan)
        self.nan = nan.astype(bool)


@_bf16.calls
def dsa_select(index_q, index_k, index_w, *, top_k, causal=True, cu_seqlens=None):
    """The keys DeepSeek sparse attention chooses: for every query, its ``top_k`` visible keys
    by ``dsa_index_scores`` (ties to the lower key), all visible keys when fewer:
    ``rows[b, t] = sorted(argtop_k_s I[b, t, s])`` over the keys s query t sees,
    ``I = dsa_index_scores(index_q, index_k, index_w)``.

    index_q ``[B, Tq, Hi, Di]``, index_k ``[B, Tk, Di]``, index_w ``[B, Tq, Hi]``; the queries
    are the last Tq positions of the keys' sequence; causal: key s is visible to the query at
    position i when ``s <= i``; ``cu_seqlens`` (B = 1, Tq = Tk) packs sequences. Returns int64
    ``[B, Tq, min(top_k, Tk)]`` (a top_k beyond the keys acts as Tk): the key rows (of the
    batch row, so under cu_seqlens counted from the pack's start), ascending, then -1 where
    fewer are visible. A C kernel scores tiles of queries and selects by quickselect: the
    ``[Tq, Tk]`` scores are never held at once. Not differentiable (``pyattn.vjp`` refuses
    it): integer rows have no gradient.
    """
    fn = "dsa_select"
    iq, ik, iw = _index_arrays(fn, index_q, index_k, index_w)
    top_k = V.integer(fn, "top_k", top_k, 1)
    causal = V.boolean(fn, "causal", causal)
    B, Tq, Tk = iq.shape[0], iq.shape[1], ik.shape[1]
    sel = _DsaSelection(iq, ik, iw, top_k, causal, *_offsets(fn, B, Tq, Tk, cu_seqlens))
    rows = sel.rows.reshape(B, Tq, sel.top_k).astype(np.int64)
    return np.where(rows >= 0, rows - np.arange(B)[:, None, None] * Tk, -1)


class _DsaCall:
    """A dsa_attention call checked, its selection, and the decode kernel's call over the
    selected rows."""

    def __init__(self, q, k, v, index_q, index_k, index_w, top_k, causal, scale, cu_seqlens):
        fn = "dsa_attention"
        arrs, dtype = V.float_arrays(fn, q=q, k=k, v=v)
        q, k, v = arrs["q"], arrs["k"], arrs["v"]
        B, Tq, H, D, Tk, Hk, Dv = V.attention_qkv(fn, q, k, v)
        iq, ik, iw = _index_arrays(fn, index_q, index_k, index_w, dtype)
        V.shape(fn, "index_q", iq, (B, Tq) + iq.shape[2:], "[B, Tq, Hi, Di]")
        V.shape(fn, "index_k", ik, (B, Tk, iq.shape[3]), "[B, Tk, Di]")
        self.index = (iq, ik, iw)
        top_k = V.integer(fn, "top_k", top_k, 1)
        causal = V.boolean(fn, "causal", causal)
        self.shape, self.kshape, self.Dv = q.shape, k.shape, Dv
        self.sel = _DsaSelection(iq, ik, iw, top_k, causal, *_offsets(fn, B, Tq, Tk, cu_seqlens))
        pool = [x.reshape(B * Tk, 1, Hk, x.shape[3]) for x in (k, v)]
        self.call = _Listed(q.reshape(B * Tq, H, D), *pool, np.zeros_like(self.sel.count), self.sel.count,
                            self.sel.rows, V.scale(fn, scale, D ** -0.5, dtype))

    def forward(self):
        o = self.call.forward()[0]
        o[self.sel.nan] = np.nan
        return o.reshape(self.shape[:3] + (self.Dv,))


@_bf16.calls
def dsa_attention(q, k, v, index_q, index_k, index_w, *, top_k, causal=True, scale=None,
                  cu_seqlens=None):
    """DeepSeek sparse attention (DeepSeek-V3.2): every query attends to the ``top_k`` keys its
    lightning indexer scores highest, one choice shared by all of its heads.

    q ``[B, Tq, H, Dk]``, k ``[B, Tk, Hk, Dk]``, v ``[B, Tk, Hk, Dv]`` (GQA/MQA as
    ``softmax_attention``); the indexer's index_q ``[B, Tq, Hi, Di]``, index_k ``[B, Tk, Di]``,
    index_w ``[B, Tq, Hi]``; one float dtype. The keys of a query are ``dsa_select``'s (its
    top_k visible keys by ``dsa_index_scores``, ties to the lower key; causal: keys at or
    before it; the queries are the last Tq positions of the keys' sequence); ``o_i = sum_s
    softmax_s(scale q_i.k_s) v_s`` over them (scale ``Dk ** -0.5`` unless given), run by the
    decode kernel over the selected rows. A NaN among a query's visible index scores makes
    its output NaN. A top_k beyond the keys acts as Tk. ``cu_seqlens`` (B = 1, Tq = Tk) packs
    sequences. Returns ``o [B, Tq, H, Dv]``; differentiable in q, k, v through
    ``pyattn.vjp``. The selection is not differentiated: the index arrays' gradients are 0;
    the indexer trains on its own loss against ``dsa_index_target``.
    """
    return _DsaCall(q, k, v, index_q, index_k, index_w, top_k, causal, scale, cu_seqlens).forward()


@register_vjp(dsa_attention)
def _dsa_attention_vjp(q, k, v, index_q, index_k, index_w, *, top_k, causal=True, scale=None,
                       cu_seqlens=None):
    c = _DsaCall(q, k, v, index_q, index_k, index_w, top_k, causal, scale, cu_seqlens)
    o = c.forward()

    def pullback(do):
        arrs, _ = V.float_arrays("dsa_attention pullback", q=o, do=do)
        V.shape("dsa_attention pullback", "do", arrs["do"], o.shape, "[B, T, H, Dv]")
        dq, dk, dv = c.call.backward(arrs["do"].reshape(-1, *o.shape[2:]))
        grads = {"q": dq.reshape(c.shape), "k": dk.reshape(c.kshape), "v": dv.reshape(c.kshape[:3] + (c.Dv,))}
        grads.update({name: np.zeros_like(x) for name, x in zip(("index_q", "index_k", "index_w"), c.index)})
        return grads

    return o, pullback


@_bf16.calls
def dsa_index_target(q, k, *, causal=True, scale=None, indices=None, cu_seqlens=None):
    """The distribution DeepSeek-V3.2 trains its indexer towards: the attention probabilities
    of the main attention summed over the heads and normalised, ``P[b, t, s] = (1/H) sum_h
    softmax_s(scale q_th . k_s)`` over the keys query t sees (causal: ``s <= t``; the same
    sequence), or over those of them listed in ``indices`` ``[B, Tq, top_k]``
    (``dsa_select``'s, -1 ignored) in the sparse stage. q ``[B, Tq, H, Dk]``, k ``[B, Tk, Hk, Dk]``. Returns ``P [B, Tq, Tk]`` (0 outside
    the keys; a query without keys has a row of 0). The indexer's loss is the KL divergence
    ``sum_s P log(P / softmax_s(I))`` of its scores I (``dsa_index_scores``) restricted to
    the same keys; P is a target, so by design not differentiable (``pyattn.vjp`` refuses it).
    """
    fn = "dsa_index_target"
    arrs, dtype = V.float_arrays(fn, q=q, k=k)
    q, k = arrs["q"], arrs["k"]
    B, Tq, H, D, Tk, Hk = V.queries_keys(fn, q, k)
    scale = V.scale(fn, scale, D ** -0.5, dtype)
    causal = V.boolean(fn, "causal", causal)
    cu_q, cu_k = _offsets(fn, B, Tq, Tk, cu_seqlens)
    if indices is not None:
        indices = V.index_array(fn, "indices", indices, 3, "[B, Tq, top_k]")
        V.shape(fn, "indices", indices, (B, Tq, indices.shape[2]), "[B, Tq, top_k]")
    q2, k2 = q.reshape(B * Tq, H, D), k.reshape(B * Tk, Hk, D)
    P = np.zeros((B * Tq, Tk), dtype)
    pos = _positions(cu_q, cu_k)[1]
    G = H // Hk
    for n in range(len(cu_q) - 1):
        k0, k1 = cu_k[n], cu_k[n + 1]
        base = k0 % Tk if Tk else 0  # the sequence's first key in its batch row
        for r0 in range(cu_q[n], cu_q[n + 1], _INDEX_ROWS):
            r1 = min(r0 + _INDEX_ROWS, cu_q[n + 1])
            L = r1 - r0
            qs = q2[r0:r1].reshape(L, Hk, G, D).transpose(1, 0, 2, 3).reshape(Hk, L * G, D)
            s = scale * (qs @ k2[k0:k1].transpose(1, 2, 0))                      # [Hk, L G, n]
            keys = np.ones((L, k1 - k0), bool)
            if causal:
                keys &= np.arange(k1 - k0) <= pos[r0:r1, None]
            if indices is not None:
                chosen = np.zeros((L, k1 - k0 + 1), bool)
                idx = indices.reshape(B * Tq, -1)[r0:r1] - base
                ok = (idx >= 0) & (idx < k1 - k0)
                chosen[np.nonzero(ok)[0], idx[ok]] = True
                keys &= chosen[:, :-1]
            s = np.where(np.repeat(keys, G, axis=0)[None], s, -np.inf)
            m = s.max(axis=-1, keepdims=True)
            with np.errstate(invalid="ignore"):
                e = np.where(np.isfinite(m), np.exp(s - np.where(np.isfinite(m), m, 0)), 0)
                p = e / np.where(e.sum(-1, keepdims=True) > 0, e.sum(-1, keepdims=True), 1)
            P[r0:r1, base:base + k1 - k0] = p.reshape(Hk, L, G, -1).sum(axis=(0, 2)) / H
    return P.reshape(B, Tq, Tk)


def dsa_index_loss(q, k, index_q, index_k, index_w, *, top_k, causal=True, scale=None,
                   cu_seqlens=None):
    """``(loss, grads)``: DeepSeek-V3.2's indexer distillation loss and its gradients in the
    index arrays, in one C kernel over the chosen keys.

    For every query t, over the keys ``dsa_select(index_q, index_k, index_w, top_k=top_k)``
    chooses for it: the target ``P = dsa_index_target(q, k, indices=chosen)`` (the main
    attention's probabilities summed over the heads and normalised), the indexer's
    distribution ``p = softmax(I)`` of its scores ``I = dsa_index_scores(index_q, index_k,
    index_w)`` there, and ``KL(P || p)``; ``loss`` (a float) is the mean over the ``B * Tq``
    queries. ``grads`` maps ``"index_q"``, ``"index_k"``, ``"index_w"`` to the loss's
    gradients (in their arrays' dtypes); the target is held constant, so q and k get none.
    Shapes, ``causal``, ``scale`` (``Dk ** -0.5``) and ``cu_seqlens`` as ``dsa_attention``;
    bf16 arrays are computed in float32. The ``[Tq, Tk]`` scores are never formed: the work
    is ``B Tq top_k (H Dk + Hi Di)``. A NaN among a query's visible index scores, or in q or
    k, makes the loss NaN.
    """
    fn = "dsa_index_loss"
    given = {"q": q, "k": k, "index_q": index_q, "index_k": index_k, "index_w": index_w}
    bf16 = {name: np.asarray(a).dtype for name, a in given.items() if _bf16.is_bf16(a)}
    if bf16:
        given = {name: _bf16.to_float32(a) if name in bf16 else a for name, a in given.items()}
    arrs, dtype = V.float_arrays(fn, q=given["q"], k=given["k"])
    q, k = arrs["q"], arrs["k"]
    B, Tq, H, D, Tk, Hk = V.queries_keys(fn, q, k)
    iq, ik, iw = _index_arrays(fn, given["index_q"], given["index_k"], given["index_w"], dtype)
    V.shape(fn, "index_q", iq, (B, Tq) + iq.shape[2:], "[B, Tq, Hi, Di]")
    V.shape(fn, "index_k", ik, (B, Tk, iq.shape[3]), "[B, Tk, Di]")
    top_k = V.integer(fn, "top_k", top_k, 1)
    causal = V.boolean(fn, "causal", causal)
    scale = V.scale(fn, scale, D ** -0.5, dtype)
    sel = _DsaSelection(iq, ik, iw, top_k, causal, *_offsets(fn, B, Tq, Tk, cu_seqlens))
    n = B * Tq
    Hi, Di = iq.shape[2:]
    loss = np.empty(n, dtype)
    diq, dik, diw = np.empty((n, Hi, Di), dtype), np.empty((B * Tk, Di), dtype), np.empty((n, Hi), dtype)
    _core.dsa_index_loss(q.reshape(n, H, D), k.reshape(B * Tk, Hk, D), iq.reshape(n, Hi, Di),
                         ik.reshape(B * Tk, Di), iw.reshape(n, Hi), sel.rows, sel.count, float(scale),
                         1.0 / max(n, 1), loss, diq, dik, diw)
    loss[sel.nan], diq[sel.nan], diw[sel.nan] = np.nan, np.nan, np.nan
    grads = {"index_q": diq.reshape(iq.shape), "index_k": dik.reshape(ik.shape), "index_w": diw.reshape(iw.shape)}
    grads = {name: _bf16.to_bf16(g, bf16[name]) if name in bf16 else g for name, g in grads.items()}
    return float(np.sum(loss, dtype=np.float64) / max(n, 1)), grads
