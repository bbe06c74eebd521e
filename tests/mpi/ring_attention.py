"""Per-rank checks of pyattn.distributed.ring_attention against softmax_attention on the whole
sequence (run under mpiexec by tests/test_distributed_ring.py)."""
import importlib.util
import sys
import threading
import zlib

import numpy as np
from mpi4py import MPI

import pyattn
from pyattn.distributed import ring, ring_attention, zigzag_merge, zigzag_split

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
TOL = {np.float64: 1e-12, np.float32: 1e-5}
worst = {}


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.sqrt(np.mean((a - b) ** 2)) / max(np.sqrt(np.mean(b ** 2)), 1e-300)


def check(name, got, want, dtype):
    err = rel(got, want)
    worst[dtype] = max(worst.get(dtype, 0.0), err)
    if not err <= TOL[dtype]:
        print(f"FAIL rank {rank}: {name}: relative error {err:.3e} > {TOL[dtype]:.0e}", flush=True)
        sys.exit(1)


def draw(B, T, H, Hk, Dk, Dv, dtype, seed):
    rng = np.random.default_rng(seed)
    q, k = rng.standard_normal((B, T, H, Dk)), rng.standard_normal((B, T, Hk, Dk))
    v, do = rng.standard_normal((B, T, Hk, Dv)), rng.standard_normal((B, T, H, Dv))
    dlse = rng.standard_normal((B, T, H))
    return [x.astype(dtype) for x in (q, k, v, do, dlse)]


