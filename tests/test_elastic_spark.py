"""Elastic runs on a real Spark standalone cluster: a master and two workers on loopback.

The session fixture's local-cluster cannot lose a worker, and a process holds one SparkContext,
so the cluster and its driver run in a subprocess (``SCRIPT``), which prints what it saw as
JSON. It starts the master and two workers (each worker in a process group of its own, so that
SIGKILL of the group takes the worker, its executor and the executor's Python workers, as when a
machine is preempted), then through ``TorchDistributor(..., min_processes=...)``:

1. trains with checkpoints; mid-epoch the worker of one executor is killed; the run goes on on
   one executor; a new worker is started, and the next checkpoint once the driver has seen it
   brings the run back to two (the lone rank's checkpoints wait for that, so that a slow
   machine cannot end the epoch first);
2. runs a rank that raises ``ValueError``: not retried elastically;
3. asks for ``min_processes=2`` and loses a worker: a ``CapacityError``, not a wait;
4. with one worker of two up, starts on one executor and grows to two when a worker comes.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import FAST_JVM, free_port

pytest.importorskip("pyspark")
pytest.importorskip("pyarrow")

TESTS = Path(__file__).parent

SCRIPT = r"""
import json, os, signal, socket, subprocess, sys, threading, time
from pathlib import Path

tests, work, fast_jvm, mport = sys.argv[1], Path(sys.argv[2]), sys.argv[3], int(sys.argv[4])
sys.path.insert(0, tests)
import pyspark
from pyspark.sql import SparkSession
import test_elastic as t
from sparktrain import CapacityError, TorchDistributor, TrainingFailedError

spark_class = str(Path(pyspark.__file__).parent / "bin" / "spark-class")
env = dict(os.environ, SPARK_LOCAL_IP="127.0.0.1", SPARK_WORKER_OPTS=fast_jvm,
           SPARK_DAEMON_JAVA_OPTS=fast_jvm, SPARK_LOG_DIR=str(work / "logs"),
           SPARK_WORKER_DIR=str(work / "worker"))
started = []

def daemon(*args):
    log = open(work / f"daemon-{len(started)}.log", "wb")
    proc = subprocess.Popen([spark_class, *args], env=env, start_new_session=True,
                            stdout=log, stderr=subprocess.STDOUT)
    started.append(proc)
    return proc

def worker():
    return daemon("org.apache.spark.deploy.worker.Worker", "--host", "127.0.0.1",
                  "--cores", "1", "--memory", "1g", "--webui-port", "0",
                  f"spark://127.0.0.1:{mport}")

def executors():
    return spark.sparkContext._jsc.sc().getExecutorMemoryStatus().size() - 1

def wait(what, condition, limit=120):
    deadline = time.monotonic() + limit
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.2)

def kill(proc):
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass

