"""A real barrier stage on the cluster: do its tasks start together, and can they run ranks?

Each task reports its Python (version, executable), whether sparktrain and torch are there, and
its network: its address as Spark knows it, what its host name resolves to, and the interface
that holds the address (which sparktrain's ranks bind gloo and NCCL to).

Design choices:
- The same call as a launch, ``session.range(0, n, 1, n).mapInArrow(fn, ..., barrier=True)``,
  so the probe needs what a launch needs (pandas and pyarrow on the executors) and works on
  classic and Spark Connect sessions alike.
- The task function is a closure, so cloudpickle sends it by value: an executor without
  sparktrain still runs it and reports what is missing, instead of failing to unpickle it. It
  looks torch up without importing it (seconds per executor).
- It runs only when the slot check says the stage fits (a barrier stage with too few slots
  waits), and it is interrupted after ``timeout`` seconds.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import uuid
from collections.abc import Iterator, Sequence
from typing import Any

from sparktrain.doctor.verdicts import Check, Finding

SCHEMA = (
    "host string, python string, executable string, sparktrain string, torch string, "
    "address string, resolved string, interface string, checkpoint string"
)
PYTHON_FIX = (
    "point the executors at a Python with sparktrain and torch: PYSPARK_PYTHON (or "
    "spark.executorEnv.PYSPARK_PYTHON / spark.pyspark.python), and pip install sparktrain on "
    "every node"
)


def _task_function(checkpoint_dir: str | None = None) -> Any:
    columns = [part.split()[0] for part in SCHEMA.split(",")]

    def task(batches: Iterator[Any]) -> Iterator[Any]:
        import importlib.util
        import socket
        import sys
        from importlib import metadata

        import pyarrow as pa
        from pyspark import BarrierTaskContext

        for _ in batches:
            pass
        context = BarrierTaskContext.get()
        address = context.getTaskInfos()[context.partitionId()].address.rsplit(":", 1)[0]
        try:
            resolved = socket.gethostbyname(socket.gethostname())
        except OSError as exc:
            resolved = f"error: {exc}"
        row = {
            "address": address,
            "resolved": resolved,
            "interface": "",
            "host": socket.gethostname(),
            "python": ".".join(map(str, sys.version_info[:3])),
            "executable": sys.executable,
            "checkpoint": "",
        }
        try:
            import sparktrain

            row["sparktrain"] = sparktrain.__version__
            from sparktrain.node.interfaces import interface_of

            row["interface"] = interface_of(address) or ""
            if checkpoint_dir is not None:
                from sparktrain.doctor.storage import write_probe

                row["checkpoint"] = write_probe(checkpoint_dir)
        except Exception as exc:  # any failure to import is the finding
            row["sparktrain"] = f"error: {type(exc).__name__}: {exc}"
        if importlib.util.find_spec("torch") is None:
            row["torch"] = "error: not installed"
        else:
            row["torch"] = metadata.version("torch")
        context.barrier()  # every task is running at the same time
        yield pa.RecordBatch.from_pylist([{k: row[k] for k in columns}])  # the schema's order

    return task


def probe_verdict(rows: Sequence[dict[str, str]], *, driver_python: str | None = None) -> Check:
    """The verdict on the rows the probe's tasks returned (one per task)."""
    driver = driver_python or ".".join(map(str, sys.version_info[:3]))
    facts: dict[str, object] = {"tasks": len(rows), "rows": [dict(r) for r in rows]}
    return Check.judged("spark.probe", _probe_finding(rows, driver), facts)


def _probe_finding(rows: Sequence[dict[str, str]], driver: str) -> Finding:
    broken = [
        r for r in rows if r["sparktrain"].startswith("error") or r["torch"].startswith("error")
    ]
    if broken:
        first = broken[0]
        missing = first["sparktrain"] if first["sparktrain"].startswith("error") else first["torch"]
        return Finding(
            "error",
            f"{len(broken)} of {len(rows)} task(s) cannot run a rank: on {first['host']}, "
            f"{first['executable']} gives sparktrain/torch {missing}",
            PYTHON_FIX,
        )
    other = [r for r in rows if r["python"].split(".")[:2] != driver.split(".")[:2]]
    if other:
        return Finding(
            "error",
            f"executors run Python {other[0]['python']} ({other[0]['executable']}), the "
            f"driver {driver}: functions cannot be sent between Python versions",
            "use the same Python version on the driver and the executors; " + PYTHON_FIX,
        )
    hosts = sorted({r["host"] for r in rows})
    kinds = sorted({f"{r['executable']} (Python {r['python']})" for r in rows})
    return Finding(
        "ok",
        f"a barrier stage of {len(rows)} task(s) ran together on {', '.join(hosts)}: "
        f"{'; '.join(kinds)}, sparktrain {rows[0]['sparktrain']}, torch {rows[0]['torch']}",
    )


