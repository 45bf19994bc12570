"""Ray on Spark's job server (the autoscaler's way to start and end worker nodes as Spark jobs):
on loopback, refusing every request without the cluster's job server token, and still serving
the autoscaler and the Spark tasks that hold it; then closed, with Ray as it was."""

from __future__ import annotations

import http.client
import inspect
import json
import re
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import alive

pytestmark = pytest.mark.spark

#: The endpoints of Ray's handler (``handle_POST``) in Ray 2.60; any new one is read from Ray.
ENDPOINTS = {
    "create_node", "check_node_id_availability", "terminate_node", "notify_task_launched",
    "query_task_status", "query_nodes", "set_node_tags", "query_last_worker_err",
}  # fmt: skip
#: Where the test puts the head node: a loopback address other than the one the server should
#: take, so that "on loopback" is told apart from "on the head node's address" with no traffic
#: leaving this machine (the Spark fixture's driver host is 127.0.0.1 itself).
HEAD_IP = "127.0.0.2"
WRONG = [{}, {"Authorization": "Bearer " + "0" * 64}, {"Authorization": "Basic cmF5OnJheQ=="}]


def endpoints() -> list[str]:
    """Every endpoint of the installed Ray's job server handler."""
    from ray.autoscaler._private.spark.spark_job_server import SparkJobServerRequestHandler

    source = inspect.getsource(SparkJobServerRequestHandler.handle_POST)
    found = set(re.findall(r'path_parts\[0\] == "(\w+)"', source))
    assert found, "Ray's handler changed: read its endpoints anew"
    return sorted(ENDPOINTS | found)


def ask(
    address: tuple[str, int], method: str, path: str, headers: dict[str, str], body: Any
) -> int:
    """One HTTP request to the job server; its status code."""
    connection = http.client.HTTPConnection(*address, timeout=60)
    try:
        data = None if body is None else json.dumps(body).encode()
        connection.request(method, path, body=data, headers={
            "Content-Type": "application/json", **headers,
        })  # fmt: skip
        return connection.getresponse().status
    finally:
        connection.close()


def _bodies(server: Any) -> dict[str, dict[str, Any]]:
    """Bodies that would act on the cluster's worker node if the server took them."""
    node = server.query_nodes()["nodes"][0]
    group, node_id = node["spark_job_group_id"], node["node_id"]
    acting = {"node_id": node_id, "spark_job_group_id": group, "tags": {"x": "y"}}
    create = {
        "spark_job_group_id": group + "-2", "spark_job_group_desc": "stranger",
        "using_stage_scheduling": False, "ray_head_ip": HEAD_IP, "ray_head_port": 1,
        "ray_temp_dir": "/tmp", "num_cpus_per_node": 1, "num_gpus_per_node": 0,
        "heap_memory_per_node": 10**8, "object_store_memory_per_node": 10**8,
        "worker_node_options": {}, "collect_log_to_path": None, "node_id": 99,
        "node_type": "ray.worker", "tags": {},
    }  # fmt: skip
    return {name: create if name == "create_node" else acting for name in endpoints()}


def _alive_nodes() -> dict[str, bool]:
    """Each alive Ray node's ID, and whether it is the head node."""
    import ray

    return {
        n["NodeID"]: "node:__internal_head__" in n["Resources"] for n in ray.nodes() if n["Alive"]
    }


