"""Type stubs of pyattn._core, the C extension. Every entry point takes positional arguments
only and checks every buffer (dtype, C-contiguity, shape, writeability) before running; use
the pyattn package, whose wrappers validate, fill defaults and allocate the outputs."""
from typing import Any, Optional, TypedDict

import numpy as np
import numpy.typing as npt

FORM_PARALLEL: int
FORM_FLASH: int
FORM_RECURRENT: int
FORM_CHUNK: int
FM_IDENTITY: int
FM_ELU1: int
FM_RELU: int
FM_SOFTMAX: int
FM_FOCUSED: int
FM_TAYLOR: int
FM_PERFORMER: int
FM_COSFORMER: int
# NumPy "mem_handler" capsule of the cache of large blocks (pyattn.nn.cached_arrays)
ARRAY_CACHE: Any

_Float = npt.NDArray[np.floating]
_Int64 = npt.NDArray[np.int64]
_F32 = npt.NDArray[np.float32]

class _BuildInfo(TypedDict):
    isa: str
    isas_available: list[str]
    compiler: str
    openmp: bool
    num_threads: int

def softmax_forward(
    q: _Float, k: _Float, v: _Float, o: _Float, lse: _Float,
    cu_q: _Int64, cu_k: _Int64, form: int, causal: bool,
    window_left: int, window_right: int, sinks: int,
    alibi_slopes: Optional[_Float], softcap: float, scale: float, bf16: bool, /,
) -> None:
    """Writes o [B, Tq, H, Dv] and lse [B, Tq, H] in place. bf16: q, k, v (float32) hold
    bfloat16 values, and the flash and parallel forms may multiply in bf16 (rounding the
    softmax's probabilities to bf16) where the CPU has AVX512-BF16 or AMX (build_info's isa
    amx or avx512_bf16); a call with a non-finite input computes in float."""

def forgetting_forward(
    q: _Float, k: _Float, v: _Float, g: _Float, o: _Float, lse: _Float,
    cu_seqlens: _Int64, form: int, window_left: int, scale: float, bf16: bool, /,
) -> None:
    """Writes o [B, T, H, Dv] and lse [B, T, H] in place: causal softmax attention with the
    scores biased by G_i - G_j, G the running sum of g [B, T, H] per sequence (FORM_FLASH or
    FORM_PARALLEL). bf16 as softmax_forward's."""

def softmax_decode(
    q: _Float, k: _Float, v: _Float, o: _Float, lse: _Float, cu_q: _Int64,
    start: _Int64, end: _Int64, block_table: Optional[npt.NDArray[np.int32]], num_splits: int,
    colsum: Optional[_Float], causal: bool, window_left: int, window_right: int, sinks: int,
    alibi_slopes: Optional[_Float], softcap: float, scale: float, /,
) -> None:
    """Few queries (q [B, Tq, H, Dk] placed by cu_q) against keys in place: sequence n's key j
    at row start[n] + j of k [A, R, Hk, Dk] / v [A, R, Hk, Dv] seen as A R rows, or with
    block_table [N, max_blocks] at row j % R of block block_table[n, j // R]. Writes o and
    lse in place; adds the attention probabilities into colsum [N, H, L] when given."""

def softmax_decode_backward(
    q: _Float, k: _Float, v: _Float, o: _Float, lse: _Float, do: _Float,
    dlse: Optional[_Float], dq: _Float, dk: _Float, dv: _Float, cu_q: _Int64,
    start: _Int64, end: _Int64, block_table: Optional[npt.NDArray[np.int32]], causal: bool,
    window_left: int, window_right: int, sinks: int, alibi_slopes: Optional[_Float],
    softcap: float, scale: float, /,
) -> None:
    """The backward of softmax_decode over the same keys (no softcap or ALiBi): writes dq, and
    dk, dv shaped as k, v (every row; the rows no query reads get 0)."""

def dsa_select(
    index_q: _Float, index_k: _Float, index_w: _Float, cu_q: _Int64, cu_k: _Int64, top_k: int,
    causal: bool, rows: npt.NDArray[np.int32], count: _Int64, nan: npt.NDArray[np.uint8], /,
) -> None:
    """DeepSeek sparse attention's selection: index_q [Rq, Hi, Di], index_k [Rk, Di], index_w
    [Rq, Hi] by sequences cu_q, cu_k (queries bottom-right); writes each query's top_k
    visible key rows (ascending, -1 after the last) into rows [Rq, top_k], their number into
    count [Rq], and 1 into nan [Rq] where a visible score is NaN."""

