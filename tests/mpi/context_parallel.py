"""Per-rank script: context_parallel of every supported op against one process on the whole
sequence (outputs, final state, every gradient), float64 and float32, every form, with and
without an initial state, unequal slices; bad
input raises the same error on every rank; the torch wrapper where torch imports."""
import numpy as np
from mpi4py import MPI

import pyattn
from pyattn.distributed import context_parallel

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()

# positional indices of each op's per-token arrays (time on axis 1), and per-token keywords
PER_TOKEN = {"simple_gla": (0, 1, 2, 3), "gla": (0, 1, 2, 3), "retention": (0, 1, 2),
             "mamba2": (0, 1, 3, 4), "delta_rule": (0, 1, 2, 3), "gated_delta_rule": (0, 1, 2, 3, 4),
             "kda": (0, 1, 2, 3, 4)}
PER_TOKEN_KW = ("gv",)
TOL = {np.float64: 1e-12, np.float32: 1e-5}


def bounds(T, empty_first=False):
    """Unequal contiguous slices: rank r gets a share proportional to r + 1 (to r with
    empty_first: rank 0 holds no position)."""
    w = np.arange(0 if empty_first else 1, size + (0 if empty_first else 1))
    cuts = np.concatenate([[0], np.round(np.cumsum(w) / w.sum() * T).astype(int)])
    return cuts[rank], cuts[rank + 1]


def fail(message):
    """Report and end the whole job (the other ranks may be waiting in a collective)."""
    print(f"FAIL rank {rank}: {message}", flush=True)
    comm.Abort(1)


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if a.size == 0 and b.size == 0:
        return 0.0
    return np.sqrt(np.mean((a - b) ** 2)) / max(np.sqrt(np.mean(b ** 2)), 1e-300)


def check(what, got, want, tol):
    err = rel(got, want)
    if not err <= tol:
        fail(f"{what}: relative error {err:.3g} > {tol:g}")
    return err


def case(name, dtype, with_initial_state, chunk_size=16, form="chunk", empty_first=False):
    info = pyattn.OPS[name]
    rng = np.random.default_rng(7)
    args, kw = info.example(rng, dtype)
    kw = dict(kw, chunk_size=chunk_size, form=form)
    if not with_initial_state:
        kw.pop("initial_state")
    (o, ht), pull = pyattn.vjp(info.fn, *args, **kw)
    do = rng.standard_normal(o.shape).astype(dtype)
    dht = rng.standard_normal(ht.shape).astype(dtype)
    want = pull((do, dht))
    # the final state's cotangent is split over the ranks (their sum is what counts)
    dht_parts = [rng.standard_normal(ht.shape).astype(dtype) for _ in range(size - 1)]
    dht_parts.append(dht - sum(dht_parts, np.zeros_like(dht)))

    lo, hi = bounds(o.shape[1], empty_first)
    cut = lambda x: np.ascontiguousarray(x[:, lo:hi])
    my_args = [cut(a) if i in PER_TOKEN[name] else a for i, a in enumerate(args)]
    my_kw = {key: cut(val) if key in PER_TOKEN_KW else val for key, val in kw.items()}
    (o_r, ht_r), pull_r = pyattn.vjp(context_parallel, info.fn, *my_args, comm=comm, **my_kw)
    tol = TOL[dtype]
    worst = max(check(f"{name} o", o_r, o[:, lo:hi], tol), check(f"{name} final state", ht_r, ht, tol))
    o_plain, ht_plain = context_parallel(info.fn, *my_args, comm=comm, **my_kw)
    if not (np.array_equal(o_plain, o_r) and np.array_equal(ht_plain, ht_r)):
        fail(f"{name}: context_parallel and its vjp's forward differ")
    got = pull_r((do[:, lo:hi], dht_parts[rank]))
    if sorted(got) != sorted(want):
        fail(f"{name}: gradients {sorted(got)} != {sorted(want)}")
    for key, g in want.items():
        per_token = key in PER_TOKEN_KW or key in [info.arrays[i] for i in PER_TOKEN[name]]
        worst = max(worst, check(f"{name} d{key}", got[key], g[:, lo:hi] if per_token else g, tol))
    return worst


def expect_error(kind, fn, words):
    try:
        fn()
    except kind as e:
        if words not in str(e):
            fail(f"{kind.__name__} without {words!r}: {e}")
        return
    fail(f"no {kind.__name__} ({words})")