def network_verdict(rows: Sequence[dict[str, str]]) -> Check:
    """The verdict on the tasks' network.

    A warning for a host name that resolves to loopback where the tasks run on several hosts
    (the trap of runs across hosts), or for an address that no interface holds.
    """
    addresses = sorted({r["address"] for r in rows})
    facts: dict[str, object] = {
        "addresses": addresses,
        "interfaces": {r["address"]: r["interface"] for r in rows},
    }
    loopback = [r for r in rows if r["resolved"].startswith("127.") or r["resolved"] == "::1"]
    if len(addresses) > 1 and loopback:
        facts["loopback"] = [r["address"] for r in loopback]
    return Check.judged("spark.network", _network_finding(rows, addresses, loopback), facts)


def _network_finding(
    rows: Sequence[dict[str, str]], addresses: list[str], loopback: list[dict[str, str]]
) -> Finding:
    if len(addresses) < 2:
        return Finding(
            "ok",
            f"the tasks ran on one host ({', '.join(addresses)}): no traffic between hosts",
        )
    if loopback:
        first = loopback[0]
        return Finding(
            "warning",
            f"on {first['address']}, host name {first['host']} resolves to "
            f"{first['resolved']} (loopback), and the tasks run on {len(addresses)} hosts: "
            f"launchers that let gloo pick its device (pyspark's TorchDistributor, torchrun) fail "
            f"there with 'Connection refused, remote=[{first['resolved']}]'. sparktrain's ranks "
            f"bind to the interface of the task's address ({first['interface'] or '?'}), set "
            "for them as GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME",
            f"map {first['host']} to {first['address']} on that host (/etc/hosts, or DNS), "
            "and likewise on every host",
        )
    unheld = [r for r in rows if not r["interface"]]
    if unheld:
        first = unheld[0]
        return Finding(
            "warning",
            f"on {first['address']}, no network interface holds the task's address "
            f"{first['address']} (NAT, a proxy?): sparktrain cannot choose gloo's and NCCL's "
            "interface there",
            "name it yourself: spark.executorEnv.GLOO_SOCKET_IFNAME and "
            "NCCL_SOCKET_IFNAME (or the launch's env=) set to the interface the hosts reach each "
            "other by",
        )
    names = sorted({f"{r['address']} on {r['interface']}" for r in rows})
    return Finding(
        "ok",
        f"the tasks ran on {len(addresses)} hosts, each address on an interface, which "
        f"its ranks bind gloo and NCCL to: {', '.join(names)}",
    )


def probe_check(
    session: Any, tasks: int, *, timeout: float = 120.0, checkpoint_dir: str | None = None
) -> list[Check]:
    """Run a barrier stage of ``tasks`` tasks on ``session`` and judge what they report.

    With ``checkpoint_dir``, each task also writes, reads back and removes a file there.
    """
    from sparktrain.backends.spark.job import summarise_job_error

    tag = f"sparktrain-doctor-{uuid.uuid4().hex[:8]}"
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            with contextlib.suppress(Exception):
                session.addTag(tag)
            frame = session.range(0, tasks, 1, tasks)
            task = _task_function(checkpoint_dir)
            box["rows"] = frame.mapInArrow(task, SCHEMA, barrier=True).collect()
        except Exception as exc:  # the finding, summarised below
            box["error"] = exc
        finally:
            with contextlib.suppress(Exception):
                session.removeTag(tag)

    thread = threading.Thread(target=run, name="sparktrain-doctor-probe", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        with contextlib.suppress(Exception):
            session.interruptTag(tag)
        return [
            Check(
                name="spark.probe",
                verdict="error",
                found=f"a barrier stage of {tasks} task(s) did not finish in {timeout:g}s",
                fix="check that the cluster has that many free task slots (other jobs may hold "
                "them) and the executors' logs",
                facts={"tasks": tasks},
            )
        ]
    if "error" in box:
        return [
            Check(
                name="spark.probe",
                verdict="error",
                found=f"a barrier stage of {tasks} task(s) failed: "
                f"{summarise_job_error(box['error'])}",
                fix="pandas and pyarrow must be installed on the executors; " + PYTHON_FIX,
                facts={"tasks": tasks},
            )
        ]
    rows = [row.asDict() for row in box["rows"]]
    found = [probe_verdict(rows), network_verdict(rows)]
    if checkpoint_dir is not None and found[0].verdict != "error":
        from sparktrain.doctor.storage import nodes_verdict

        found.append(nodes_verdict(checkpoint_dir, rows))
    return found
