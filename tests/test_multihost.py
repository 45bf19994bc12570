"""Runs across hosts with their own addresses: a bridge and two network namespaces (tests/hosts.py).

The host name resolves to loopback in every namespace, as on many real hosts, which is what made
gloo announce ``127.0.0.1`` and runs across hosts fail. A Spark standalone master on the bridge
with a worker in each namespace, and a Ray head on the bridge with a Ray node in each, run real
launches; each driver is a subprocess (a process holds one SparkContext, and the suite's own
Spark session is another). No test sets ``GLOO_SOCKET_IFNAME``. Skipped, with the reason, where
namespaces cannot be made (not root, no iproute2).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import hosts as nshosts
from conftest import FAST_JVM, free_port, wait_gone

WHY_NOT = nshosts.available()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(WHY_NOT is not None, reason=str(WHY_NOT))]
pytest.importorskip("pyspark")
pytest.importorskip("pyarrow")

TESTS = Path(__file__).parent
ROWS = 200


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[nshosts.Hosts]:
    """Two hosts in namespaces, the driver's host on the bridge."""
    with nshosts.hosts(2) as made:
        yield made


@pytest.fixture(scope="module")
def spark_master(cluster: nshosts.Hosts, tmp_path_factory: pytest.TempPathFactory) -> str:
    """A standalone master on the bridge and one worker (1 core) on each host; its URL."""
    import pyspark

    work = tmp_path_factory.mktemp("spark-hosts")
    spark_class = str(Path(pyspark.__file__).parent / "bin" / "spark-class")
    env = dict(os.environ, SPARK_WORKER_OPTS=FAST_JVM, SPARK_DAEMON_JAVA_OPTS=FAST_JVM)
    env["SPARK_LOG_DIR"] = str(work / "logs")
    port = free_port()
    master = ["org.apache.spark.deploy.master.Master", "--host", cluster.driver]
    cluster.start(
        [spark_class, *master, "--port", str(port), "--webui-port", "0"],
        log=work / "master.log", env=dict(env, SPARK_LOCAL_IP=cluster.driver),
    )  # fmt: skip
    nshosts.wait_for_port(cluster.driver, port)
    url = f"spark://{cluster.driver}:{port}"
    for host, address in enumerate(cluster.addresses):
        worker = ["org.apache.spark.deploy.worker.Worker", "--host", address, "--cores", "1"]
        cluster.run(
            host, [spark_class, *worker, "--memory", "1g", "--webui-port", "0", url],
            log=work / f"worker{host}.log",
            env=dict(env, SPARK_LOCAL_IP=address, SPARK_WORKER_DIR=str(work / f"worker{host}")),
        )  # fmt: skip
    return url


@pytest.fixture(scope="module")
def ray_head(cluster: nshosts.Hosts, tmp_path_factory: pytest.TempPathFactory) -> str:
    """A Ray head on the bridge (no CPU for actors) and one Ray node (1 CPU) on each host."""
    pytest.importorskip("ray")
    work = tmp_path_factory.mktemp("ray-hosts")
    ray = str(Path(sys.executable).parent / "ray")
    port = free_port()  # below Ray's worker port range
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", RAY_AUTH_MODE="disabled")
    common = ["--num-cpus", "0", "--include-dashboard", "false", "--disable-usage-stats"]
    head = [ray, "start", "--head", "--block", "--node-ip-address", cluster.driver]
    cluster.start([*head, "--port", str(port), *common], log=work / "head.log", env=env)
    nshosts.wait_for_port(cluster.driver, port)
    address = f"{cluster.driver}:{port}"
    for host in range(len(cluster.addresses)):  # one at a time: two at once time out here
        _start_ray_node(cluster, host, address, work, env)
        _wait_ray_nodes(address, host + 2, work)
    _RAY_NODES[address] = (work, env)
    return address


#: Each Ray head's work folder and environment, to start a node again (see _renew_ray_node).
_RAY_NODES: dict[str, tuple[Path, dict[str, str]]] = {}


