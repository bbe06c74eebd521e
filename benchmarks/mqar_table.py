"""The MQAR table: Zoology's multi-query associative recall, one 2-layer ``HybridLM`` per mixer
and width, each the best of a small learning-rate sweep, all under one training budget.

    python benchmarks/mqar_table.py [--jobs N] [--threads N] [--steps 3000] [--batch-size 32]
        [--examples 20000] [--lrs 3e-4,5e-4,7e-4,1e-3,3e-3] [--widths 64,128] [--dtype bfloat16]
        [--models softmax,linear,retnet,mamba2,gla,deltanet,gated_deltanet,hybrid,kda,...]
        [--shard K/N] [--out DIR]
    python benchmarks/mqar_table.py --merge DIR_OR_JSONL [...]      # the table of earlier runs

Task (defaults): sequences of 128 tokens, 16 key-value pairs, vocabulary 512
(``pyattn.data.mqar``); ``--examples`` training rows (seed 0) and ``--eval-examples``
held-out rows (seed 1, a different draw). Model: ``HybridLM(vocab, d_model, 2, mixers,
n_heads=4)``, float32 (or ``--dtype bfloat16``: the bf16 model, float32 master weights),
every mixer with its defaults ("linear": feature map elu1, its
default); "hybrid" is ``["gated_deltanet", "softmax"]`` (a Gated DeltaNet layer, then a
softmax layer). Training: ``pyattn.train`` (AdamW, weight decay 0.1, clip 1.0, cosine
schedule with 10% warm-up), the same ``--steps`` x ``--batch-size`` rows drawn from the same
training set for every model; the figure is the answer accuracy (positions whose target is
not -100) of the final model on all held-out rows, and each cell of the table is the best
of the learning rates in ``--lrs``.

Each (model, width, lr) runs as its own process (this script with ``--run``), with
``--threads`` threads (default 1: ``OMP_NUM_THREADS`` and ``pyattn.set_num_threads``;
``OPENBLAS_NUM_THREADS=1``), ``--jobs`` of them at a time, the longest (by a per-step cost
table measured at one thread) first.
``--shard K/N`` runs the K-th of N subsets of the sweep, balanced by that cost, so that a
sweep can be split across machines or calls; ``--out DIR`` appends every run's result as
one JSON line to ``DIR/results.jsonl`` (and its log to ``DIR/logs``); ``--merge`` prints
the table of such files together. With ``--out``, each run also saves a training checkpoint
(``DIR/checkpoints``) every 50 steps, and a command run again skips the runs whose results
``DIR`` holds and resumes the others from their checkpoints, with the bits of an
uninterrupted run; ``--time-limit S`` stops every run after S seconds, so that a sweep longer
than one sitting goes on in the next.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from typing import Dict, List, Optional, Tuple

MODELS = ["softmax", "linear", "retnet", "mamba2", "gla", "deltanet", "gated_deltanet", "hybrid",
          "kda", "rwkv7", "rwkv6", "hgrn2", "gated_deltaproduct", "fox", "log_linear_mamba2"]
LABELS = {"softmax": "Softmax attention", "linear": "Linear attention (elu+1)",
          "retnet": "RetNet", "mamba2": "Mamba2", "gla": "GLA", "deltanet": "DeltaNet",
          "gated_deltanet": "Gated DeltaNet", "hybrid": "Hybrid (Gated DeltaNet + softmax)",
          "kda": "Kimi Delta Attention", "rwkv7": "RWKV-7", "rwkv6": "RWKV-6", "hgrn2": "HGRN2",
          "gated_deltaproduct": "Gated DeltaProduct", "fox": "Forgetting Transformer",
          "log_linear_mamba2": "Log-linear Mamba2"}
HYBRID = ["gated_deltanet", "softmax"]
DTYPES = ("float32", "bfloat16")
CHECKPOINT_EVERY = 50  # steps; a killed run redoes at most this many
# the settings every run of a table shares, recorded with each result; a result counts as done
# for a later command only when they all match
BUDGET = ("steps", "batch_size", "examples", "eval_examples", "seq_len", "kv_pairs", "vocab",
          "layers", "heads", "seed", "dtype")
# ms per training step (forward + backward, batch 32, T 128, one thread), measured with this
# script's settings on a 2-core x86-64 machine (the last seven measured while the machine was
# busy and scaled by gated_deltanet's time then and here); only the order and balance of the
# runs use it.
COST = {64: {"softmax": 133, "linear": 90, "retnet": 141, "mamba2": 207, "gla": 139,
             "deltanet": 137, "gated_deltanet": 155, "hybrid": 134, "kda": 132, "rwkv7": 184,
             "rwkv6": 265, "hgrn2": 103, "gated_deltaproduct": 140, "fox": 91, "log_linear_mamba2": 210},
        128: {"softmax": 206, "linear": 183, "retnet": 252, "mamba2": 360, "gla": 205,
              "deltanet": 265, "gated_deltanet": 290, "hybrid": 248, "kda": 333, "rwkv7": 388,
              "rwkv6": 709, "hgrn2": 318, "gated_deltaproduct": 364, "fox": 224, "log_linear_mamba2": 473}}


# Zoology puts a short convolution before the sequence mixer of every MQAR model; the mixers
# that have none by default get theirs through their short_conv option. The newer mixers run
# as their published layers are: kda, gated_deltaproduct and log_linear_mamba2 with their short
# convolutions, the RWKVs with their token shift, hgrn2 and fox without either.
SHORT_CONV = ("softmax", "linear", "retnet", "gla")


def mixers_of(model: str, layers: int):
    names = HYBRID if model == "hybrid" else [model] * layers
    return [(n, {"short_conv": True}) if n in SHORT_CONV else n for n in names]


def one_run(opts) -> Dict:
    """One (model, width, lr): train, then score every held-out row. Runs in its own process."""
    import numpy as np
    import pyattn
    from pyattn.nn import HybridLM
    from pyattn.training import evaluate

    pyattn.set_num_threads(opts.threads)
    sys.modules["tqdm"] = None  # type: ignore[assignment]  # the plain progress line in the log, not tqdm's bar
    model_name, d_model, lr = opts.run[0], int(opts.run[1]), float(opts.run[2])
    t0 = time.perf_counter()
    train_data = pyattn.data.mqar(opts.examples, opts.seq_len, opts.kv_pairs, opts.vocab, seed=opts.seed)
    eval_data = pyattn.data.mqar(opts.eval_examples, opts.seq_len, opts.kv_pairs, opts.vocab,
                                 seed=opts.seed + 1)
    model = HybridLM(opts.vocab, d_model, opts.layers, mixers_of(model_name, opts.layers), n_heads=opts.heads,
                     dtype=opts.dtype, seed=opts.seed)
    # the curve on the first 256 held-out rows; the final figure on all of them
    probe = (eval_data[0][:256], eval_data[1][:256])
    ckpt = opts.checkpoint
    resumed = bool(ckpt) and os.path.exists(ckpt)  # then train_s and wall_s time the last sitting only
    history = pyattn.train(model, train_data, steps=opts.steps, batch_size=opts.batch_size, lr=lr,
                           eval_data=probe, eval_every=max(1, opts.steps // opts.evals),
                           progress=True, seed=opts.seed, checkpoint=ckpt,
                           checkpoint_every=CHECKPOINT_EVERY)
    t_train = time.perf_counter() - t0
    acc = evaluate(model, eval_data)
    loss = history["loss"]
    return {"model": model_name, "d_model": d_model, "lr": lr, "accuracy": acc,
            "final_loss": float(np.mean(loss[-max(1, len(loss) // 50):])),
            "finite": bool(np.all(np.isfinite(loss))),
            "curve": [[int(s) + 1, round(float(a), 4)] for s, a in zip(history["eval_step"], history["accuracy"])],
            **{k: getattr(opts, k) for k in BUDGET},
            "train_s": round(t_train, 1), "wall_s": round(time.perf_counter() - t0, 1),
            "resumed": resumed}


def budget_args(opts) -> List[str]:
    """The command-line arguments that give a run's process this table's budget."""
    return [a for k in BUDGET + ("evals",) for a in ("--" + k.replace("_", "-"), str(getattr(opts, k)))]


def sweep(opts) -> List[Tuple[str, int, float]]:
    """The (model, width, lr) runs of this invocation, longest first; with --shard K/N the
    K-th of N cost-balanced subsets (greedy: each run to the lightest shard so far)."""
    runs = [(m, d, lr) for m in opts.models for d in opts.widths for lr in opts.lrs]
    cost = lambda r: COST.get(r[1], {}).get(r[0], 300) * (r[1] / 128 if r[1] not in COST else 1)
    runs.sort(key=lambda r: (-cost(r), r))
    if opts.shard:
        k, n = opts.shard
        load, mine = [0.0] * n, []
        for r in runs:
            i = min(range(n), key=lambda j: (load[j], j))
            load[i] += cost(r)
            if i == k - 1:
                mine.append(r)
        runs = mine
    return runs


def machine_info() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    import numpy as np
    try:
        import pyattn
        version = getattr(pyattn, "__version__", "?")
    except ImportError:
        version = "?"
    return (f"{cpu}, {os.cpu_count()} logical CPUs, {platform.system()} {platform.release()}, "
            f"Python {platform.python_version()}, NumPy {np.__version__}, pyattn {version}")


def run_name(model: str, d_model: int, lr: float) -> str:
    """The stem of a run's log and checkpoint files."""
    return f"{model}_d{d_model}_lr{lr:g}"


