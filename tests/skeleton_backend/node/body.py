"""One skeleton node: ``python -m skeleton_backend.node.body FOLDER NODE [FD]``.

Runs the node as every remote backend's node does (:func:`run_connected`: a fork server, the
agent, the authenticated channel back to the driver) and leaves its pickled report beside its job.
"""

from __future__ import annotations

import shutil
import socket
import sys
from pathlib import Path

import cloudpickle

from sparktrain.node.remote import run_connected
from sparktrain.node.runner import prepare_run_dir


def main(folder: Path, node: str, fd: str | None = None) -> None:
    """Run node ``node`` of the job in ``folder``; write its report there."""
    spec, place = cloudpickle.loads((folder / f"{node}.job").read_bytes())
    listener = socket.socket(fileno=int(fd)) if fd is not None else None
    run_dir = prepare_run_dir(spec, "skeleton")
    try:
        report = run_connected(spec, place, run_dir=run_dir, listener=listener)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    (folder / f"{node}.partial").write_bytes(cloudpickle.dumps(report))
    (folder / f"{node}.partial").rename(folder / f"{node}.report")


if __name__ == "__main__":
    main(Path(sys.argv[1]), *sys.argv[2:])