def _start_ray_node(
    cluster: nshosts.Hosts, host: int, address: str, work: Path, env: dict[str, str]
) -> None:
    ray = str(Path(sys.executable).parent / "ray")
    ip = cluster.addresses[host]
    node = [ray, "start", "--block", "--address", address, "--node-ip-address", ip]
    log = work / f"node{host}-{len(list(work.glob(f'node{host}*.log')))}.log"
    cluster.run(host, [*node, "--num-cpus", "1"], log=log, env=env)


def _renew_ray_node(cluster: nshosts.Hosts, address: str, host: int) -> None:
    """Give ``host`` a new Ray node. An earlier test that cut the host off leaves its node
    half-dead: Ray's health checks may declare it dead tens of seconds after the link is back (its
    raylet then exits), in the middle of the next test. So the node is killed, seen dead, and
    started again: the test starts from a whole cluster, however long the one before it took."""
    work, env = _RAY_NODES[address]
    ip = cluster.addresses[host]
    subprocess.run(["pkill", "-KILL", "-f", f"node.ip.address.{ip}( |$)"], check=False)
    _wait_alive(address, ip, alive=False)
    _start_ray_node(cluster, host, address, work, env)
    _wait_alive(address, ip, alive=True)


def _wait_alive(address: str, ip: str, *, alive: bool) -> None:
    """Wait until Ray counts a node at ``ip`` alive (or none), for at most 300 s (loaded: 175 s)."""
    code = (
        "import ray, sys, time; ray.init(address=sys.argv[1], log_to_driver=False)\n"
        "deadline = time.monotonic() + 300\n"
        "while any(n['Alive'] and n['NodeManagerAddress'] == sys.argv[2] for n in ray.nodes())"
        " != (sys.argv[3] == '1'):\n"
        "    assert time.monotonic() < deadline, ray.nodes()\n"
        "    time.sleep(0.5)\n"
    )
    subprocess.run(
        [sys.executable, "-c", code, address, ip, "1" if alive else "0"], check=True,
        timeout=360, capture_output=True, env=dict(os.environ, RAY_AUTH_MODE="disabled"),
    )  # fmt: skip


def _wait_ray_nodes(address: str, count: int, work: Path) -> None:
    code = (
        "import ray, sys, time; ray.init(address=sys.argv[1], log_to_driver=False); "
        "deadline = time.monotonic() + 300\n"
        "while sum(n['Alive'] for n in ray.nodes()) < int(sys.argv[2]):\n"
        "    assert time.monotonic() < deadline, ray.nodes()\n"
        "    time.sleep(0.5)\n"
    )
    subprocess.run(
        [sys.executable, "-c", code, address, str(count)], check=True, timeout=360,
        env=dict(os.environ, RAY_AUTH_MODE="disabled"), capture_output=True,
    )  # fmt: skip


def _drive(script: str, *args: str, timeout: float = 600) -> tuple[dict, str]:
    """Run a driver script (in this namespace); what it printed after ``RESULT``, its stderr."""
    done = subprocess.run(
        [sys.executable, "-c", script, str(TESTS), *args],
        capture_output=True, text=True, timeout=timeout, check=False,
        env=dict(os.environ, PYSPARK_PYTHON=sys.executable, RAY_AUTH_MODE="disabled"),
    )  # fmt: skip
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, f"exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    return json.loads(lines[-1][len("RESULT ") :]), done.stderr


SPARK_SESSION = r"""
import json, os, sys, time
tests, url, driver = sys.argv[1], sys.argv[2], sys.argv[3]
sys.path.insert(0, tests)
from pyspark.sql import SparkSession
fast = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"
spark = (
    SparkSession.builder.master(url)
    .config("spark.executor.cores", "1").config("spark.executor.memory", "512m")
    .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
    .config("spark.driver.host", driver).config("spark.driver.bindAddress", driver)
    .config("spark.driver.extraJavaOptions", fast).config("spark.executor.extraJavaOptions", fast)
    .config("spark.executorEnv.PYSPARK_PYTHON", sys.executable)
    .config("spark.executorEnv.PYTHONPATH", os.pathsep.join(p for p in sys.path if p))
    .getOrCreate()
)
spark.sparkContext.setLogLevel("ERROR")
deadline = time.monotonic() + 300
while spark.sparkContext._jsc.sc().getExecutorMemoryStatus().size() < 3:
    assert time.monotonic() < deadline, "two executors did not register"
    time.sleep(0.3)
"""

