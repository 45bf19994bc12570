"""Shared fixtures: process hygiene and helpers for real multi-process runs."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"


def alive(pid: int) -> bool:
    """Whether ``pid`` is a live (non-zombie) process."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            state = stat.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def wait_gone(pids: Iterable[int], within: float = 10.0) -> list[int]:
    """Wait until none of ``pids`` is alive; return those still alive after ``within`` seconds."""
    deadline = time.monotonic() + within
    left = [p for p in pids if alive(p)]
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = [p for p in left if alive(p)]
    return left


def descendants(pid: int) -> set[int]:
    """Every live descendant of ``pid``."""
    import psutil

    try:
        return {c.pid for c in psutil.Process(pid).children(recursive=True)}
    except psutil.NoSuchProcess:
        return set()


_LONG_LIVED = (
    "java",
    "pyspark.daemon",
    "pyspark.worker",
    "sparktrain.node.forkserver",
    "ray::",  # Ray's workers and agents, reused by Ray (a cluster fixture stops them at its end)
    "site-packages/ray/",
    "bin/ray start",
)


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _parent(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return int(stat.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return 0


def _leaked(pid: int) -> bool:
    """A rank (a child of a fork server), or a process that nothing of ours keeps on purpose.

    Spark's JVMs, its reused Python workers, Ray's processes and idle fork servers live on by
    design.
    """
    if "sparktrain.node.forkserver" in _cmdline(_parent(pid)):
        return True
    return not any(name in _cmdline(pid) for name in _LONG_LIVED)


#: Tests in these files share a Ray cluster or start one (two at once would fight for the cores
#: and Ray's memory): one pytest-xdist worker runs them all, one after the other.
_RAY_FILES = {
    "test_ray.py", "test_ray_job_server.py", "test_ray_lifecycle.py", "test_elastic_ray.py",
    "test_inplace_ray.py", "test_multihost.py",
}  # fmt: skip
_RAY_NOTEBOOKS = ("09_", "14_", "16_")


def _worker_group(item: pytest.Item) -> str | None:
    """The worker group of a test: ``spark`` for those of the one Spark session (and the Spark
    Connect server), ``ray`` for Ray's; ``None`` runs in any worker."""
    names = getattr(item, "fixturenames", ())
    if "spark" in names or "connect_server" in names:
        return "spark"
    path = Path(str(item.fspath))
    if path.name in _RAY_FILES:
        return "ray"
    if path.name == "test_notebooks.py" and any(f"[{n}" in item.name for n in _RAY_NOTEBOOKS):
        return "ray"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-xdist (``-n 2 --dist loadgroup``, the default of this project), keep one
    Spark session and one Ray cluster per run: the tests that need them go to one worker."""
    if not config.pluginmanager.hasplugin("xdist"):
        return
    for item in items:
        group = _worker_group(item)
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))


@pytest.fixture(autouse=True)
def no_leaked_ranks() -> Iterator[None]:
    """Fail a test that leaves a rank, or any unexpected process, alive."""
    before = descendants(os.getpid())
    yield
    new = descendants(os.getpid()) - before
    still = wait_gone([p for p in new if alive(p) and _leaked(p)], within=5.0)
    assert not still, f"processes left running after the test: {[_cmdline(p) for p in still]}"


def pytest_sessionstart(session: pytest.Session) -> None:
    """Build DeepSpeed's start-up op once, before any test times a launch (as a user would).

    It goes where the ranks look (``TORCH_EXTENSIONS_DIR``, an empty folder in CI), through
    ``sparktrain doctor --build-ops``; skipped when DeepSpeed is absent or the op is built. A
    session hook, not a fixture: a fixture's set-up counts against the first test's timeout,
    and on a loaded machine the build took longer than that (every test then failed). Under
    pytest-xdist the controller builds it before it starts the workers, which find it built.
    """
    import importlib.util
    import subprocess

    if importlib.util.find_spec("deepspeed") is None:
        return
    from sparktrain.doctor.ops import STARTUP_OPS, ops_check

    found = ops_check()
    if set(STARTUP_OPS["cpu"]) <= set(found.facts.get("built", ())) and found.verdict == "ok":
        return
    command = [sys.executable, "-m", "sparktrain", "doctor", "--build-ops", "--cpu"]
    done = subprocess.run(command, check=False, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        pytest.exit(f"{command} failed:\n{done.stdout}\n{done.stderr}", returncode=1)


@pytest.fixture
def examples_on_path(monkeypatch: pytest.MonkeyPatch) -> Path:
    """Put ``examples/`` on ``sys.path`` (the ranks inherit it)."""
    monkeypatch.syspath_prepend(str(EXAMPLES))
    return EXAMPLES


def python() -> str:
    """The interpreter running the tests (the ranks' too)."""
    return sys.executable


GPU_DISCOVERY = '#!/bin/sh\necho \'{"name": "gpu", "addresses": ["0", "1"]}\'\n'
#: The executors' CUDA_VISIBLE_DEVICES: Spark's GPU addresses 0 and 1 are these devices.
EXECUTOR_GPUS = "10,11"
FAST_JVM = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"


@pytest.fixture(scope="session")
def spark(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    """One real Spark for the whole run: ``local-cluster[2,1,1024]`` (two executor JVMs) on
    loopback, each executor with two fake GPUs from a discovery script, one GPU per task.

    The executors also have ``CUDA_VISIBLE_DEVICES=10,11`` (as a cluster may set through
    ``spark.executorEnv``): Spark's GPU address *i* is then physical GPU ``10 + i``."""
    pytest.importorskip("pyspark")
    from pyspark.sql import SparkSession

    script = tmp_path_factory.mktemp("spark") / "gpus.sh"
    script.write_text(GPU_DISCOVERY)
    script.chmod(0o755)
    os.environ["PYSPARK_PYTHON"] = sys.executable
    session = (
        SparkSession.builder.master("local-cluster[2,1,1024]")
        .appName("sparktrain-tests")
        .config("spark.executor.memory", "512m")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .config("spark.driver.extraJavaOptions", FAST_JVM)
        .config("spark.executor.extraJavaOptions", FAST_JVM)
        .config("spark.executorEnv.PYSPARK_PYTHON", sys.executable)
        .config("spark.executorEnv.CUDA_VISIBLE_DEVICES", EXECUTOR_GPUS)
        .config("spark.worker.resource.gpu.amount", "2")
        .config("spark.worker.resource.gpu.discoveryScript", str(script))
        .config("spark.executor.resource.gpu.amount", "2")
        .config("spark.executor.resource.gpu.discoveryScript", str(script))
        .config("spark.task.resource.gpu.amount", "1")
        .config("spark.scheduler.barrier.maxConcurrentTasksCheck.interval", "1s")
        .config("spark.scheduler.barrier.maxConcurrentTasksCheck.maxFailures", "2")
        .config("spark.decommission.enabled", "true")  # tests/test_inplace_spark.py
        .getOrCreate()
    )
    session.sparkContext.setLogLevel("ERROR")
    status = session.sparkContext._jsc.sc().getExecutorMemoryStatus()
    deadline = time.monotonic() + 60
    while status.size() < 3 and time.monotonic() < deadline:  # the driver and both executors
        time.sleep(0.2)
        status = session.sparkContext._jsc.sc().getExecutorMemoryStatus()
    try:
        yield session
    finally:
        session.stop()


def free_port() -> int:
    """A free TCP port on loopback."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.fixture(scope="module")
def connect_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A Spark Connect server (its own JVM, ``local[2]``) on loopback; yields its ``sc://`` URL."""
    import signal
    import socket
    import subprocess

    pyspark = pytest.importorskip("pyspark")
    pytest.importorskip("grpc")
    home = Path(pyspark.__file__).parent
    port = free_port()
    log = tmp_path_factory.mktemp("connect") / "server.log"
    env = dict(os.environ, SPARK_HOME=str(home), PYSPARK_PYTHON=sys.executable)
    command = [
        str(home / "bin" / "spark-submit"),
        "--class", "org.apache.spark.sql.connect.service.SparkConnectServer",
        "--master", "local[2]",
        "--conf", "spark.connect.grpc.binding.address=127.0.0.1",
        "--conf", f"spark.connect.grpc.binding.port={port}",
        "--conf", "spark.ui.enabled=false",
        "--conf", "spark.driver.host=127.0.0.1",
        "--conf", "spark.driver.bindAddress=127.0.0.1",
        "--conf", f"spark.driver.extraJavaOptions={FAST_JVM}",
        "spark-internal",
    ]  # fmt: skip
    with log.open("wb") as out:
        server = subprocess.Popen(command, stdout=out, stderr=out, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert server.poll() is None, f"Spark Connect server died: {log.read_text()[-2000:]}"
            assert time.monotonic() < deadline, "Spark Connect server did not start"
            with socket.socket() as probe:
                if probe.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.5)
        yield f"sc://127.0.0.1:{port}"
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real ``mlflow server`` on loopback (SQLite backend, local artifacts); yields its URL."""
    import signal
    import subprocess
    import urllib.request

    pytest.importorskip("mlflow")
    root = tmp_path_factory.mktemp("mlflow")
    port = free_port()
    command = [
        sys.executable, "-m", "mlflow", "server",
        "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
        "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}",
        "--artifacts-destination", str(root / "artifacts"),
    ]  # fmt: skip
    log = root / "server.log"
    with log.open("wb") as out:
        # No background job runners: MLflow 3 starts huey consumers a moment after /health
        # answers, which would show up as processes a test left behind.
        env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
        server = subprocess.Popen(command, stdout=out, stderr=out, start_new_session=True, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert server.poll() is None, f"mlflow server died: {log.read_text()[-2000:]}"
            assert time.monotonic() < deadline, "mlflow server did not start"
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2) as reply:
                    if reply.status == 200:
                        break
            except OSError:
                time.sleep(0.5)
        yield url
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