def launch(opts, runs, out_dir: Optional[str]) -> List[Dict]:
    """Runs ``runs`` as separate processes, ``opts.jobs`` at a time; returns their results.
    Each process writes its output to a log file (``DIR/logs`` with ``--out``, else a
    temporary folder): its last line is its result as JSON."""
    import tempfile
    env = dict(os.environ, OMP_NUM_THREADS=str(opts.threads), OPENBLAS_NUM_THREADS="1",
               MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    log_dir = os.path.join(out_dir, "logs") if out_dir else tempfile.mkdtemp(prefix="mqar_table_")
    os.makedirs(log_dir, exist_ok=True)
    ckpt_dir = os.path.join(out_dir, "checkpoints") if out_dir else None
    if ckpt_dir:
        os.makedirs(ckpt_dir, exist_ok=True)
    pending, running, results = list(runs), [], []
    t0 = time.perf_counter()
    while pending or running:
        if opts.time_limit and time.perf_counter() - t0 > opts.time_limit:
            for (m, d, lr), p, _ in running:
                p.kill()
                p.wait()
                print(f"[{time.perf_counter() - t0:7.1f} s] stopped {m} d={d} lr={lr:g} at the time "
                      f"limit; it resumes from its last checkpoint when run again", file=sys.stderr, flush=True)
            print(f"time limit: {len(running)} runs stopped, {len(pending)} not started", file=sys.stderr)
            break
        while pending and len(running) < opts.jobs:
            m, d, lr = pending.pop(0)
            name = run_name(m, d, lr)
            cmd = ([sys.executable, os.path.abspath(__file__), "--run", m, str(d), repr(lr),
                    "--threads", str(opts.threads)] + budget_args(opts))
            if ckpt_dir:
                cmd += ["--checkpoint", os.path.join(ckpt_dir, name + ".npz")]
            log = os.path.join(log_dir, name + ".log")
            with open(log, "a") as f:
                p = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT)
            running.append(((m, d, lr), p, log))
        time.sleep(0.2)
        for item in list(running):
            (m, d, lr), p, log = item
            if p.poll() is None:
                continue
            running.remove(item)
            with open(log) as f:
                out = f.read()
            lines = [l for l in out.splitlines() if l.startswith("{")]
            if p.returncode != 0 or not lines:
                tail = out.strip()[-400:]
                print(f"[{time.perf_counter() - t0:7.1f} s] FAILED {m} d={d} lr={lr:g} (exit "
                      f"{p.returncode}): {tail}", file=sys.stderr, flush=True)
                r = {"model": m, "d_model": d, "lr": lr, "dtype": opts.dtype, "accuracy": None, "error": tail}
            else:
                r = json.loads(lines[-1])
                if ckpt_dir:  # the result is kept; the run's checkpoint is no longer needed
                    ckpt = os.path.join(ckpt_dir, run_name(m, d, lr) + ".npz")
                    if os.path.exists(ckpt):
                        os.remove(ckpt)
                print(f"[{time.perf_counter() - t0:7.1f} s] {m:15s} d={d:<4d} lr={lr:<7g} "
                      f"acc {r['accuracy']:.4f}  loss {r['final_loss']:.4f}  ({r['wall_s']:.0f} s)",
                      file=sys.stderr, flush=True)
            results.append(r)
            if out_dir:
                with open(os.path.join(out_dir, "results.jsonl"), "a") as f:
                    f.write(json.dumps(r) + "\n")
    return results