def dsa_index_loss(
    q: _Float, k: _Float, index_q: _Float, index_k: _Float, index_w: _Float,
    rows: npt.NDArray[np.int32], count: _Int64, scale: float, grad_scale: float, loss: _Float,
    d_index_q: _Float, d_index_k: _Float, d_index_w: _Float, /,
) -> None:
    """DeepSeek sparse attention's indexer loss over the key rows dsa_select chose (rows,
    count): q [Rq, H, D], k [Rk, Hk, D], index_q [Rq, Hi, Di], index_k [Rk, Di], index_w
    [Rq, Hi]; writes each query's KL(P || softmax(I)) into loss [Rq] and the gradients of
    grad_scale * sum(loss) in the index arrays (P, the main attention's target, constant)."""

def moba_select(
    q: _Float, kmean: _Float, cu_q: _Int64, cu_k: _Int64, block_size: int, causal: bool,
    slots: int, choice: npt.NDArray[np.int32], /,
) -> None:
    """MoBA's choice: per (query, head) of q [Rq, H, Dk], the `slots` blocks of its sequence
    (cu_q, cu_k; block_size keys each) whose means kmean [nblocks, Hk, Dk] score highest
    against it, best first, ties to the lower block (causal: past blocks only), -1 after
    them, into choice int32 [Rq, H, max(slots, 1)]."""

def moba_forward(
    q: _Float, k: _Float, v: _Float, choice: npt.NDArray[np.int32], cu_q: _Int64, cu_k: _Int64,
    block_size: int, causal: bool, scale: float, o: _Float, lse: _Float, /,
) -> None:
    """Each (query, head) of q [Rq, H, Dk] attends to the whole key blocks (of block_size rows
    of its sequence: cu_q, cu_k) listed in choice int32 [Rq, H, slots] (-1: none) of k [Rk, Hk,
    Dk], v [Rk, Hk, Dv], and, when causal, to its own block up to its position (the queries
    are the last of their sequence's keys; the choices then lie before the own block);
    writes o [Rq, H, Dv] and lse [Rq, H] (0 and -inf where none)."""

def moba_backward(
    q: _Float, k: _Float, v: _Float, o: _Float, lse: _Float, do: _Float, dlse: Optional[_Float],
    choice: npt.NDArray[np.int32], cu_q: _Int64, cu_k: _Int64, block_size: int, causal: bool,
    scale: float, dq: _Float, dk: _Float, dv: _Float, /,
) -> None:
    """The backward of moba_forward: writes dq, dk, dv (keys no query chose get 0)."""

def softmax_backward(
    q: _Float, k: _Float, v: _Float, o: _Float, lse: _Float, do: _Float,
    dlse: Optional[_Float], dq: _Float, dk: _Float, dv: _Float,
    cu_q: _Int64, cu_k: _Int64, form: int, causal: bool,
    window_left: int, window_right: int, sinks: int,
    alibi_slopes: Optional[_Float], softcap: float, scale: float, bf16: bool, /,
) -> None:
    """Writes dq, dk, dv in place from the forward's o and lse. bf16: as softmax_forward's
    (the probabilities and dS are then rounded to bf16 for their products)."""

def forgetting_backward(
    q: _Float, k: _Float, v: _Float, g: _Float, o: _Float, lse: _Float, do: _Float,
    dq: _Float, dk: _Float, dv: _Float, dg: _Float,
    cu_seqlens: _Int64, form: int, window_left: int, scale: float, bf16: bool, /,
) -> None:
    """Writes dq, dk, dv, dg in place from forgetting_forward's o and lse. bf16 as
    softmax_forward's."""

def feature_map_forward(
    x: _Float, y: _Float, kind: int, p: int, max_len: float,
    projection: Optional[_Float], /,
) -> None:
    """Writes y = phi(x) [..., F] in place. x [..., D] (at least 1-D; [B, T, H, D] for
    FM_COSFORMER); kind one of the FM_* constants; F = D, except 1 + D + D*D (FM_TAYLOR), m
    (FM_PERFORMER) and 2 D (FM_COSFORMER). p (int >= 1, the power of FM_FOCUSED) and max_len
    (float > 0, FM_COSFORMER) are checked for every kind; projection is W [m, D] for
    FM_PERFORMER and None for the other kinds."""

def feature_map_backward(
    x: _Float, dy: _Float, dx: _Float, kind: int, p: int, max_len: float,
    projection: Optional[_Float], dprojection: Optional[_Float], /,
) -> None:
    """Writes dx [..., D] from dy [..., F] in place, and for FM_PERFORMER dprojection [m, D]
    (overwritten, not accumulated; None for the other kinds). Arguments as
    feature_map_forward."""

