"""One node of a ``LocalCluster``: its own OS process.

``python -m sparktrain.backends.local_cluster.node.main JOB REPORT [FD]`` reads the pickled ``(spec,
place)`` of one node from ``JOB``, runs it exactly as a Spark task or a Ray actor does
(:func:`~sparktrain.node.remote.run_connected`: a fork server, the agent, the authenticated channel
to the driver), and writes the node's pickled report to ``REPORT``. Node 0 gets the rendezvous
socket the driver bound as descriptor ``FD``. Killing this process's group is losing the node: its
fork server and ranks go with it, and the driver sees the node end without a report.
"""

from __future__ import annotations

import os
import shutil
import socket
import sys

import cloudpickle

from sparktrain.contract.report import NodeReport
from sparktrain.node.remote import run_connected
from sparktrain.node.runner import prepare_run_dir


def main(argv: list[str]) -> int:
    """Run the node described in ``argv[0]``; write its report to ``argv[1]``."""
    job, report_path = argv[0], argv[1]
    listener = socket.socket(fileno=int(argv[2])) if len(argv) > 2 else None
    with open(job, "rb") as handle:
        spec, place = cloudpickle.load(handle)
    run_dir = ""
    try:
        run_dir = prepare_run_dir(spec, "node")
        report = run_connected(
            spec, place, run_dir=run_dir, listener=listener, sigterm_is_notice=True
        )
    except Exception as exc:
        if listener is not None:
            listener.close()
        report = NodeReport.broken(place.node, place.host, f"{type(exc).__name__}: {exc}")
    finally:
        if run_dir:
            shutil.rmtree(run_dir, ignore_errors=True)
    tmp = f"{report_path}.tmp"
    with open(tmp, "wb") as handle:
        cloudpickle.dump(report, handle)
    os.replace(tmp, report_path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
