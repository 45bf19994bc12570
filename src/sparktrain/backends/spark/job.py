"""The barrier job of one attempt: run in a helper thread, cancelled by its tag, its failure told.

``spark.range(tasks).mapInArrow(run_node, barrier=True)`` runs one node per task
(:mod:`sparktrain.backends.spark.node.task`); the rows it collects are the nodes' pickled
reports. A job that fails is summed up in one line (:func:`summarise_job_error`), never a Py4J
wall of text.
"""

from __future__ import annotations

import contextlib
import re
import sys
import threading
from typing import Any

from sparktrain.backends.spark.node.task import run_node
from sparktrain.contract.spec import NodeSpec

SCHEMA = "node long, report binary"

_PYTHON_ERROR = re.compile(
    r"(?s)Traceback \(most recent call last\):\n.*?\n(\w[\w.]*(?:Error|Exception)\b[^\n]*)"
)
_JOB_ERRORS = (
    r"(ExecutorLostFailure[^\n]*)",
    r"(BarrierJobSlotsNumberCheckFailed[^\n]*)",
    r"Job aborted due to stage failure: ([^\n]*)",
    r"(SparkException: [^\n]*)",
)


def summarise_job_error(exc: BaseException) -> str:
    """The one line of a Spark job failure worth showing (not the Java stack)."""
    text = str(exc)
    python = _PYTHON_ERROR.search(text)
    if python:
        return f"a task raised {python.group(1)}:\n{python.group(0)}"[:4000] + _missing_hint(text)
    for pattern in _JOB_ERRORS:
        found = re.search(pattern, text)
        if found:
            return found.group(1)[:500]
    return text.splitlines()[0][:500] if text else type(exc).__name__


def _missing_hint(text: str) -> str:
    """What to do when the executors' Python lacks sparktrain or torch."""
    missing = re.search(r"No module named '(sparktrain|torch|cloudpickle)'", text)
    if not missing:
        return ""
    return (
        f"\nThe executors' Python has no {missing.group(1)}: install sparktrain and torch where "
        "the executors run (the cluster's libraries), or, with a local master, point Spark at "
        f"this interpreter before the SparkSession is built: os.environ['PYSPARK_PYTHON'] = "
        f"{sys.executable!r} (the conf spark.pyspark.python is not enough there)"
    )


class Job:
    """The barrier job, run in a helper thread so the caller's thread can print and cancel."""

    def __init__(self, session: Any, frame: Any, spec: NodeSpec) -> None:
        self.session = session
        self.frame = frame
        self.spec = spec
        self.tag = f"sparktrain-{spec.run_id}"
        self.rows: list[Any] | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="sparktrain-spark-job", daemon=True)

    def _run(self) -> None:
        fn = _bind(run_node, self.spec)
        try:
            self.session.addTag(self.tag)
            try:
                self.rows = self.frame.mapInArrow(fn, SCHEMA, barrier=True).collect()
            finally:
                self.session.removeTag(self.tag)
        except BaseException as exc:
            self.error = exc

    def cancel(self) -> None:
        """Ask Spark to cancel the job (its tag); the thread ends when Spark has."""
        with contextlib.suppress(Exception):
            self.session.interruptTag(self.tag)


def _bind(fn: Any, spec: NodeSpec) -> Any:
    def task(batches: Any) -> Any:
        return fn(spec, batches)

    return task