def load_results(paths: List[str]) -> List[Dict]:
    results = []
    for p in paths:
        if os.path.isdir(p):
            p = os.path.join(p, "results.jsonl")
        with open(p) as f:
            results += [json.loads(l) for l in f if l.strip()]
    for r in results:  # results from before --dtype were all float32
        r.setdefault("dtype", "float32")
    return results


def table(results: List[Dict], models=None, widths=None) -> str:
    """Markdown: a row per model and dtype (results as load_results gives them), per width
    the best accuracy over the lrs and that lr."""
    models = models or [m for m in MODELS if any(r["model"] == m for r in results)]
    widths = widths or sorted({r["d_model"] for r in results})
    head = "| model | " + " | ".join(f"d_model {d}: accuracy (lr) | lrs tried" for d in widths) + " |"
    rule = "|---|" + "---:|---|" * len(widths)
    rows = [head, rule]
    present = {(r["model"], r["dtype"]) for r in results}
    for m, dtype in [(m, t) for m in models for t in DTYPES if (m, t) in present]:
        cells = []
        for d in widths:
            rs = [r for r in results if r["model"] == m and r["d_model"] == d and r["dtype"] == dtype]
            ok = [r for r in rs if r.get("accuracy") is not None]
            tried = ", ".join(f"{r['lr']:g}: {r['accuracy']:.3f}" if r.get("accuracy") is not None
                              else f"{r['lr']:g}: failed" for r in sorted(rs, key=lambda r: r["lr"]))
            if ok:
                best = max(ok, key=lambda r: (r["accuracy"], -r["lr"]))
                cells.append(f"{best['accuracy']:.4f} ({best['lr']:g}) | {tried}")
            else:
                cells.append(f"{'failed' if rs else 'not run'} | {tried}")
        label = LABELS.get(m, m) + ("" if dtype == "float32" else f", {dtype}")
        rows.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def budget_line(results: List[Dict]) -> str:
    keys = ("steps", "batch_size", "examples", "eval_examples", "seq_len", "kv_pairs", "vocab", "layers", "heads")
    seen = {k: sorted({r[k] for r in results if k in r}) for k in keys}
    return ", ".join(f"{k} {'/'.join(map(str, v))}" for k, v in seen.items() if v)