DDP_ON_SPARK = (
    SPARK_SESSION
    + r"""
import test_multihost as m
from sparktrain import TorchDistributor, TrainingFailedError, launch
from sparktrain.doctor import run_checks
out = {}
result = launch(m.ddp_step, num_processes=2, backend="spark", use_gpu=False, return_all=True,
                timeout=180)
out["ddp"] = [result.return_values[r] for r in sorted(result.return_values)]
network = run_checks(spark, processes=2, probe=True).get("spark.network")
out["doctor"] = {"verdict": network.verdict, "found": network.found, "fix": network.fix}
try:  # the trap itself, forced: gloo on loopback. Not a lost node: not rescaled.
    TorchDistributor(2, local_mode=False, use_gpu=False, min_processes=1,
                     env={"GLOO_SOCKET_IFNAME": "lo"}, progress=False).run(m.ddp_step)
except TrainingFailedError as error:
    out["trap"] = {"attempts": error.attempts, "text": str(error)}
print("RESULT " + json.dumps(out))
"""
)


def ddp_step() -> dict:
    """One DDP step across the hosts: where each rank ran, its device's interface, the sum."""
    import socket

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 1))
    model(torch.full((1, 2), float(dist.get_rank() + 1))).sum().backward()
    total = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(total)
    return {
        "rank": dist.get_rank(),
        "host": socket.gethostname(),
        "master": os.environ["MASTER_ADDR"],
        "ifname": os.environ.get("GLOO_SOCKET_IFNAME"),
        "sum": total.item(),
        "grad": model.module.weight.grad.tolist(),
    }


def test_ddp_across_hosts_on_spark_with_no_variable_set(
    cluster: nshosts.Hosts, spark_master: str
) -> None:
    out, stderr = _drive(DDP_ON_SPARK, spark_master, cluster.driver)
    first, second = out["ddp"]
    assert first["sum"] == second["sum"] == 3.0
    assert first["grad"] == second["grad"] == [[1.5, 1.5]]  # synchronised across hosts
    assert first["master"] in cluster.addresses and first["ifname"] == second["ifname"] == "eth1"
    doctor = out["doctor"]
    assert doctor["verdict"] == "warning" and "resolves to 127.0.0.1 (loopback)" in doctor["found"]
    assert doctor["fix"].startswith("map ")
    trap = out["trap"]
    assert trap["attempts"] == 2  # once more at the same size, then named: no rescale loop
    assert "remote=[127.0.0.1]" in trap["text"] or "127.0.0.1" in trap["text"]
    assert "GLOO_SOCKET_IFNAME" in trap["text"] and "hint:" in trap["text"]
    assert "the network's set-up, not a lost node" in stderr


RAY_DDP = r"""
import json, sys
tests, address = sys.argv[1], sys.argv[2]
sys.path.insert(0, tests)
import cloudpickle, ray
import test_multihost as m
cloudpickle.register_pickle_by_value(m)
ray.init(address=address, log_to_driver=False)
from sparktrain import launch
result = launch(m.ddp_step, num_processes=2, backend="ray", use_gpu=False, return_all=True,
                timeout=180)
print("RESULT " + json.dumps([result.return_values[r] for r in sorted(result.return_values)]))
"""


def test_ddp_across_hosts_on_ray_with_no_variable_set(
    cluster: nshosts.Hosts, ray_head: str
) -> None:
    values, _ = _drive(RAY_DDP, ray_head)
    assert [v["sum"] for v in values] == [3.0, 3.0]
    assert values[0]["grad"] == values[1]["grad"] == [[1.5, 1.5]]
    assert {v["master"] for v in values} <= set(cluster.addresses)
    assert [v["ifname"] for v in values] == ["eth1", "eth1"]


def train_and_note_pid(pids: str, train: Callable[..., dict], *args: object) -> dict:
    """``train(*args)`` (``test_elastic.elastic_train``), after noting this rank's PID."""
    Path(pids, f"{os.getpid()}").write_text(os.environ.get("MASTER_ADDR", ""))
    return train(*args)


