"""The ranks' agreement on a call, checked with one small collective before any data moves."""
from __future__ import annotations

from typing import Any


def agree(comm, what: str, facts: Any) -> None:
    """Raise the same ValueError on every rank unless every rank passed equal ``facts`` (a
    picklable summary of its call: shapes, dtypes, options; for a dict the message names the
    entries that differ). ``what`` names the call in the message. One ``allgather`` of the facts: a rank that disagrees cannot leave the others
    waiting in a later collective."""
    seen = comm.allgather(facts)
    if all(f == seen[0] for f in seen[1:]):
        return
    if all(isinstance(f, dict) for f in seen):  # name only the entries that differ
        keys = sorted({k for f in seen for k in f if any(g.get(k) != f.get(k) for g in seen)}, key=str)
        seen = [{k: f.get(k) for k in keys} for f in seen]
    lines = "; ".join(f"rank {r}: {f}" for r, f in enumerate(seen))
    raise ValueError(f"{what}: the ranks disagree ({lines})")