def parse_list(kind):
    return lambda s: [kind(x) for x in s.split(",") if x]


def parse_shard(s):
    k, n = (int(x) for x in s.split("/"))
    if not 1 <= k <= n:
        raise argparse.ArgumentTypeError(f"--shard K/N needs 1 <= K <= N, got {s}")
    return k, n


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=int, default=os.cpu_count(), help="runs at a time (one thread each)")
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--examples", type=int, default=20000, help="training rows")
    ap.add_argument("--eval-examples", type=int, default=1000, help="held-out rows")
    ap.add_argument("--lrs", type=parse_list(float), default=[3e-4, 5e-4, 7e-4, 1e-3, 3e-3])
    ap.add_argument("--widths", type=parse_list(int), default=[64, 128])
    ap.add_argument("--models", type=parse_list(str), default=list(MODELS))
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--kv-pairs", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--evals", type=int, default=10, help="points of each run's accuracy curve")
    ap.add_argument("--dtype", choices=DTYPES, default="float32",
                    help="the models' dtype (bfloat16: HybridLM's bf16 layers, float32 master weights)")
    ap.add_argument("--threads", type=int, default=1,
                    help="pyattn's threads for each run (a run's results do not depend on it)")
    ap.add_argument("--shard", type=parse_shard, default=None, help="K/N: the K-th of N subsets")
    ap.add_argument("--out", default=None, help="folder for results.jsonl and logs")
    ap.add_argument("--merge", nargs="+", default=None, help="results.jsonl files or folders: print their table")
    ap.add_argument("--list", action="store_true", help="print the runs (and their commands), run nothing")
    ap.add_argument("--time-limit", type=float, default=None,
                    help="seconds: then stop the running runs (they resume from their checkpoints "
                         "in --out when the same command runs again) and start no more")
    ap.add_argument("--run", nargs=3, metavar=("MODEL", "D_MODEL", "LR"), help=argparse.SUPPRESS)
    ap.add_argument("--checkpoint", default=None, help=argparse.SUPPRESS)
    opts = ap.parse_args(argv)

    if opts.run:
        print(json.dumps(one_run(opts)), flush=True)
        return 0
    if opts.merge:
        results = load_results(opts.merge)
        print(table(results))
        print(f"\n{len(results)} runs; budget: {budget_line(results)}")
        return 0
    bad = [m for m in opts.models if m not in MODELS]
    if bad:
        ap.error(f"unknown models {bad}; choose from {MODELS}")
    if opts.time_limit is not None and not opts.out:
        ap.error("--time-limit needs --out: the stopped runs resume from their checkpoints there")
    runs = sweep(opts)
    if opts.out and os.path.exists(os.path.join(opts.out, "results.jsonl")):
        done = {(r["model"], r["d_model"], r["lr"]) for r in load_results([opts.out])
                if r.get("accuracy") is not None and all(r.get(k) == getattr(opts, k) for k in BUDGET)}
        runs = [r for r in runs if r not in done]
    if opts.list:
        for m, d, lr in runs:
            print(" ".join([f"OMP_NUM_THREADS={opts.threads}", "OPENBLAS_NUM_THREADS=1", "python",
                            "benchmarks/mqar_table.py", "--run", m, str(d), repr(lr),
                            "--threads", str(opts.threads)] + budget_args(opts)))
        return 0
    if opts.out:
        os.makedirs(opts.out, exist_ok=True)
    t0 = time.perf_counter()
    print(f"{len(runs)} runs, {opts.jobs} at a time; {machine_info()}", file=sys.stderr, flush=True)
    results = launch(opts, runs, opts.out)
    wall = time.perf_counter() - t0
    print(table(results, [m for m in MODELS if m in opts.models], sorted(set(opts.widths))))
    print(f"\nbudget: {opts.steps} steps x batch {opts.batch_size} from {opts.examples} training rows "
          f"(seq_len {opts.seq_len}, {opts.kv_pairs} kv pairs, vocab {opts.vocab}, {opts.layers} layers, "
          f"{opts.heads} heads); accuracy on {opts.eval_examples} held-out rows")
    print(f"{len(runs)} runs, {opts.jobs} at a time: {wall:.0f} s wall"
          + (f" (shard {opts.shard[0]}/{opts.shard[1]})" if opts.shard else ""))
    print(f"machine: {machine_info()}")
    if opts.out:
        with open(os.path.join(opts.out, "summary.json"), "a") as f:
            f.write(json.dumps({"wall_s": round(wall, 1), "runs": len(runs), "jobs": opts.jobs,
                                "shard": opts.shard, "machine": machine_info(),
                                "argv": sys.argv[1:]}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
