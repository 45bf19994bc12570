"""The files of a run directory, as every process of the run names them.

The node writes the payload (the pickled function) and reads what each rank left; the rank reads
the payload and writes its value, its failure record, or its stacks. One place names them all.
"""

from __future__ import annotations

from pathlib import Path


def payload_path(run_dir: str) -> Path:
    """Where the pickled function and its arguments lie."""
    return Path(run_dir) / "payload.pkl"


def result_path(run_dir: str, rank: int) -> Path:
    """Where ``rank`` leaves its return value."""
    return Path(run_dir) / f"rank-{rank}.result"


def error_path(run_dir: str, rank: int) -> Path:
    """Where ``rank`` leaves its failure record."""
    return Path(run_dir) / f"rank-{rank}.error"


def stack_path(run_dir: str, rank: int) -> Path:
    """Where ``rank`` dumps its Python stacks on SIGUSR1."""
    return Path(run_dir) / f"rank-{rank}.stack"


def wait_path(run_dir: str, rank: int) -> Path:
    """Where ``rank`` names a build lock it waits on that no process holds (for a hang report)."""
    return Path(run_dir) / f"rank-{rank}.wait"


def grow_path(run_dir: str) -> Path:
    """The file whose presence asks the node's ranks to stop at their next checkpoint."""
    return Path(run_dir) / "GROW"