def linear_forward(
    q: _Float, k: _Float, v: _Float, gk: Optional[_Float], gv: Optional[_Float],
    h0: Optional[_Float], o: _Float, ht: Optional[_Float], keep: bool,
    cu: _Int64, form: int, chunk: int, scale: float, beta: Optional[_Float],
    skip: Optional[_Float], bf16: bool, /,
) -> Optional[_Float]:
    """The gated linear engine: writes o [B, T, H, V] and, when given, ht [N, H, K, V] in
    place. q, k [B, T, Hqk, K] with H a multiple of Hqk (head h reads q and k head
    h // (H // Hqk), Mamba-2's groups); v [B, T, H, V]; gk None (no key gate), [B, T, H]
    (scalar) or [B, T, H, K] (vector); gv None or [B, T, H, V]; h0 None or [N, H, K, V];
    cu the int64 sequence offsets [N + 1] over the B*T rows; form FORM_PARALLEL, FORM_RECURRENT or
    FORM_CHUNK. With keep true and FORM_CHUNK returns the states the backward can reuse (a
    new [count, K, V] array: per (sequence, head) the state entering each chunk, then the
    final one); else None. beta None or [B, T, H] (only with gv None): the engine reads v_t
    as beta_t v_t; skip None or [H]: o_t gets skip_h v_t added (Mamba-2's x dt and D x).
    bf16 true says the float32 inputs hold bfloat16 values: the chunk form then multiplies in
    bf16 (float32 accumulation) where the CPU has bf16 products; ignored for float64. The
    backward multiplies in float32 whatever the forward did."""

def linear_backward(
    q: _Float, k: _Float, v: _Float, gk: Optional[_Float], gv: Optional[_Float],
    h0: Optional[_Float], do: _Float, dht: Optional[_Float],
    states: Optional[_Float], dq: _Float, dk: _Float, dv: _Float, dgk: Optional[_Float],
    dgv: Optional[_Float], dh0: Optional[_Float], cu: _Int64, form: int, chunk: int,
    scale: float, beta: Optional[_Float], skip: Optional[_Float], dbeta: Optional[_Float],
    dskip: Optional[_Float], /,
) -> None:
    """Writes dq, dk, dv (and dgk, dgv, dh0, dbeta, dskip when given; dgk, dgv, dbeta and
    dskip must be None exactly when gk, gv, beta and skip are) in place. dv is the gradient
    of v itself (beta and skip included); dbeta [B, T, H]; dskip [B, T, H] holds each row's
    do_t . v_t, which summed over rows is skip's gradient. dht None means a zero cotangent; states what linear_forward kept
    (FORM_CHUNK), or None to recompute them. dq and dk have q's and k's shapes: with groups,
    the sums over each group's heads. Other arguments as linear_forward."""

def delta_forward(
    q: _Float, k: _Float, v: _Float, g: Optional[_Float], beta: _Float, h0: Optional[_Float],
    o: _Float, ht: Optional[_Float], keep: bool, cu: _Int64, form: int, chunk: int,
    scale: float, bf16: bool, /,
) -> Optional[_Float]:
    """The delta-rule engine: writes o [B, T, H, V] and, when given, ht [N, H, K, V] in place;
    returns the states kept for delta_backward (keep true and FORM_CHUNK, as linear_forward's),
    else None.
    q, k [B, T, Hqk, K]; v [B, T, H, V] with H a multiple of Hqk (value head h reads q and k
    head h // (H // Hqk)); g None (DeltaNet), [B, T, H] (a log decay per step: Gated DeltaNet)
    or [B, T, H, K] (one per key channel: KDA); beta [B, T, H]; h0 None or [N, H, K, V]; cu the
    int64 sequence offsets [N + 1]; form FORM_PARALLEL, FORM_RECURRENT or FORM_CHUNK; chunk the
    chunk form's rows per block; bf16 as linear_forward's."""

def delta_backward(
    q: _Float, k: _Float, v: _Float, g: Optional[_Float], beta: _Float, h0: Optional[_Float],
    do: _Float, dht: Optional[_Float], states: Optional[_Float], dq: _Float, dk: _Float, dv: _Float,
    dg: Optional[_Float], dbeta: _Float, dh0: Optional[_Float], cu: _Int64, form: int,
    chunk: int, scale: float, /,
) -> None:
    """Writes dq, dk, dv, dbeta (and dg, dh0 when given; dg must be None exactly when g is,
    and of g's shape) in place. dht None means a zero cotangent; states what delta_forward kept
    (FORM_CHUNK), or None to recompute them. dq and dk have q's and k's shapes: with groups,
    the sums over each group's heads. Other arguments as delta_forward."""