out = {}
try:
    daemon("org.apache.spark.deploy.master.Master", "--host", "127.0.0.1",
           "--port", str(mport), "--webui-port", "0")
    def master_up():
        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", mport)) == 0
    wait("the master", master_up)
    workers = [worker(), worker()]
    os.environ["PYSPARK_PYTHON"] = sys.executable
    spark = (
        SparkSession.builder.master(f"spark://127.0.0.1:{mport}")
        .config("spark.executor.cores", "1").config("spark.executor.memory", "512m")
        .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
        .config("spark.driver.host", "127.0.0.1").config("spark.driver.bindAddress", "127.0.0.1")
        .config("spark.driver.extraJavaOptions", fast_jvm)
        .config("spark.executor.extraJavaOptions", fast_jvm)
        .config("spark.executorEnv.PYSPARK_PYTHON", sys.executable)
        .config("spark.executorEnv.PYTHONPATH", os.pathsep.join(p for p in sys.path if p))
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    wait("two executors", lambda: executors() == 2)

    # 1. lose a worker mid-epoch, finish on one, grow back when a new worker comes
    data_dir = t.write_rows(work / "data", rows=200)
    logs = work / "logs-train"
    logs.mkdir()
    events = []

    def on_report(rank, record):
        world, step = (record.get("metrics") or {}).get("world"), record.get("step")
        if rank == 0 and world == 2 and step == 8 and "killed" not in events:
            events.append("killed")
            kill(workers[1])
        elif rank == 0 and world == 1 and step == 12 and "added" not in events:
            events.append("added")
            workers.append(worker())

    value = TorchDistributor(2, local_mode=False, use_gpu=False, min_processes=1,
                             on_report=on_report, progress=False).run(
        t.elastic_train, data_dir, str(work / "ckpt"), str(logs), 0.3, 15)
    starts = sorted(logs.glob("attempt*-start.txt"))
    out["train"] = {
        "value": value, "events": events,
        "starts": [p.read_text() for p in sorted(starts, key=lambda p: int(p.name[7:-10]))],
        "ids": sorted(t.committed_ids(logs)),
    }

    # 2. a ValueError is a bug: not retried elastically
    try:
        TorchDistributor(2, local_mode=False, use_gpu=False, min_processes=1).run(
            t.raises_on_rank_1)
    except TrainingFailedError as error:
        out["bug"] = {"cause": error.cause, "attempts": error.attempts, "text": str(error)}

    # 3. the capacity floor: a loss below min_processes is an error at once
    wait("two executors again", lambda: executors() == 2)
    pids = work / "pids"
    pids.mkdir()

    def killer():
        wait("both ranks", lambda: len(list(pids.iterdir())) == 2)
        kill(workers[-1])

    threading.Thread(target=killer, daemon=True).start()
    try:
        TorchDistributor(2, local_mode=False, use_gpu=False, min_processes=2).run(
            t.sleeps_then_returns, str(pids))
    except CapacityError as error:
        out["floor"] = {"text": str(error),
                        "ranks": [int(p.read_text()) for p in pids.iterdir()]}

    # 4. capacity short at the start: begin on the one executor left, grow when one comes
    wait("one executor", lambda: executors() == 1)
    short = work / "logs-short"
    short.mkdir()
    grown = []

    def grow_at_3(rank, record):
        world, step = (record.get("metrics") or {}).get("world"), record.get("step")
        if rank == 0 and world == 1 and step == 3 and not grown:
            grown.append("added")
            workers.append(worker())

    value = TorchDistributor(2, local_mode=False, use_gpu=False, min_processes=1,
                             on_report=grow_at_3, progress=False).run(
        t.elastic_train, data_dir, str(work / "ckpt-short"), str(short), 0.5, 5)
    starts = sorted(short.glob("attempt*-start.txt"), key=lambda p: int(p.name[7:-10]))
    out["short"] = {"value": value, "grown": grown, "starts": [p.read_text() for p in starts],
                    "ids": sorted(t.committed_ids(short))}
    spark.stop()
finally:
    for proc in started:
        kill(proc)
print("RESULT " + json.dumps(out))
"""


def test_elastic_on_a_standalone_cluster(tmp_path: Path) -> None:
    from conftest import wait_gone

    script = tmp_path / "driver.py"
    script.write_text(SCRIPT)
    work = tmp_path / "work"
    work.mkdir()
    command = [sys.executable, str(script), str(TESTS), str(work), FAST_JVM, str(free_port())]
    proc = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        stdout, stderr = proc.communicate(timeout=420)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, stderr[-4000:]
    out = json.loads(lines[-1][len("RESULT ") :])

    train = out["train"]
    assert train["events"] == ["killed", "added"], stderr[-4000:]
    assert train["ids"] == list(range(200))  # the epoch's rows trained on exactly once
    worlds = [start.split()[1] for start in train["starts"]]
    assert worlds == ["2", "1", "2"]  # lost an executor, went on with one, grew back
    resumed = [int(start.split()[0]) for start in train["starts"]]
    assert resumed[1] == 5 and resumed[2] > 12 and resumed[2] % 5 == 0
    assert train["value"]["world"] == 2 and train["value"]["rescaled"] == [[1, 2]]
    assert "sparktrain: elastic: lost node" in stderr and "(its executor went away; " in stderr
    assert "resumed on 1 rank(s) (was 2) from checkpoint step 5" in stderr

    bug = out["bug"]
    assert bug["cause"] == "training code" and bug["attempts"] == 1
    assert "ValueError: a bug in the training code" in bug["text"]

    floor = out["floor"]
    assert "1 rank(s) can run now" in floor["text"] and "min_processes=2" in floor["text"]
    assert wait_gone(floor["ranks"]) == []

    short = out["short"]
    assert short["grown"] == ["added"], stderr[-4000:]
    assert [start.split()[1] for start in short["starts"]] == ["1", "2"]  # began on one
    assert short["ids"] == list(range(200))  # every row exactly once
    assert short["value"]["world"] == 2 and short["value"]["rescaled"] == [[1, 2]]
    assert "sparktrain: elastic: 2 rank(s) do not fit now (" in stderr
    assert "starting on 1 ranks on 1 node" in stderr