@pytest.fixture
def head_on_second_loopback(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Ray on Spark takes the head node's address from ``spark.driver.host``: here 127.0.0.2."""
    pytest.importorskip("ray.util.spark")
    from ray.util.spark import cluster_init

    monkeypatch.setattr(cluster_init, "get_spark_application_driver_host", lambda spark: HEAD_IP)
    yield


def test_job_server_on_loopback_refuses_strangers_and_serves_the_cluster(
    spark: object, head_on_second_loopback: None
) -> None:
    import ray
    import requests
    from ray.autoscaler._private.spark import spark_job_server
    from ray.util.spark import cluster_init

    from sparktrain.ray import setup_on_spark

    originals = (cluster_init.requests, cluster_init.AutoscalingCluster)
    start = spark_job_server._start_spark_job_server
    with setup_on_spark(max_worker_nodes=1, num_cpus_worker_node=1, num_gpus_worker_node=0) as c:
        assert c.address.startswith(HEAD_IP + ":")  # the head node took the address given
        server = cluster_init._active_ray_cluster.spark_job_server
        host, port = server.server_address[:2]
        assert host == "127.0.0.1"  # not the head node's address
        with socket.socket() as probe:
            assert probe.connect_ex((HEAD_IP, port)) != 0  # nothing listens there
        running = {p for p, _ in c.processes()}
        assert c._job_server is not None
        token = c._job_server.token

        # The legitimate clients hold the token: the autoscaler created the worker node, and
        # its Spark task reported it started (only /notify_task_launched marks it running).
        before = server.query_nodes()
        assert [n["status"] for n in before["nodes"]] == ["running"]
        nodes = _alive_nodes()
        assert sorted(nodes.values()) == [False, True]  # the head and one worker node
        worker = next(node for node, head in nodes.items() if not head)
        good = {"Authorization": "Bearer " + token}
        assert ask((host, port), "POST", "/query_nodes", good, {}) == 200  # the right token

        # Strangers: every endpoint, every method, no token or a wrong one: 401, nothing done.
        refused = []
        for path, body in _bodies(server).items():
            for headers in WRONG:
                refused.append(ask((host, port), "POST", "/" + path, headers, body))
        for method in ("GET", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD", "BREW"):
            for headers in WRONG:
                refused.append(ask((host, port), method, "/query_nodes", headers, None))
        assert set(refused) == {401} and len(refused) == (len(endpoints()) + 7) * len(WRONG)
        assert server.query_nodes() == before
        assert _alive_nodes() == nodes  # the worker node lives on

        # The cluster still works: a task runs on the worker node.
        def node_of_task() -> str:  # local: pickled by value, as Ray's workers lack tests/
            return str(ray.get_runtime_context().get_node_id())

        on = ray.get(ray.remote(num_cpus=1)(node_of_task).remote(), timeout=120)
        assert on == worker
    # Shut down: the server's socket closed, Ray's module as it was, the token's file gone.
    with socket.socket() as probe:
        assert probe.connect_ex(("127.0.0.1", port)) != 0
    assert (cluster_init.requests, cluster_init.AutoscalingCluster) == originals
    assert cluster_init.requests is requests
    assert spark_job_server._start_spark_job_server is start
    assert not Path(c._job_server.token_path).exists()
    assert [pid for pid in running if alive(pid)] == []


def test_which_masters_get_loopback_and_what_a_token_is() -> None:
    pytest.importorskip("ray.util.spark")
    from sparktrain.ray.job_server import authorized, single_host

    for master in ("local", "local[2]", "local[*]", "LOCAL[4, 2]", "local-cluster[2,1,1024]"):
        assert single_host(master), master
    for master in ("spark://h:7077", "yarn", "k8s://https://h:443", "mesos://h:5050", ""):
        assert not single_host(master), master
    token = "ab" * 32
    assert authorized("Bearer " + token, token)
    for header in (None, "", token, "Bearer ", "Bearer " + token[:-1], "bearer " + token,
                   "Bearer " + token + "0", "Bearer " + "é" * 64):  # fmt: skip
        assert not authorized(header, token), header


TASK_SIDE = """
import json, pickle, sys
sys.modules["sparktrain"] = None  # an executor without sparktrain: importing it fails
import requests
sent = []
requests.post = lambda url, **kw: sent.append([url, kw])
client = pickle.loads(sys.stdin.buffer.read())
client.post(url="http://127.0.0.2:9555/notify_task_launched", json={"a": 1})
client.post(url="http://127.0.0.1:9556/elsewhere", json={})
client.post(url="http://127.0.0.3:9555/elsewhere", json={}, headers={"X": "1"})
print(json.dumps(sent))
"""


def test_the_task_side_client_carries_the_token_to_the_real_address_only() -> None:
    """What the Spark tasks post with, as pickled with their function: by value (it works where
    sparktrain is not installed), sending the token only to the job server, at its address."""
    pytest.importorskip("ray.util.spark")
    from pyspark import cloudpickle as spark_cloudpickle

    from sparktrain.ray import job_server

    client = job_server.token_requests("t0ken", {HEAD_IP, "127.0.0.1"}, 9555, "127.0.0.1:9555")
    done = subprocess.run(
        [sys.executable, "-c", TASK_SIDE], input=spark_cloudpickle.dumps(client),
        capture_output=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    assert json.loads(done.stdout.decode().strip().splitlines()[-1]) == [
        ["http://127.0.0.1:9555/notify_task_launched",
         {"json": {"a": 1}, "headers": {"Authorization": "Bearer t0ken"}}],
        ["http://127.0.0.1:9556/elsewhere", {"json": {}}],
        ["http://127.0.0.3:9555/elsewhere", {"json": {}, "headers": {"X": "1"}}],
    ]  # fmt: skip
