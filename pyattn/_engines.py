"""What the op modules share: each C engine's checked call, its forward and backward, and the
options _core's entry points take, built here once. Op modules import these from here, never
from one another's private names."""
from __future__ import annotations

import contextlib

import numpy as np

from . import _bf16, _core
from . import _validate as V
from .autodiff import split_cotangent

# ---------------------------------------------------------------------------------------------
# feature maps (pyattn.feature_maps, and linear_attention's phi)

FEATURE_MAP_KINDS = ("identity", "elu1", "relu", "softmax", "focused", "taylor", "performer", "cosformer")
_KIND_CODE = {kind: getattr(_core, "FM_" + kind.upper()) for kind in FEATURE_MAP_KINDS}
_PARAMS = {"focused": ("p",), "performer": ("projection",), "cosformer": ("max_len",)}


def feature_map_prepare(x, kind, params):
    """(x, projection, positional options of _core's feature map entry points)"""
    fn = "feature_map"
    if not isinstance(kind, str) or kind not in FEATURE_MAP_KINDS:
        raise ValueError(f"{fn}(): 'kind' must be one of {FEATURE_MAP_KINDS}, got {kind!r}")
    allowed = _PARAMS.get(kind, ())
    unknown = sorted(set(params) - set(allowed))
    if unknown:
        takes = f"only {list(allowed)}" if allowed else "no parameters"
        raise TypeError(f"{fn}(): kind {kind!r} takes {takes}, got unexpected {unknown}")
    projection = params.get("projection")
    if kind == "performer" and projection is None:
        raise ValueError(f"{fn}(): kind 'performer' needs 'projection', an array [m, D]")
    arrs, _ = V.float_arrays(fn, ("projection",), x=x, projection=projection)
    x, projection = arrs["x"], arrs["projection"]
    if kind == "cosformer":
        V.ndim(fn, "x", x, 4, "[B, T, H, D]")
    elif x.ndim < 1:
        raise ValueError(f"{fn}(): 'x' must be at least 1-D [..., D], got shape {x.shape}")
    D = x.shape[-1]
    if D < 1:
        raise ValueError(f"{fn}(): 'x' needs a feature dimension D >= 1, got shape {x.shape}")
    p = V.integer(fn, "p", params.get("p", 3), 1)
    max_len = 1.0  # read by cosformer only
    if kind == "cosformer":
        given = params.get("max_len")
        if given is None:
            # with T = 0 there is no position to place; any positive value serves
            max_len = float(max(x.shape[1], 1))
        else:
            max_len = V.real(fn, "max_len", given, 0.0)
            if max_len <= 0:
                raise ValueError(f"{fn}(): 'max_len' must be > 0, got {given!r}")
    if projection is not None:
        if projection.ndim != 2 or projection.shape[1] != D or projection.shape[0] < 1:
            raise ValueError(
                f"{fn}(): 'projection' must have shape [m, D] = [m >= 1, {D}], got {projection.shape}"
            )
    return x, projection, (_KIND_CODE[kind], p, max_len)


def _out_features(kind_code, D, projection):
    if kind_code == _core.FM_TAYLOR:
        return 1 + D + D * D
    if kind_code == _core.FM_PERFORMER:
        return projection.shape[0]
    if kind_code == _core.FM_COSFORMER:
        return 2 * D
    return D


def feature_map_forward(x, projection, opts):
    y = np.empty(x.shape[:-1] + (_out_features(opts[0], x.shape[-1], projection),), dtype=x.dtype)
    _core.feature_map_forward(x, y, *opts, projection)
    return y


def feature_map_backward(x, projection, opts, dy):
    """(dx, dprojection or None) of the call feature_map_forward(x, projection, opts) made."""
    dx = np.empty_like(x)
    dprojection = None if projection is None else np.empty_like(projection)
    _core.feature_map_backward(x, dy, dx, *opts, projection, dprojection)
    return dx, dprojection


# ---------------------------------------------------------------------------------------------
# softmax attention (pyattn.softmax, the sparse ops' flash and decode calls, pyattn.torch)

SOFTMAX_FORMS = ("parallel", "flash", "recurrent")
_SOFTMAX_FORM_CODE = {"parallel": _core.FORM_PARALLEL, "flash": _core.FORM_FLASH,
                      "recurrent": _core.FORM_RECURRENT}