def contiguous_bounds(T, unequal):
    """Rank slices in order; unequal lengths when asked (the last rank takes the rest)."""
    if unequal:
        lengths = [3 + 2 * r for r in range(size - 1)]
        lengths.append(T - sum(lengths))
    else:
        lengths = [T // size] * size
    starts = np.cumsum([0] + lengths)
    return starts[rank], starts[rank + 1]


def case(name, *, B=2, T=48, H=4, Hk=4, Dk=16, Dv=16, dtype=np.float64, causal=True, layout="contiguous",
         unequal=False, return_lse=True, softcap=None, scale=None, window=None, torch_wrapper=False):
    q, k, v, do, dlse = draw(B, T, H, Hk, Dk, Dv, dtype, seed=zlib.crc32(name.encode()))
    kw = dict(causal=causal, scale=scale, window=window, softcap=0.0 if softcap is None else softcap)
    (o, lse), pullback = pyattn.vjp(pyattn.softmax_attention, q, k, v, return_lse=True, **kw)
    g = pullback((do, dlse if return_lse else None))
    if layout == "zigzag":
        local = lambda x: zigzag_split(x, comm)  # noqa: E731
    else:
        a, b = contiguous_bounds(T, unequal)
        local = lambda x: np.ascontiguousarray(x[:, a:b])  # noqa: E731
    ql, kl, vl, dol, dlsel = (local(x) for x in (q, k, v, do, dlse))
    rkw = dict(comm=comm, causal=causal, scale=scale, window=window, softcap=softcap, layout=layout,
               return_lse=return_lse)
    if torch_wrapper:
        import torch
        from pyattn.torch.distributed import ring_attention as torch_ring
        tq, tk, tv = (torch.from_numpy(x).requires_grad_() for x in (ql, kl, vl))
        out = torch_ring(tq, tk, tv, **rkw)
        to, tlse = out if return_lse else (out, None)
        loss = (to * torch.from_numpy(dol)).sum()
        if return_lse:
            loss = loss + (tlse * torch.from_numpy(dlsel)).sum()
        loss.backward()
        got_o, got_lse = to.detach().numpy(), None if tlse is None else tlse.detach().numpy()
        got = {"q": tq.grad.numpy(), "k": tk.grad.numpy(), "v": tv.grad.numpy()}
    else:
        out, ring_pullback = pyattn.vjp(ring_attention, ql, kl, vl, **rkw)
        got_o, got_lse = out if return_lse else (out, None)
        got = ring_pullback((dol, dlsel) if return_lse else dol)
        # the forward alone agrees with the forward of the vjp
        plain = ring_attention(ql, kl, vl, **rkw)
        check(f"{name} plain o", plain[0] if return_lse else plain, got_o, dtype)
    check(f"{name} o", got_o, local(o), dtype)
    if return_lse:
        check(f"{name} lse", got_lse, local(lse), dtype)
    for x in "qkv":
        check(f"{name} d{x}", got[x], local(g[x]), dtype)
        assert got[x].dtype == dtype and got[x].shape == local(g[x]).shape


def expect_error(name, fn, words, kind=ValueError):
    try:
        fn()
    except kind as e:
        if not all(w in str(e) for w in words):
            print(f"FAIL rank {rank}: {name}: message {e!r} lacks {words}", flush=True)
            sys.exit(1)
    else:
        print(f"FAIL rank {rank}: {name}: no {kind.__name__}", flush=True)
        sys.exit(1)


T4 = 16 * size  # divides by 2N for zigzag
threads_before = threading.active_count()
for dtype in (np.float64, np.float32):
    case(f"contiguous causal {dtype.__name__}", dtype=dtype, T=T4)
    case(f"contiguous full {dtype.__name__}", dtype=dtype, T=T4, causal=False)
    case(f"contiguous unequal causal {dtype.__name__}", dtype=dtype, T=50, unequal=True)
    case(f"contiguous unequal full {dtype.__name__}", dtype=dtype, T=50, unequal=True, causal=False)
    case(f"zigzag causal {dtype.__name__}", dtype=dtype, T=T4, layout="zigzag")
    case(f"zigzag full {dtype.__name__}", dtype=dtype, T=T4, layout="zigzag", causal=False)
    case(f"zigzag gqa dk!=dv {dtype.__name__}", dtype=dtype, T=T4, layout="zigzag", H=6, Hk=2, Dk=16, Dv=8)
    case(f"contiguous gqa dk!=dv {dtype.__name__}", dtype=dtype, T=50, unequal=True, H=4, Hk=1, Dk=8, Dv=12)
    for layout, unequal in (("zigzag", False), ("contiguous", True)):
        T = T4 if layout == "zigzag" else 50
        for causal, window in ((True, (11, 0)), (True, (3, 5)), (True, (0, 0)), (False, (3, 7)),
                               (False, (-1, 4)), (False, (13, -1)), (False, (0, 0)), (True, (-1, -1))):
            case(f"{layout} window {window} causal {causal} {dtype.__name__}", dtype=dtype, T=T,
                 layout=layout, unequal=unequal, causal=causal, window=window, H=4, Hk=2, Dk=8, Dv=12)
case("softcap scale", T=T4, layout="zigzag", softcap=5.0, scale=0.3)
case("no lse", T=T4, layout="zigzag", return_lse=False, B=1)
if importlib.util.find_spec("torch") is not None:
    case("torch zigzag", T=T4, layout="zigzag", torch_wrapper=True)
    case("torch contiguous float32 no lse", T=50, unequal=True, dtype=np.float32, return_lse=False, torch_wrapper=True)

# the helper threads that move the transfers are all gone after the calls
assert threading.active_count() == threads_before, (threading.active_count(), threads_before)
# where the MPI library allows no helper thread, the transfers move in the waits alone
assert ring._polling_allowed()  # mpi4py asks for MPI_THREAD_MULTIPLE
ring._polling_allowed = lambda: False
for dtype in (np.float64, np.float32):
    case(f"no helper thread zigzag {dtype.__name__}", dtype=dtype, T=T4, layout="zigzag", H=6, Hk=2)
    case(f"no helper thread contiguous {dtype.__name__}", dtype=dtype, T=50, unequal=True, causal=False)

# zigzag_merge inverts zigzag_split
x = np.arange(2 * 3 * T4 * 2, dtype=np.float64).reshape(2, T4, 3, 2)
assert np.array_equal(zigzag_merge(zigzag_split(x, comm), comm), x)

# bad input: the same ValueError on every rank, never a hang
rng = np.random.default_rng(0)
H = 4 if rank else 2
qb, kb, vb = (rng.standard_normal((1, 8, H, 8)) for _ in range(3))
expect_error("ranks with different H", lambda: ring_attention(qb, kb, vb, comm=comm), ["ring_attention", "disagree"])
dt = np.float32 if rank == size - 1 else np.float64
qb, kb, vb = (rng.standard_normal((1, 8, 2, 8)).astype(dt) for _ in range(3))
expect_error("ranks with different dtypes", lambda: ring_attention(qb, kb, vb, comm=comm), ["disagree", "float32"])
qb, kb, vb = (rng.standard_normal((1, 8 if rank else 3, 2, 8)) for _ in range(3))
expect_error("zigzag with an odd slice", lambda: ring_attention(qb, kb, vb, comm=comm, layout="zigzag"),
             ["zigzag", "odd length 3"])
expect_error("zigzag_split with T not dividing by 2N", lambda: zigzag_split(np.zeros((1, 2 * size + 1, 2, 4)), comm),
             ["zigzag_split", f"divide by {2 * size}"])
qb, kb, vb = (rng.standard_normal((1, 8, 2, 8)) for _ in range(3))
expect_error("ranks with different windows", lambda: ring_attention(qb, kb, vb, comm=comm, window=(4, rank)),
             ["disagree"])
expect_error("a bad window", lambda: ring_attention(qb, kb, vb, comm=comm, window=(4, -3)), ["window"])
expect_error("a bad layout", lambda: ring_attention(qb, kb, vb, comm=comm, layout="striped"), ["layout"])

print(f"max relative error rank {rank}: " + ", ".join(f"{d.__name__} {e:.2e}" for d, e in worst.items()))
print(f"OK rank {rank}", flush=True)