def dplr_forward(
    q: _Float, k: _Float, v: _Float, a: _Float, b: _Float, gk: _Float, h0: Optional[_Float],
    o: _Float, ht: Optional[_Float], keep: bool, cu: _Int64, form: int, chunk: int,
    scale: float, bf16: bool, /,
) -> Optional[_Float]:
    """The DPLR delta rule: writes o [B, T, H, V] and, when given, ht [N, H, K, V] in place.
    q, k, a, b, gk [B, T, H, K] (gk the log decay per key channel); v [B, T, H, V]; h0 None or
    [N, H, K, V]; cu the int64 sequence offsets [N + 1]; form FORM_RECURRENT or FORM_CHUNK;
    bf16 as linear_forward's. With keep and FORM_CHUNK, returns the states kept for
    dplr_backward (as linear_forward's); otherwise None."""

def dplr_backward(
    q: _Float, k: _Float, v: _Float, a: _Float, b: _Float, gk: _Float, h0: Optional[_Float],
    do: _Float, dht: Optional[_Float], states: Optional[_Float], dq: _Float, dk: _Float,
    dv: _Float, da: _Float, db: _Float, dgk: _Float, dh0: Optional[_Float], cu: _Int64,
    form: int, chunk: int, scale: float, /,
) -> None:
    """Writes dq, dk, dv, da, db, dgk (and dh0 when given) in place. dht None means a zero
    cotangent; states what dplr_forward kept (FORM_CHUNK), or None to recompute them. Other
    arguments as dplr_forward."""

def loglin_forward(
    q: _Float, k: _Float, v: _Float, g: _Float, level_scales: _Float, h0: Optional[_Float],
    o: _Float, ht: Optional[_Float], cu: _Int64, start: Optional[_Int64], form: int, chunk: int,
    scale: float, /,
) -> None:
    """Log-linear attention: writes o [B, T, H, V] and, when given, ht [N, H, L, K, V] in place
    (level 0 of ht: the next position at [0, 0]). q, k [B, T, H, K]; v [B, T, H, V]; g [B, T, H];
    level_scales [B, T, H, L]; h0 None or [N, H, L, K, V] (its level 0 unread); start None or
    the int64 position [N] each sequence resumes at; form FORM_CHUNK (chunk a power of two),
    FORM_RECURRENT or FORM_PARALLEL."""

def loglin_backward(
    q: _Float, k: _Float, v: _Float, g: _Float, level_scales: _Float, h0: Optional[_Float],
    do: _Float, dht: Optional[_Float], dq: _Float, dk: _Float, dv: _Float, dg: _Float,
    dlevel_scales: _Float, dh0: Optional[_Float], cu: _Int64, start: Optional[_Int64], form: int,
    chunk: int, scale: float, /,
) -> None:
    """Writes dq, dk, dv, dg, dlevel_scales (and dh0 when given, 0 on its level 0) in place.
    dht None means a zero cotangent. Other arguments as loglin_forward."""

def efficient_forward(q: _Float, k: _Float, v: _Float, o: _Float, cu_q: _Int64,
                      cu_k: _Int64, scale: float, /) -> None:
    """Efficient attention: writes o [B, Tq, H, V] in place; q [B, Tq, H, K], k [B, Tk, H, K],
    v [B, Tk, H, V]; cu_q, cu_k int64 sequence offsets."""

def efficient_backward(q: _Float, k: _Float, v: _Float, do: _Float, dq: _Float, dk: _Float,
                       dv: _Float, cu_q: _Int64, cu_k: _Int64, scale: float, /) -> None:
    """Writes dq, dk, dv in place. Arguments as efficient_forward."""

def gemm(a: _Float, b: _Float, c: _Float, trans_a: bool, trans_b: bool,
         alpha: float, beta: float, /) -> None:
    """c = alpha op(a) op(b) + beta c with the packed GEMM of the kernels (beta == 0: c is
    not read), on pyattn's threads (the same bits at any thread count)."""

def gemm_bf16(a: _F32, b: _F32, c: _F32, trans_a: bool, trans_b: bool,
              alpha: float, beta: float, /) -> None:
    """gemm of float32 arrays with a and b rounded to bf16 (to nearest, ties to even) and
    multiplied on the CPU's bf16 instructions (AVX512-BF16 or AMX-BF16), accumulating in
    float32; beta 0 or 1 (0: c is not read); the same bits at any thread count. A RuntimeError
    where the CPU (or PYATTN_ISA) gives no bf16 products."""