def softmax_mask(scale, causal=False, window_left=-1, window_right=-1, sinks=0, alibi=None,
                 softcap=0.0):
    """The mask and score options as _core's softmax entry points take them, last and in this
    order: causal, window_left, window_right, sinks, alibi_slopes, softcap, scale. The
    defaults mask nothing."""
    return (causal, window_left, window_right, sinks, alibi, softcap, scale)


def softmax_options(cu_q, cu_k, mask, form=_core.FORM_FLASH):
    """softmax_forward's and softmax_backward's options after their arrays: the packed
    sequences' offsets, the form's code, then the mask (softmax_mask)."""
    return (cu_q, cu_k, form) + mask


def _alibi(fn, alibi, H):
    alibi = V.per_head(fn, "alibi_slopes", alibi, H)
    if alibi is not None and not np.all(np.isfinite(alibi)):
        # a NaN slope would make every score of its head NaN: a silent dead head, or NaN rows
        raise ValueError(f"{fn}(): 'alibi_slopes' must be finite, got {alibi}")
    return alibi


def _mask_checked(fn, dtype, causal, scale, Dk, window, sinks, softcap):
    """softmax_mask's arguments but alibi, checked."""
    if window is None:
        left, right = -1, -1
    else:
        left, right = V.int_pair(fn, "window", window, -1, "(left, right) or None")
    sinks = V.integer(fn, "sinks", sinks, 0)
    # beyond any sequence length a bound is no bound; keep it within int64 for the kernel
    left, right, sinks = (min(x, 2 ** 62) for x in (left, right, sinks))
    return dict(causal=V.boolean(fn, "causal", causal), window_left=left, window_right=right,
                sinks=sinks, softcap=V.real(fn, "softcap", softcap, 0.0, dtype),
                scale=V.scale(fn, scale, Dk ** -0.5, dtype))


def softmax_prepare(q, k, v, causal, scale, window, sinks, alibi_slopes, softcap, cu_seqlens,
                    cu_seqlens_q, cu_seqlens_k, form):
    """softmax_attention's arguments checked: (q, k, v, the options of softmax_forward)."""
    fn = "softmax_attention"
    arrs, dtype = V.float_arrays(fn, ("alibi_slopes",), q=q, k=k, v=v, alibi_slopes=alibi_slopes)
    q, k, v, alibi = arrs["q"], arrs["k"], arrs["v"], arrs["alibi_slopes"]
    B, Tq, H, Dk, Tk, Hk, Dv = V.attention_qkv(fn, q, k, v)
    alibi = _alibi(fn, alibi, H)
    V.form(fn, form, SOFTMAX_FORMS)
    mask = softmax_mask(alibi=alibi, **_mask_checked(fn, dtype, causal, scale, Dk, window, sinks, softcap))
    if cu_seqlens is not None:
        if cu_seqlens_q is not None or cu_seqlens_k is not None:
            raise ValueError(f"{fn}(): give either 'cu_seqlens' or 'cu_seqlens_q'/'cu_seqlens_k', not both")
        if Tq != Tk:
            raise ValueError(f"{fn}(): 'cu_seqlens' needs Tq == Tk, got Tq={Tq}, Tk={Tk}; use cu_seqlens_q/cu_seqlens_k")
        cu_q = cu_k = V.cu_seqlens(fn, "cu_seqlens", cu_seqlens, Tq, B)
    elif (cu_seqlens_q is None) != (cu_seqlens_k is None):
        raise ValueError(f"{fn}(): 'cu_seqlens_q' and 'cu_seqlens_k' must be given together")
    elif cu_seqlens_q is None:
        cu_q, cu_k = V.batch_offsets(B, Tq), V.batch_offsets(B, Tk)
    else:
        cu_q = V.cu_seqlens(fn, "cu_seqlens_q", cu_seqlens_q, Tq, B)
        cu_k = V.cu_seqlens(fn, "cu_seqlens_k", cu_seqlens_k, Tk, B)
        if len(cu_q) != len(cu_k):
            raise ValueError(f"{fn}(): cu_seqlens_q and cu_seqlens_k must have the same length, got {len(cu_q)} and {len(cu_k)}")
    return q, k, v, softmax_options(cu_q, cu_k, mask, _SOFTMAX_FORM_CODE[form])


