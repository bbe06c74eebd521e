"""The ranks' agreement on a call, checked with one small collective before any data moves."""
from __future__ import annotations

from typing import Any


def agree(comm, what: str, facts: Any) -> None:
    """Raise the same ValueError on every rank unless every rank passed equal ``facts`` (a
    picklable summary of its call: shapes, dtypes, options). ``what`` names the call in the
    message. One ``allgather`` of the facts: a rank that disagrees cannot leave the others
    waiting in a later collective."""
    seen = comm.allgather(facts)
    if any(f != seen[0] for f in seen[1:]):
        lines = "; ".join(f"rank {r}: {f}" for r, f in enumerate(seen))
        raise ValueError(f"{what}: the ranks disagree ({lines})")
