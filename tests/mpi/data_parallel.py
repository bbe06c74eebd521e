"""Data-parallel training under mpiexec against one process on the same global batches: the
losses, the accuracy history and the final parameters (float64: 1e-12 relative), every rank
holding the same parameters; a checkpointed run resumed half way ends with the same bits; a
batch the ranks do not divide is a ValueError on every rank.

    mpiexec -n N python tests/mpi/data_parallel.py TMPDIR
"""
import json
import os
import sys

import numpy as np
from mpi4py import MPI

import pyattn
from pyattn.data import mqar
from pyattn.distributed.data import DataParallel
from pyattn.nn import HybridLM

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
tmp = sys.argv[1]
inputs, targets = mqar(96, 24, 3, 32, seed=0)
held_out = mqar(16, 24, 3, 32, seed=1)
STEPS, BATCH = 6, 4 * size


def model():
    return HybridLM(32, 16, 2, ["gated_deltanet", "softmax"], n_heads=2, dtype="float64", seed=3)


def check(cond, what):
    if not cond:
        print(f"FAIL rank {rank}: {what}", flush=True)
        comm.Abort(1)


def rel(a, b):
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-300))


kw = dict(steps=STEPS, batch_size=BATCH, lr=3e-3, eval_data=held_out, eval_every=3, progress=False, seed=5)
one = model()
h_one = pyattn.train(one, (inputs, targets), **kw)            # every rank: one process's run
par = model()
h_par = pyattn.train(par, (inputs, targets), comm=comm, **kw)
check(np.allclose(h_par["loss"], h_one["loss"], rtol=1e-12, atol=0), f"losses {h_par['loss']} vs {h_one['loss']}")
check(h_par["accuracy"] == h_one["accuracy"], "accuracy history")
worst = max(rel(par.params[n], one.params[n]) for n in one.params)
check(worst < 1e-12, f"parameters differ from one process's by {worst:.2e}")
digests = comm.allgather([par.params[n].tobytes() for n in par.params])
check(all(d == digests[0] for d in digests), "ranks hold different parameters")

# a checkpointed run stopped half way and resumed ends with the bits of an uninterrupted one
path = os.path.join(tmp, f"dp{size}.npz")
whole = model()
pyattn.train(whole, (inputs, targets), comm=comm, checkpoint=path + ".whole", checkpoint_every=3, **kw)


class Killed(Exception):
    pass


checks = DataParallel.check_same_params
calls = []


def killed_at_the_second_checkpoint(self, m):
    """Every rank stops before the second checkpoint is written, as a job killed after step 3."""
    calls.append(1)
    if len(calls) == 2:
        raise Killed()
    checks(self, m)


DataParallel.check_same_params = killed_at_the_second_checkpoint
try:
    pyattn.train(model(), (inputs, targets), comm=comm, checkpoint=path, checkpoint_every=3, **kw)
    check(False, "the run was not stopped")
except Killed:
    pass
DataParallel.check_same_params = checks
if rank == 0:
    with np.load(path) as saved:
        check(json.loads(str(saved["__meta__"]))["step"] == 3, "the checkpoint is not step 3's")
resumed = model()  # a fresh model: everything comes from the checkpoint rank 0 reads
h_res = pyattn.train(resumed, (inputs, targets), comm=comm, checkpoint=path, checkpoint_every=3, **kw)
check(all(np.array_equal(resumed.params[n], whole.params[n]) for n in whole.params), "resumed run differs")
check(h_res["loss"] == h_par["loss"] and len(calls) == 2, "resumed history")

# a batch the ranks do not divide: the same ValueError everywhere, before any collective
if size > 1:
    try:
        pyattn.train(model(), (inputs, targets), steps=1, batch_size=size + 1, progress=False, comm=comm)
        check(False, "no error for a batch the ranks do not divide")
    except ValueError as e:
        check("multiple of the number of ranks" in str(e), str(e))
    # ranks that disagree on the settings: a ValueError on every rank, no hang
    try:
        pyattn.train(model(), (inputs, targets), steps=1 + (rank == 0), batch_size=BATCH, progress=False,
                     comm=comm)
        check(False, "no error for ranks that disagree")
    except ValueError as e:
        check("disagree" in str(e), str(e))
# a loss that stops being finite: every rank stops at the step one process stops at
errors = []
for c in (None, comm):
    try:
        pyattn.train(model(), (inputs, targets), **dict(kw, lr=1e6, steps=30, eval_data=None), comm=c)
        errors.append(None)
    except FloatingPointError as e:
        errors.append(str(e))
check(errors[0] is not None and errors[0] == errors[1], f"divergence: {errors}")
# ranks holding different data, or models drawn from different seeds: refused on every rank
if size > 1:
    for what, data, seed in (("data", (inputs + (rank == 0), targets), 3), ("initial parameters", (inputs, targets), 3 + rank)):
        try:
            pyattn.train(HybridLM(32, 16, 2, ["gated_deltanet", "softmax"], n_heads=2, dtype="float64", seed=seed),
                         data, steps=1, batch_size=BATCH, progress=False, comm=comm)
            check(False, f"no error for ranks with different {what}")
        except ValueError as e:
            check("disagree" in str(e) and what in str(e), str(e))
comm.Barrier()
print(f"OK rank {rank}", flush=True)