def softmax_forward(q, k, v, opts):
    """(o, lse) of softmax attention, opts as softmax_options gives them."""
    B, Tq, H, _ = q.shape
    o = np.empty((B, Tq, H, v.shape[3]), dtype=q.dtype)
    lse = np.empty((B, Tq, H), dtype=q.dtype)
    _core.softmax_forward(q, k, v, o, lse, *opts, _bf16.products())
    return o, lse


def softmax_backward(q, k, v, o, lse, do, dlse, opts):
    """(dq, dk, dv) of the flash backward for the call softmax_forward(q, k, v, opts) made."""
    dq, dk, dv = np.empty_like(q), np.empty_like(k), np.empty_like(v)
    _core.softmax_backward(q, k, v, o, lse, do, dlse, dq, dk, dv, *opts, _bf16.products())
    return dq, dk, dv


# Up to this many queries per sequence, attention_with_kvcache reads the keys where they lie
# in the cache (the decode kernel, one pass over the cache per query); above it, a copy of the
# visible keys goes through the tiled flash kernel, whose GEMM tiles then pay for the copy.
_DECODE_MAX_QUERIES = 4
# the most parts _core.softmax_decode splits a query's keys into
_MAX_SPLITS = 1024


class KVCall:
    """An attention_with_kvcache call checked: arrays, cache geometry, key rows, options."""

    def __init__(self, q, k_cache, v_cache, cache_seqlens, k, v, causal, scale, window, sinks,
                 alibi_slopes, softcap, block_table, num_splits):
        fn = "attention_with_kvcache"
        for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
            if not isinstance(c, np.ndarray):
                raise TypeError(f"{fn}(): '{name}' must be a numpy.ndarray (new keys are written "
                                f"into it in place), got {type(c).__name__}")
        if (k is None) != (v is None):
            raise ValueError(f"{fn}(): 'k' and 'v' must be given together")
        arrs, dtype = V.float_arrays(fn, ("k", "v", "alibi_slopes"), k_cache=k_cache, v_cache=v_cache,
                                     q=q, k=k, v=v, alibi_slopes=alibi_slopes)
        q, kc, vc, kn, vn = (arrs[x] for x in ("q", "k_cache", "v_cache", "k", "v"))
        paged = block_table is not None
        cache_layout = "[num_blocks, block_size, Hk, D]" if paged else "[B, capacity, Hk, D]"
        V.ndim(fn, "q", q, 4, "[B, Tq, H, Dk]")
        V.ndim(fn, "k_cache", kc, 4, cache_layout)
        V.ndim(fn, "v_cache", vc, 4, cache_layout)
        B, Tq, H, Dk = q.shape
        A, R, Hk = kc.shape[:3]
        V.same(fn, "cache blocks" if paged else "cache batch sizes", {"k_cache": A, "v_cache": vc.shape[0]})
        V.same(fn, "cache rows", {"k_cache": R, "v_cache": vc.shape[1]})
        V.same(fn, "KV head counts", {"k_cache": Hk, "v_cache": vc.shape[2]})
        V.same(fn, "key head dims", {"q": Dk, "k_cache": kc.shape[3]})
        Dv = vc.shape[3]
        V.divides(fn, "k_cache", Hk, "heads", "q", H)
        if Dk < 1 or Dv < 1 or R < 1:
            raise ValueError(f"{fn}(): head dims and cache rows must be >= 1, got Dk={Dk}, Dv={Dv}, rows={R}")
        if paged:
            table = V.index_array(fn, "block_table", block_table, 2, "[B, max_blocks]")
            if table.shape[0] != B:
                raise ValueError(f"{fn}(): 'block_table' must have one row per sequence (B={B}), got shape {table.shape}")
            capacity = table.shape[1] * R
        else:
            V.same(fn, "batch sizes", {"q": B, "k_cache": A})
            table, capacity = None, R
        seqlens = V.index_array(fn, "cache_seqlens", cache_seqlens, 1, "[B]")
        if seqlens.shape[0] != B:
            raise ValueError(f"{fn}(): 'cache_seqlens' must have B={B} entries, got shape {seqlens.shape}")
        if np.any(seqlens < 0):
            raise ValueError(f"{fn}(): 'cache_seqlens' must be >= 0, got {seqlens.tolist()}")
        Tnew = 0
        if kn is not None:
            V.ndim(fn, "k", kn, 4, "[B, Tnew, Hk, Dk]")
            Tnew = kn.shape[1]
            V.shape(fn, "k", kn, (B, Tnew, Hk, Dk), "[B, Tnew, Hk, Dk]")
            V.shape(fn, "v", vn, (B, Tnew, Hk, Dv), "[B, Tnew, Hk, Dv]")
        # compared before adding Tnew, which could overflow int64 (cache_seqlens near 2**63)
        over = np.flatnonzero(seqlens > capacity - Tnew)
        if over.size:
            b, n = over[0], int(seqlens[over[0]])
            raise ValueError(f"{fn}(): 'cache_seqlens'[{b}] = {n} and Tnew = {Tnew}: sequence {b} "
                             f"needs {n + Tnew} cache rows, the cache holds {capacity}")
        lens = seqlens + Tnew
        if paged:
            used = np.arange(table.shape[1]) < -(-lens[:, None] // R)
            bad = used & ((table < 0) | (table >= A))
            if np.any(bad):
                b, i = np.argwhere(bad)[0]
                raise ValueError(f"{fn}(): block_table[{b}, {i}] = {table[b, i]} is outside the "
                                 f"cache's {A} blocks")
        if kn is not None:
            for name, c, a in (("k_cache", k_cache, kc), ("v_cache", v_cache, vc)):
                if a is not c or not c.flags.writeable:
                    raise ValueError(f"{fn}(): '{name}' must be a writeable, C-contiguous, aligned "
                                     f"native-order array: the new keys are written into it")
            # exact for C-contiguous arrays: each spans one interval of memory
            if np.may_share_memory(kc, vc):
                raise ValueError(f"{fn}(): 'k_cache' and 'v_cache' share memory: the new values "
                                 f"would overwrite the new keys; give two separate caches")
        elif _same_array(kc, vc):
            # harmless when only reading, but never what a caller meant (keys read as values)
            raise ValueError(f"{fn}(): 'k_cache' and 'v_cache' are the same array; give the "
                             f"keys and the values their own caches")
        # checked whatever Tq, though only the decode kernel (Tq <= _DECODE_MAX_QUERIES) splits
        self.num_splits = V.integer(fn, "num_splits", num_splits, 0, _MAX_SPLITS)
        mask = _mask_checked(fn, dtype, causal, scale, Dk, window, sinks, softcap)
        self.mask = softmax_mask(alibi=_alibi(fn, alibi_slopes, H), **mask)
        self.q, self.kc, self.vc, self.kn, self.vn = q, kc, vc, kn, vn
        self.table, self.seqlens, self.lens, self.capacity = table, seqlens, lens, capacity

    def rows(self, b, j):
        """Rows of the caches (seen as [rows, Hk, D]) holding position j of sequence b."""
        R = self.kc.shape[1]
        if self.table is None:
            return b * R + j
        return self.table[b, j // R] * R + j % R

    @contextlib.contextmanager
    def written(self):
        """The new keys and values written into rows cache_seqlens[b] .. of the caches for
        the block's duration. Every argument is checked by then; an exception inside the block
        (out of memory, an interrupt) puts the old rows back, so a failed call changes nothing."""
        if self.kn is None or self.kn.shape[1] == 0:
            yield
            return
        B, Tnew, Hk = self.kn.shape[:3]
        pos = self.seqlens[:, None] + np.arange(Tnew)
        at = self.rows(np.arange(B)[:, None], pos).ravel()
        kc = self.kc.reshape(-1, Hk, self.kc.shape[3])
        vc = self.vc.reshape(-1, Hk, self.vc.shape[3])
        old = kc[at], vc[at]
        kc[at] = self.kn.reshape(B * Tnew, Hk, -1)
        vc[at] = self.vn.reshape(B * Tnew, Hk, -1)
        try:
            yield
        except BaseException:
            kc[at], vc[at] = old
            raise

    def key_rows(self):
        """(b, j, row) of every visible key, sequence by sequence, and cu_seqlens_k of them."""
        cu_k = np.concatenate(([0], np.cumsum(self.lens)))
        b = np.repeat(np.arange(len(self.lens)), self.lens)
        j = np.arange(cu_k[-1]) - cu_k[b]
        return b, j, self.rows(b, j), cu_k

    def gathered(self, rows, cu_k):
        """q, k, v as softmax_attention's packed varlen call takes them (one sequence row of
        q per batch entry, the visible keys at ``rows`` copied out of the caches) and its
        options, offsets first."""
        B, Tq, H, Dk = self.q.shape
        Hk = self.kc.shape[2]
        k = self.kc.reshape(-1, Hk, Dk)[rows][None]
        v = self.vc.reshape(-1, Hk, self.vc.shape[3])[rows][None]
        opts = softmax_options(V.batch_offsets(B, Tq), cu_k, self.mask)
        return self.q.reshape(1, B * Tq, H, Dk), k, v, opts

    def forward(self, colsum):
        B, Tq, H, _ = self.q.shape
        if Tq > _DECODE_MAX_QUERIES and colsum is None:
            _, _, rows, cu_k = self.key_rows()
            o, lse = softmax_forward(*self.gathered(rows, cu_k))
            return o.reshape(B, Tq, H, -1), lse.reshape(B, Tq, H)
        o = np.empty((B, Tq, H, self.vc.shape[3]), dtype=self.q.dtype)
        lse = np.empty((B, Tq, H), dtype=self.q.dtype)
        start = np.zeros(B, np.int64) if self.table is not None else np.arange(B) * self.kc.shape[1]
        table = None if self.table is None else self.table.astype(np.int32)
        _core.softmax_decode(self.q, self.kc, self.vc, o, lse, V.batch_offsets(B, Tq), start,
                             start + self.lens, table, self.num_splits, colsum, *self.mask)
        return o, lse


def _same_array(a, b):
    """a and b view the same elements: one array, or two views with one start, shape and
    strides."""
    return a is b or (a.__array_interface__["data"][0] == b.__array_interface__["data"][0]
                      and a.shape == b.shape and a.strides == b.strides)


# ---------------------------------------------------------------------------------------------
# forgetting attention (pyattn.softmax.forgetting_attention: the softmax kernels with FoX's gate)

FORGETTING_FORMS = ("flash", "parallel")


def forgetting_prepare(q, k, v, g, window, scale, cu_seqlens, form):
    """forgetting_attention's arguments checked: (q, k, v, g, the options of
    _core.forgetting_forward after its arrays: cu_seqlens, form, window_left, scale)."""
    fn = "forgetting_attention"
    arrs, dtype = V.float_arrays(fn, q=q, k=k, v=v, g=g)
    q, k, v, g = arrs["q"], arrs["k"], arrs["v"], arrs["g"]
    V.ndim(fn, "q", q, 4, "[B, T, H, K]")
    V.ndim(fn, "k", k, 4, "[B, T, Hk, K]")
    V.ndim(fn, "v", v, 4, "[B, T, Hk, V]")
    B, T, H, K = q.shape
    V.same(fn, "batch sizes", {"q": B, "k": k.shape[0], "v": v.shape[0]})
    V.same(fn, "lengths", {"q": T, "k": k.shape[1], "v": v.shape[1]})
    V.same(fn, "KV head counts", {"k": k.shape[2], "v": v.shape[2]})
    V.same(fn, "key head dims", {"q": K, "k": k.shape[3]})
    V.divides(fn, "k", k.shape[2], "heads", "q", H)
    if K < 1 or v.shape[3] < 1:
        raise ValueError(f"{fn}(): head dims must be >= 1, got K={K}, V={v.shape[3]}")
    V.shape(fn, "g", g, (B, T, H), "[B, T, H]")
    V.log_gate(fn, "g", g)
    # beyond any sequence length a window is no window; keep it within int64 for the kernel
    window_left = -1 if window is None else min(V.integer(fn, "window", window, 1), 2 ** 62) - 1
    scale = V.scale(fn, scale, K ** -0.5, dtype)
    V.form(fn, form, FORGETTING_FORMS)
    cu = V.batch_offsets(B, T) if cu_seqlens is None else V.cu_seqlens(fn, "cu_seqlens", cu_seqlens, T, B)
    return q, k, v, g, (cu, _SOFTMAX_FORM_CODE[form], window_left, scale)


def forgetting_forward(q, k, v, g, opts):
    """(o, lse) of forgetting attention, opts as forgetting_prepare gives them (lse for the
    backward: the op itself returns o alone)."""
    B, T, H, _ = q.shape
    o = np.empty((B, T, H, v.shape[3]), dtype=q.dtype)
    lse = np.empty((B, T, H), dtype=q.dtype)
    _core.forgetting_forward(q, k, v, g, o, lse, *opts, _bf16.products())
    return o, lse


def forgetting_backward(q, k, v, g, o, lse, do, opts):
    """(dq, dk, dv, dg) of the flash backward for the call forgetting_forward(q, k, v, g, opts)
    made."""
    dq, dk, dv, dg = np.empty_like(q), np.empty_like(k), np.empty_like(v), np.empty_like(g)
    _core.forgetting_backward(q, k, v, g, o, lse, do, dq, dk, dv, dg, *opts, _bf16.products())
    return dq, dk, dv, dg


# ---------------------------------------------------------------------------------------------
# the gated linear engine (pyattn.linear; pyattn.delta's engine runs on its checked call)

LINEAR_FORMS = ("chunk", "parallel", "recurrent")
_LINEAR_FORM_CODE = {"chunk": _core.FORM_CHUNK, "parallel": _core.FORM_PARALLEL,
                     "recurrent": _core.FORM_RECURRENT}


def sequences(fn, B, T, cu_seqlens):
    """(int64 offsets of the packed rows, number of sequences N)"""
    if cu_seqlens is None:
        return V.batch_offsets(B, T), B
    cu = V.cu_seqlens(fn, "cu_seqlens", cu_seqlens, T, B)
    return cu, len(cu) - 1


class LinearEngine:
    """One call of the engine: checked inputs, the forward, and the C backward."""

    def __init__(self, fn, q, k, v, gk, gv, h0, want_state, cu, N, form, chunk_size, scale,
                 beta=None, skip=None):
        """beta [B, T, H] scales v's rows (v_t becomes beta_t v_t; no value gate with it) and
        skip [H] adds skip_h v_t to o_t: Mamba-2's x dt and D x, done where the kernel reads
        the rows rather than in new arrays."""
        V.form(fn, form, LINEAR_FORMS)
        V.chunk_size(fn, chunk_size)
        K = q.shape[3]
        H, Vd = v.shape[2:]  # q and k may have fewer heads (groups), v has every head's
        V.shape(fn, "initial_state", h0, (N, H, K, Vd), "[N, H, K, V]")
        self.fn, self.q, self.k, self.v, self.gk, self.gv, self.h0 = fn, q, k, v, gk, gv, h0
        self.want_state, self.N = want_state, N
        self.opts = (cu, _LINEAR_FORM_CODE[form], int(chunk_size), float(scale))
        self.beta, self.skip = beta, skip
        # a bf16 call's values: the linear and delta engines' chunk forms may multiply in bf16
        self.bf16 = _bf16.products()
        self.o = self.ht = self.states = None

    def products(self, keep):
        """Whether this forward multiplies in bf16: a bf16 call's, unless a pullback follows
        (keep). The backward multiplies in float32, and a forward multiplying in bf16 under
        it stalled training: MQAR bf16 runs of RetNet and GLA ended at 0.07 and 0.08 accuracy
        with it, 0.89 and 0.20 without, on the same machine and seed (docs/bf16.md)."""
        return self.bf16 and not keep

    def forward(self, keep=False):
        """(o, final state or None). keep: a pullback follows, so the chunk form keeps the
        state entering each chunk for the backward (about T / chunk_size states per head)."""
        q, v = self.q, self.v
        self.o = np.empty(v.shape, dtype=q.dtype)
        self.ht = np.empty((self.N, v.shape[2], q.shape[3], v.shape[3]), dtype=q.dtype) if self.want_state else None
        self.states = _core.linear_forward(q, self.k, v, self.gk, self.gv, self.h0, self.o, self.ht,
                                           keep, *self.opts, self.beta, self.skip,
                                           self.products(keep))
        return self.o, self.ht

    def entering_states(self):
        """The state entering each chunk of every sequence, from a chunk forward that kept them
        (keep): ``[B, NT, H, K, V]``, NT = ceil(T / chunk_size); with cu_seqlens ``[1, every
        sequence's chunks in order, H, K, V]``. The kernel keeps them per (sequence, head), each
        sequence's heads in turn, ceil(T_n / chunk_size) + 1 states apiece (the last: the end)."""
        cu, _, L, _ = self.opts
        H, K, Vd = self.v.shape[2], self.q.shape[3], self.v.shape[3]
        nt = (np.diff(cu) + L - 1) // L
        first = np.cumsum(H * (nt + 1)) - H * (nt + 1)
        seq = np.repeat(np.arange(len(nt)), nt)
        chunk = np.arange(nt.sum()) - np.repeat(np.cumsum(nt) - nt, nt)
        slots = first[seq, None] + np.arange(H) * (nt[seq, None] + 1) + chunk[:, None]
        return self.states.reshape(-1, K, Vd)[slots].reshape(self.q.shape[0], -1, H, K, Vd)

    def cotangent(self, cot):
        """(do, dht) checked against the forward's outputs; None entries mean zero."""
        fn = self.fn
        do, dht = split_cotangent(fn, cot, 2)
        if dht is not None and not self.want_state:
            raise ValueError(f"{fn} pullback: got a cotangent for the final state, but output_final_state=False")
        arrs, _ = V.float_arrays(f"{fn} pullback", ("do", "dht"), q=self.q, do=do, dht=dht)
        do, dht = arrs["do"], arrs["dht"]
        if do is None:
            do = np.zeros_like(self.o)
        if do.shape != self.o.shape:
            raise ValueError(f"{fn} pullback: 'do' must have shape {self.o.shape}, got {do.shape}")
        if dht is not None and dht.shape != self.ht.shape:
            raise ValueError(f"{fn} pullback: the final state's cotangent must have shape {self.ht.shape}, got {dht.shape}")
        return do, dht

    def backward(self, do, dht):
        """{q, k, v, gk, gv, h0, beta, skip: gradient} for the engine's own inputs (gk, gv, h0,
        beta when given; skip: the rows' terms do_t . v_t [B, T, H], for the caller to sum)."""
        g = {"q": np.empty_like(self.q), "k": np.empty_like(self.k), "v": np.empty_like(self.v)}
        for name in ("gk", "gv", "h0", "beta"):
            x = getattr(self, name)
            g[name] = None if x is None else np.empty_like(x)
        g["skip"] = None if self.skip is None else np.empty(self.v.shape[:3], dtype=self.v.dtype)
        _core.linear_backward(self.q, self.k, self.v, self.gk, self.gv, self.h0, do, dht, self.states,
                              g["q"], g["k"], g["v"], g["gk"], g["gv"], g["h0"], *self.opts,
                              self.beta, self.skip, g["beta"], g["skip"])
        return g


def engine_qkv(fn, q, k, v, optional=(), groups=False, **more):
    """float arrays of one dtype; q, k [B, T, H, K] and v [B, T, H, V] checked; with groups v
    is [B, T, HV, V], HV a multiple of H (value head h reads q and k head h // (HV // H))."""
    arrs, dtype = V.float_arrays(fn, ("initial_state",) + tuple(optional), q=q, k=k, v=v, **more)
    q, k, v = arrs["q"], arrs["k"], arrs["v"]
    V.ndim(fn, "q", q, 4, "[B, T, H, K]")
    V.ndim(fn, "k", k, 4, "[B, T, H, K]")
    V.ndim(fn, "v", v, 4, "[B, T, HV, V]" if groups else "[B, T, H, V]")
    if k.shape != q.shape:
        raise ValueError(f"{fn}(): 'k' must have the shape of q {q.shape}, got {k.shape}")
    if groups:
        if v.shape[:2] != q.shape[:2]:
            raise ValueError(f"{fn}(): 'v' must be [B, T, HV, V] = {q.shape[:2] + ('HV', 'V')}, got {v.shape}")
        V.divides(fn, "q", q.shape[2], "heads", "v", v.shape[2], "H", "HV")
    elif v.shape[:3] != q.shape[:3]:
        raise ValueError(f"{fn}(): 'v' must be [B, T, H, V] = {q.shape[:3] + ('V',)}, got {v.shape}")
    if q.shape[3] < 1 or v.shape[3] < 1:
        raise ValueError(f"{fn}(): head dims must be >= 1, got K={q.shape[3]}, V={v.shape[3]}")
    return arrs, dtype
