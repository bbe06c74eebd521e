"""Sparse softmax attention over the flash kernel: MoBA (mixture of block attention), and
Linformer's attention over projected keys.

A MoBA query attends to a few key blocks: its own (causal inside it) and the past blocks
whose mean key best matches it. The kernel work is two flash calls and no score matrix:
one varlen call whose "sequences" are (head, key block) pairs, each holding the queries that
chose that block (gathered) against that block's keys, and, causal, one call over the
blocks themselves (each query's own block). The parts are merged by their log-sum-exps,
as merge_attention_states does, and the backward runs the flash backward of both calls.
"""
from __future__ import annotations

import numpy as np

from . import _core
from . import _validate as V
from .autodiff import register_vjp
from .softmax import _backward, _forward, _merge_weights


class _MobaCall:
    """A moba_attention call checked, its blocks, the chosen (query, head, block) pairs and
    their packing for the flash kernel."""

    def __init__(self, q, k, v, block_size, top_k, causal, scale, cu_seqlens):
        fn = "moba_attention"
        arrs, dtype = V.float_arrays(fn, q=q, k=k, v=v)
        q, k, v = arrs["q"], arrs["k"], arrs["v"]
        B, Tq, H, D, Tk, Hk, Dv = V.attention_qkv(fn, q, k, v)
        if Tq > Tk:
            raise ValueError(f"{fn}(): the queries are the last Tq positions of the keys' sequence: "
                             f"need Tq <= Tk, got Tq={Tq}, Tk={Tk}")
        self.bs = V.integer(fn, "block_size", block_size, 1)
        self.top_k = V.integer(fn, "top_k", top_k, 1)
        self.causal = V.boolean(fn, "causal", causal)
        self.scale = V.scale(fn, scale, D ** -0.5, dtype)
        if cu_seqlens is None:
            cu_q, cu = V.batch_offsets(B, Tq), V.batch_offsets(B, Tk)
        elif Tq != Tk:
            raise ValueError(f"{fn}(): with 'cu_seqlens' queries and keys are the same rows, got Tq={Tq}, Tk={Tk}")
        else:
            cu_q = cu = V.cu_seqlens(fn, "cu_seqlens", cu_seqlens, Tk, B)
        self.shape, self.H, self.Hk, self.D, self.Dv = q.shape, H, Hk, D, Dv
        self.q, self.k, self.v = (x.reshape(x.shape[0] * x.shape[1], x.shape[2], x.shape[3]) for x in (q, k, v))
        # blocks: consecutive rows of one sequence, block_size each but the last
        starts = [np.arange(cu[n], cu[n + 1], self.bs) for n in range(len(cu) - 1)]
        self.bstart = np.concatenate(starts).astype(np.int64) if starts else np.zeros(0, np.int64)
        self.bend = np.minimum(self.bstart + self.bs, np.repeat(cu[1:], [len(s) for s in starts]))
        self.first_block = np.concatenate(([0], np.cumsum([len(s) for s in starts])))
        self.cu, self.cu_q = cu, cu_q
        self._choose()
        self._pack()

    def _choose(self):
        """The chosen (row, head, slot, block) of every query, as flat int64 arrays."""
        H, Hk, bs = self.H, self.Hk, self.bs
        G = H // Hk
        rows = self.k.shape[0]
        nb = len(self.bstart)
        kmean = np.zeros((nb, Hk, self.D), self.k.dtype)
        if rows:
            sums = np.add.reduceat(self.k.reshape(rows, -1), self.bstart, axis=0)
            kmean = (sums / (self.bend - self.bstart)[:, None]).reshape(nb, Hk, self.D).astype(self.k.dtype)
        picks = []
        for n in range(len(self.cu) - 1):
            b0, b1 = self.first_block[n], self.first_block[n + 1]
            L, Lk = self.cu_q[n + 1] - self.cu_q[n], self.cu[n + 1] - self.cu[n]
            if L == 0:
                continue
            qn = self.q[self.cu_q[n]:self.cu_q[n + 1]].transpose(1, 0, 2)      # [H, L, D]
            km = kmean[b0:b1][:, np.arange(H) // G, :].transpose(1, 2, 0)      # [H, D, nb]
            score = qn @ km                                                     # [H, L, nb]
            own = (np.arange(L) + Lk - L) // bs  # bottom-right: the last query at the last key
            if self.causal:  # past blocks only; the own block is a part of its own
                score = np.where(np.arange(b1 - b0) < own[:, None], score, -np.inf)
                want = min(self.top_k - 1, b1 - b0)
            else:
                want = min(self.top_k, b1 - b0)
            # best first, ties to the lower block (a stable sort keeps index order)
            order = np.argsort(-score, axis=-1, kind="stable")[..., :want]     # [H, L, want]
            valid = order < own[None, :, None] if self.causal else np.ones(order.shape, bool)
            h, t, s = np.nonzero(valid)
            picks.append((self.cu_q[n] + t, h, s, b0 + order[h, t, s]))
        cat = [np.concatenate([p[i] for p in picks]) if picks else np.zeros(0, np.int64) for i in range(4)]
        self.row, self.head, self.slot, self.block = (x.astype(np.int64) for x in cat)
        self.slots = max(self.top_k - 1, 0) if self.causal else self.top_k

    def _pack(self):
        """The pairs grouped by (head, block), queries in order: the varlen flash call's q,
        its cu_seqlens, and the key rows (row, KV head) of each group's block."""
        nb = len(self.bstart)
        group = self.head * nb + self.block
        self.order = np.lexsort((self.row, group))
        g = group[self.order]
        first = np.flatnonzero(np.concatenate(([True], g[1:] != g[:-1]))) if g.size else np.zeros(0, np.int64)
        self.pack_cu_q = np.append(first, g.size).astype(np.int64)
        gh, gb = g[first] // nb, g[first] % nb
        lens = self.bend[gb] - self.bstart[gb]
        self.pack_cu_k = np.concatenate(([0], np.cumsum(lens))).astype(np.int64)
        within = np.arange(self.pack_cu_k[-1]) - np.repeat(self.pack_cu_k[:-1], lens)
        self.krow = np.repeat(self.bstart[gb], lens) + within
        self.khead = np.repeat(gh, lens)  # query head of each packed key row
        # the own-block call: block j's keys, and the queries whose position lies in it
        self.cu_blocks = np.append(self.bstart, self.k.shape[0]).astype(np.int64)
        seq = np.repeat(np.arange(len(self.cu) - 1), np.diff(self.first_block))
        lag = (self.cu[seq + 1] - self.cu[seq]) - (self.cu_q[seq + 1] - self.cu_q[seq])
        first_query = np.clip(self.bstart - self.cu[seq] - lag, 0, self.cu_q[seq + 1] - self.cu_q[seq])
        self.cu_qblocks = np.append(self.cu_q[seq] + first_query, self.q.shape[0]).astype(np.int64)

    def packed_inputs(self):
        G = self.H // self.Hk
        q = self.q[self.row[self.order], self.head[self.order]][None, :, None, :]
        k = self.k[self.krow, self.khead // G][None, :, None, :]
        v = self.v[self.krow, self.khead // G][None, :, None, :]
        return q, k, v

    def opts(self, cu_q, cu_k, causal):
        """The flash call's options over the packed rows cu_q, cu_k."""
        return (cu_q, cu_k, _core.FORM_FLASH, causal, -1, -1, 0, None, 0.0, self.scale)


def _moba_forward(c):
    """(o [rows, H, Dv], the parts (o_p [P, rows, H, Dv], lse_p [P, rows, H]), the merge's
    weights and LSE, the packed call's inputs and outputs, the own-block call's outputs)."""
    rows, H, Dv = c.q.shape[0], c.H, c.Dv
    own = 1 if c.causal else 0
    O = np.zeros((c.slots + own, rows, H, Dv), c.q.dtype)
    L = np.full((c.slots + own, rows, H), -np.inf, c.q.dtype)
    packed = c.packed_inputs()
    po, plse = _forward(*packed, c.opts(c.pack_cu_q, c.pack_cu_k, False))
    at = (c.slot[c.order] + own, c.row[c.order], c.head[c.order])
    O[at], L[at] = po[0, :, 0], plse[0, :, 0]
    own_out = None
    if c.causal:
        own_out = _forward(c.q[None], c.k[None], c.v[None], c.opts(c.cu_qblocks, c.cu_blocks, True))
        O[0], L[0] = own_out[0][0], own_out[1][0]
    lse, w = _merge_weights(L)
    o = np.einsum("prh,prhd->rhd", w, O)
    return o, (O, L, w, lse), packed, (po, plse), own_out


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
    blocks never. ``causal=False``: the ``top_k`` best blocks of the sequence, attended
    whole. Within the chosen keys, ``o_i = sum_j softmax_j(scale q_i.k_j) v_j`` (scale
    ``Dk ** -0.5`` unless given). ``cu_seqlens`` (B = 1, Tq = Tk) packs sequences; blocks
    restart at each. Returns ``o [B, Tq, H, Dv]``. Differentiable in q, k, v through ``pyattn.vjp``; the
    choice of blocks is not differentiated.
    """
    c = _MobaCall(q, k, v, block_size, top_k, causal, scale, cu_seqlens)
    return _moba_forward(c)[0].reshape(c.shape[:3] + (c.Dv,))


def _scatter_heads(grad_rows, c, rows_of, heads_of):
    """[rows, H, D] with the packed gradient rows added at (row, head) (each pair once)."""
    out = np.zeros((c.k.shape[0], c.H, grad_rows.shape[-1]), grad_rows.dtype)
    out[rows_of, heads_of] = grad_rows
    return out


@register_vjp(moba_attention)
def _moba_attention_vjp(q, k, v, *, block_size, top_k, causal=True, scale=None, cu_seqlens=None):
    c = _MobaCall(q, k, v, block_size, top_k, causal, scale, cu_seqlens)
    o, (O, L, w, lse), packed, (po, plse), own_out = _moba_forward(c)
    G = c.H // c.Hk

    def pullback(do):
        arrs, _ = V.float_arrays("moba_attention pullback", q=c.q, do=do)
        do = arrs["do"]
        V.shape("moba_attention pullback", "do", do, c.shape[:3] + (c.Dv,), "[B, T, H, Dv]")
        do = do.reshape(o.shape)
        # the merge: o = sum_p w_p o_p, w_p = exp(lse_p - lse)
        do_p = w[..., None] * do
        dlse_p = w * np.einsum("rhd,prhd->prh", do, O - o)
        own = 1 if c.causal else 0
        at = (c.slot[c.order] + own, c.row[c.order], c.head[c.order])
        dq_pk, dk_pk, dv_pk = _backward(*packed, po, plse, do_p[at][None, :, None], dlse_p[at][None, :, None],
                                        c.opts(c.pack_cu_q, c.pack_cu_k, False))
        # a (row, head) appears once per slot: sum the slots
        dq = np.zeros((max(c.slots, 1),) + c.q.shape, c.q.dtype)
        dq[at[0] - own, at[1], at[2]] = dq_pk[0, :, 0]
        dq = dq.sum(0)
        dk = _scatter_heads(dk_pk[0, :, 0], c, c.krow, c.khead)
        dv = _scatter_heads(dv_pk[0, :, 0], c, c.krow, c.khead)
        dk = dk.reshape(-1, c.Hk, G, c.D).sum(2)
        dv = dv.reshape(-1, c.Hk, G, c.Dv).sum(2)
        if c.causal:
            gq, gk, gv = _backward(c.q[None], c.k[None], c.v[None], *own_out, do_p[0][None], dlse_p[0][None],
                                   c.opts(c.cu_qblocks, c.cu_blocks, True))
            dq += gq[0]
            dk += gk[0]
            dv += gv[0]
        B, Tq = c.shape[:2]
        return {"q": dq.reshape(B, Tq, c.H, c.D), "k": dk.reshape(B, -1, c.Hk, c.D),
                "v": dv.reshape(B, -1, c.Hk, c.Dv)}

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
    B, T = x.shape[:2]
    return (P @ x.reshape(B, T, -1)).reshape((B, P.shape[0]) + x.shape[2:])


def _linformer_call(q, k, v, E, F, scale):
    """The checked arrays, the projected k' = E k and v' = F v, and the flash call's options."""
    q, k, v, E, F, scale = _linformer_prepare(q, k, v, E, F, scale)
    kp, vp = _project(E, k), _project(F, v)
    B, Tq, S = q.shape[0], q.shape[1], E.shape[0]
    opts = (V.batch_offsets(B, Tq), V.batch_offsets(B, S), _core.FORM_FLASH, False, -1, -1, 0, None,
            0.0, scale)
    return q, k, v, E, F, kp, vp, opts


def linformer_attention(q, k, v, E, F, *, scale=None):
    """Linformer: softmax attention over S projected keys and values, ``k' = E k`` and ``v' =
    F v`` along time (``E, F [S, T]`` shared by the batch and the heads), non-causal.

    q ``[B, Tq, H, Dk]``, k ``[B, T, Hk, Dk]``, v ``[B, T, Hk, Dv]`` (GQA as
    ``softmax_attention``), one float dtype for all five arrays. ``o_i = sum_s softmax_s(scale
    q_i.k'_s) v'_s`` (scale ``Dk ** -0.5`` unless given), computed by the flash kernel over
    the S projected rows. Returns ``o [B, Tq, H, Dv]``. Differentiable in q, k, v, E and F.
    """
    q, _, _, _, _, kp, vp, opts = _linformer_call(q, k, v, E, F, scale)
    return _forward(q, kp, vp, opts)[0]


@register_vjp(linformer_attention)
def _linformer_attention_vjp(q, k, v, E, F, *, scale=None):
    q, k, v, E, F, kp, vp, opts = _linformer_call(q, k, v, E, F, scale)
    o, lse = _forward(q, kp, vp, opts)

    def pullback(do):
        arrs, _ = V.float_arrays("linformer_attention pullback", q=q, do=do)
        do = arrs["do"]
        V.shape("linformer_attention pullback", "do", do, o.shape, "[B, Tq, H, Dv]")
        dq, dkp, dvp = _backward(q, kp, vp, o, lse, do, None, opts)
        B, T = k.shape[:2]
        grads = {"q": dq}
        for name, pname, x, P, g in (("k", "E", k, E, dkp), ("v", "F", v, F, dvp)):
            g2, x2 = g.reshape(B, P.shape[0], -1), x.reshape(B, T, -1)
            grads[name] = (P.T @ g2).reshape(x.shape)
            grads[pname] = np.einsum("bsc,btc->st", g2, x2, optimize=True)
        return grads

    return o, pullback
