"""Float64 NumPy oracles: the most literal form of each formula in DESIGN section 4.

Slow on purpose and independent of the kernels: no shared code, no tiling, no online
softmax. Every function takes the public op's arguments and returns float64 results with the
op's output structure.
"""
from __future__ import annotations

import numpy as np


def softmax_attention(q, k, v, *, causal=False, scale=None, window=None, sinks=0,
                      alibi_slopes=None, softcap=0.0, cu_seqlens=None, cu_seqlens_q=None,
                      cu_seqlens_k=None, form=None, return_lse=False):
    """Loop over (sequence, head, query): visible keys by the definition, then softmax."""
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    B, Tq, H, Dk = q.shape
    Tk, Hk, Dv = k.shape[1], k.shape[2], v.shape[3]
    scale = Dk ** -0.5 if scale is None else scale
    left, right = (-1, -1) if window is None else window
    if cu_seqlens is not None:
        cu_seqlens_q = cu_seqlens_k = cu_seqlens
    if cu_seqlens_q is None:
        seqs = [(b, 0, Tq, 0, Tk) for b in range(B)]
    else:
        cq, ck = np.asarray(cu_seqlens_q), np.asarray(cu_seqlens_k)
        seqs = [(0, cq[n], cq[n + 1], ck[n], ck[n + 1]) for n in range(len(cq) - 1)]
    o = np.zeros((B, Tq, H, Dv))
    lse = np.full((B, Tq, H), -np.inf)
    for b, qs, qe, ks, ke in seqs:
        tq, tk = qe - qs, ke - ks
        for h in range(H):
            kh = h // (H // Hk)
            for i in range(tq):
                ip = i + tk - tq
                scores, values = [], []
                for j in range(tk):
                    visible = not causal or j <= ip
                    in_window = (left < 0 or j >= ip - left) and (right < 0 or j <= ip + right)
                    if not (visible and (in_window or j < sinks)):
                        continue
                    s = scale * np.dot(q[b, qs + i, h], k[b, ks + j, kh])
                    if softcap > 0:
                        s = softcap * np.tanh(s / softcap)
                    if alibi_slopes is not None:
                        s -= float(alibi_slopes[h]) * abs(ip - j)
                    scores.append(s)
                    values.append(v[b, ks + j, kh])
                if not scores:
                    continue
                s = np.array(scores)
                m = s.max()
                p = np.exp(s - m)
                o[b, qs + i, h] = p @ np.array(values) / p.sum()
                lse[b, qs + i, h] = m + np.log(p.sum())
    return (o, lse) if return_lse else o