# pyattn.nn's pointwise kernels: one float dtype per call, C-contiguous arrays, outputs
# written in place and not overlapping the inputs.

def silu(x: _Float, mul: Optional[_Float], y: Optional[_Float], s: _Float, /) -> None:
    """s = sigmoid(x) and, unless y is None, y = x s (pyattn.nn's SiLU), times mul unless mul
    is None (SwiGLU's product silu(a) b); any shape."""

def silu_backward(dy: _Float, y: _Float, s: _Float, dx: _Float, /) -> None:
    """dx = dy (s + y (1 - s)) from y = silu(x), s = sigmoid(x); any shape."""

def swiglu_backward(dh: _Float, a: _Float, b: _Float, s: _Float, da: _Float, db: _Float, /) -> None:
    """da = dh b silu'(a), db = dh silu(a); any shape."""

def adamw_step(g: _Float, p: _Float, m: _Float, v: _Float, b1: float, b2: float, eps: float,
               decay: float, lr_c1: float, c2: float, /) -> None:
    """One AdamW step of p, m, v (any shape, g's) in place: m = b1 m + (1 - b1) g,
    v = b2 v + (1 - b2) g^2, p = decay p - lr_c1 m / (sqrt(v / c2) + eps)."""

def rms_norm(x: _Float, eps: float, xhat: _Float, rstd: _Float, mean: bool, /) -> None:
    """Rows of x [rows, d]: rstd [rows] = 1 / sqrt(mean(x^2) + eps), xhat = x rstd; with
    mean False the sum of x^2 instead (an L2 norm)."""

def rms_norm_backward(dxhat: _Float, xhat: _Float, rstd: _Float, dx: _Float, mean: bool, /) -> None:
    """dx = (dxhat - xhat mean(dxhat xhat)) rstd, row by row ([rows, d]); the sum for mean
    False."""

def rotary(x: _Float, cos: _Float, sin: _Float, sign: int, y: _Float, /) -> None:
    """Rotary embedding (half-split pairs) of x [rows, H, D] into y by the tables cos, sin
    [n, D] of pyattn.rope (row r uses table row r % n; rows a multiple of n); sign -1 rotates
    by the opposite angles (the backward)."""

def short_conv(x: _Float, state: Optional[_Float], w: _Float, bias: Optional[_Float],
               y: _Float, s: _Float, /) -> None:
    """Causal depthwise convolution of x [B, T, C] with w [K, C] (taps as rows), after state
    [B, K-1, C] (None: zeros), plus bias [C] (None: none), then SiLU: y = silu(u), s =
    sigmoid(u)."""

def short_conv_backward(x: _Float, state: Optional[_Float], w: _Float, bias: Optional[_Float],
                        dy: _Float, y: _Float, s: _Float, dx: _Float, dw: _Float,
                        dbias: Optional[_Float], /) -> None:
    """The backward of short_conv: dx, dw [K, C] and dbias [C] (None: not wanted) overwritten;
    the state's gradient is not formed."""

def exp(x: _Float, out: _Float, /) -> None:
    """out = exp(x) with the kernels' vectorised exp (1-D arrays)."""

def exp_nonpos(x: _Float, out: _Float, /) -> None:
    """out = exp(x) with the softmax kernels' exp, for x <= 0 (correct up to 88.37 in float,
    709.43 in double; undefined above): exactly 0 for x below -87.6 (-708.7), where 2^n
    would be subnormal; a subnormal rounded once between there and the least normal
    result (1-D arrays)."""

def fma_peak(double: bool, seconds: float, threads: int, /) -> float:
    """GFLOP/s of independent FMA chains on `threads` threads: the machine's FMA peak."""

def read_bandwidth(seconds: float, threads: int, bytes: int, /) -> float:
    """GB/s reading a buffer of `bytes` on `threads` threads: the machine's read bandwidth."""

def bf16_convert(src: npt.NDArray[np.uint16] | npt.NDArray[np.float32],
                 dst: npt.NDArray[np.float32] | npt.NDArray[np.uint16], /) -> None:
    """uint16 src (bfloat16 bits) into float32 dst, exactly; or float32 src into uint16 dst,
    rounded to nearest, ties to even, NaN staying NaN (1-D arrays of one length)."""

def set_num_threads(n: int, /) -> None: ...
def get_num_threads() -> int: ...
def build_info() -> _BuildInfo: ...
def set_data_handler(handler: Any, /) -> Any:
    """NumPy's data-memory handler for the current context (ARRAY_CACHE, or None for NumPy's
    default); returns the previous one."""
def array_cache_release() -> int: ...
def array_cache_kept() -> int: ...