RAY_SESSION = r"""
import json, os, sys, time
tests, address = sys.argv[1], sys.argv[2]
sys.path.insert(0, tests)
import ray
ray.init(address=address, log_to_driver=False)
backend = "ray"
"""

PARTITION = r"""
import subprocess, threading
from pathlib import Path
import cloudpickle
import test_elastic as t
import test_multihost as m
cloudpickle.register_pickle_by_value(m)
cloudpickle.register_pickle_by_value(t)  # Ray's workers cannot import tests/
from sparktrain import launch
work, link = Path(sys.argv[-2]), sys.argv[-1]
data_dir = t.write_rows(work / "data", rows=200)
logs, pids = work / "logs", work / "pids"
logs.mkdir(); pids.mkdir()
cut = {}

def alive(pid):
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in "ZX"
    except OSError:
        return False

def watch(ranks):  # when the first attempt's ranks are all gone, both hosts'
    while any(map(alive, ranks)):
        time.sleep(0.1)
    cut["gone"] = time.time() - cut["at"]

def on_report(rank, record):
    world, step = (record.get("metrics") or {}).get("world"), record.get("step")
    if rank == 0 and world == 2 and step == 8 and not cut:
        cut["at"] = time.time()
        cut["pids"] = [int(p.name) for p in pids.iterdir()]
        subprocess.run(["ip", "link", "set", link, "down"], check=True)
        threading.Thread(target=watch, args=(cut["pids"],), daemon=True).start()

args = (str(pids), t.elastic_train, data_dir, str(work / "ckpt"), str(logs), 0.3)
result = launch(m.train_and_note_pid, args,
                num_processes=2, backend=backend, use_gpu=False, min_processes=1,
                on_report=on_report, progress=False, timeout=400)
out = {
    "rescales": [[r.cause, r.old_world_size, r.new_world_size, r.at - cut["at"], r.detail]
                 for r in result.rescales],
    "ids": sorted(t.committed_ids(logs)), "cut_pids": cut["pids"], "gone": cut.get("gone"),
    "world": result.world_size,
}
print("RESULT " + json.dumps(out))
"""


def test_a_partitioned_host_is_lost_in_seconds_and_its_ranks_stop_by_themselves(
    cluster: nshosts.Hosts, spark_master: str, tmp_path: Path
) -> None:
    """The link of one host goes down mid-epoch: the run shrinks within 20 s and trains on every
    row exactly once; the cut-off host's ranks stop by themselves within 20 s."""
    script = SPARK_SESSION + "backend = 'spark'\n" + PARTITION
    _partitioned(cluster, script, [spark_master, cluster.driver], tmp_path)


def test_a_partitioned_host_is_lost_in_seconds_on_ray(
    cluster: nshosts.Hosts, ray_head: str, tmp_path: Path
) -> None:
    """The same on Ray, which counts the cut-off node alive for tens of seconds more: it is left
    out of the capacity and of the next placement."""
    _renew_ray_node(cluster, ray_head, 1)  # the host the Spark test before cut off
    _partitioned(cluster, RAY_SESSION + PARTITION, [ray_head], tmp_path)


def _partitioned(cluster: nshosts.Hosts, script: str, where: list[str], tmp_path: Path) -> None:
    try:
        out, stderr = _drive(script, *where, str(tmp_path), cluster.links[1])
    finally:
        cluster.heal(1)
    [(cause, old, new, after, detail)] = out["rescales"]
    assert (cause, old, new) == ("lost", 2, 1) and out["world"] == 1
    assert after < 20.0, f"shrank {after:.1f}s after the cut"
    assert "sent nothing for 10s" in detail and cluster.addresses[1] in detail
    assert out["ids"] == list(range(ROWS))  # every row exactly once
    # The cut-off host's rank can be stopped by nobody but its own node: it is unreachable.
    assert out["gone"] is not None and out["gone"] < 20.0, f"ranks gone after {out['gone']}s"
    assert wait_gone(out["cut_pids"], within=1.0) == []
    assert "resumed on 1 rank(s) (was 2)" in stderr