def bad_input():
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((1, 5 + rank, 2, 4)) for _ in range(3))
    g = -rng.uniform(0, 1, (1, 5 + rank, 2))
    expect_error(ValueError, lambda: context_parallel(pyattn.linear_attention, q, k, v, comm=comm,
                                                      feature_map="cosformer"), "gated_delta_rule")
    # one rank with another head dim, dtype or option: the same error everywhere, no hang
    k_odd = k[..., :3].copy() if rank == size - 1 else k
    expect_error(ValueError, lambda: context_parallel(pyattn.simple_gla, q, k_odd, v, g, comm=comm),
                 "the ranks disagree")
    op_odd = pyattn.retention if rank == size - 1 else pyattn.simple_gla
    expect_error(ValueError, lambda: context_parallel(op_odd, q, k, v, *([] if rank == size - 1 else [g]),
                                                      comm=comm), "the ranks disagree")
    g_odd = g.astype(np.float32) if rank == 0 else g
    expect_error(ValueError, lambda: context_parallel(pyattn.simple_gla, q, k, v, g_odd, comm=comm),
                 "the ranks disagree")
    expect_error(ValueError, lambda: context_parallel(pyattn.simple_gla, q, k, v, g, comm=comm,
                                                      chunk_size=16 if rank else 32), "the ranks disagree")
    # a slice the op itself refuses on one rank only (g one step short)
    g_short = g[:, 1:].copy() if rank == 0 else g
    expect_error(ValueError, lambda: context_parallel(pyattn.simple_gla, q, k, v, g_short, comm=comm),
                 "failed on rank 0")
    expect_error(NotImplementedError, lambda: context_parallel(
        pyattn.simple_gla, q, k, v, g, comm=comm, cu_seqlens=np.array([0, 5 + rank])), "cu_seqlens")


def torch_wrapper():
    try:
        import torch
    except ImportError:
        return "torch missing: wrapper not checked"
    from pyattn.torch.distributed_context import context_parallel as cp_torch
    info = pyattn.OPS["gated_delta_rule"]
    rng = np.random.default_rng(3)
    args, kw = info.example(rng, np.float64)
    (o, ht), pull = pyattn.vjp(info.fn, *args, **kw)
    do = rng.standard_normal(o.shape)
    want = pull((do, None))
    lo, hi = bounds(o.shape[1])
    tensors = [torch.tensor(np.ascontiguousarray(a[:, lo:hi]) if i in PER_TOKEN["gated_delta_rule"] else a,
                            requires_grad=True) for i, a in enumerate(args)]
    h0 = torch.tensor(kw.pop("initial_state"), requires_grad=True)
    o_r, ht_r = cp_torch("gated_delta_rule", *tensors, comm=comm, initial_state=h0, **kw)
    check("torch o", o_r.detach().numpy(), o[:, lo:hi], 1e-12)
    check("torch final state", ht_r.detach().numpy(), ht, 1e-12)
    (o_r * torch.tensor(np.ascontiguousarray(do[:, lo:hi]))).sum().backward()
    for t, name in zip(tensors, info.arrays):
        check(f"torch d{name}", t.grad.numpy(), want[name][:, lo:hi], 1e-12)
    check("torch dinitial_state", h0.grad.numpy(), want["initial_state"], 1e-12)
    return "torch wrapper checked"


worst = {np.float64: 0.0, np.float32: 0.0}
for name in PER_TOKEN:
    for dtype in (np.float64, np.float32):
        for with_h0 in (True, False):
            worst[dtype] = max(worst[dtype], case(name, dtype, with_h0))
    for form in ("parallel", "recurrent"):
        worst[np.float64] = max(worst[np.float64], case(name, np.float64, True, form=form))
worst[np.float64] = max(worst[np.float64], case("gated_delta_rule", np.float64, True, chunk_size=64))
for name in ("gla", "mamba2", "kda"):
    worst[np.float64] = max(worst[np.float64], case(name, np.float64, True, empty_first=True))
bad_input()
note = torch_wrapper()
if rank == 0:
    print(f"max relative error float64 {worst[np.float64]:.3g} float32 {worst[np.float32]:.3g}; {note}")
print(f"OK rank {rank}", flush=True)
