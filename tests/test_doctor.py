"""``sparktrain doctor``: this machine through the real CLI, and a real Spark cluster's slots."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest

from conftest import FAST_JVM
from sparktrain.doctor import run_checks
from sparktrain.doctor.probe import network_verdict, probe_verdict
from sparktrain.doctor.spark_checks import gpu_settings_check
from sparktrain.doctor.storage import nodes_verdict
from sparktrain.doctor.system import shm_check


def _doctor(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "sparktrain", "doctor", *args],
        capture_output=True,
        text=True,
        check=False,
        timeout=180,
        env={**os.environ, **env},
    )


def _line(text: str, name: str) -> str:
    """The line of the text report that shows check ``name``."""
    for line in text.splitlines():
        if line.split()[1:2] == [name]:
            return line
    raise AssertionError(f"no line for {name!r} in:\n{text}")


def test_healthy_here_exit_zero_with_warnings() -> None:
    # GPUs hidden, so the verdict is the same on a CPU runner and on a GPU machine.
    done = _doctor(CUDA_VISIBLE_DEVICES="")
    assert done.returncode == 0, done.stdout + done.stderr
    assert platform.python_version() in _line(done.stdout, "python")
    assert metadata.version("torch") in _line(done.stdout, "torch")
    gpus = _line(done.stdout, "gpus")
    assert gpus.split()[0] == "WARNING" and "no GPU visible" in gpus
    assert "fix: if you expected GPUs" in done.stdout
    assert _line(done.stdout, "backends").split()[0] == "ok"
    assert "Nothing blocks a launch" in done.stdout


def test_a_build_lock_nobody_holds_is_a_warning_and_build_ops_names_the_ops(
    tmp_path: Path,
) -> None:
    lock = tmp_path / "cpu_adam" / "lock"
    lock.parent.mkdir()
    lock.touch()  # left by a killed build outside sparktrain
    (tmp_path / "fused_adam").mkdir()
    (tmp_path / "fused_adam" / "fused_adam.so").touch()
    done = _doctor("--json", "--cpu", TORCH_EXTENSIONS_DIR=str(tmp_path))
    ops = {c["name"]: c for c in json.loads(done.stdout)["checks"]}["ops"]
    assert ops["verdict"] == "warning" and f"rm {lock}" in ops["found"], ops
    assert ops["fix"].startswith("sparktrain doctor --build-ops")
    assert ops["facts"]["built"] == ["fused_adam"] and ops["facts"]["stale_locks"] == [str(lock)]
    pytest.importorskip("deepspeed")
    done = _doctor("--build-ops", "no_such_op", TORCH_EXTENSIONS_DIR=str(tmp_path))
    assert done.returncode == 2 and "choose from:" in done.stderr and "cpu_adam" in done.stderr
    assert lock.exists()  # nothing is touched before the names are known


def test_json_has_every_check() -> None:
    done = _doctor("--json", "--cpu", "--processes", "2", CUDA_VISIBLE_DEVICES="")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    checks = {c["name"]: c for c in report["checks"]}
    expected = {"python", "torch", "cuda", "gpus", "backends", "shm", "ports", "ops", "java"}
    engines = ("pyspark", "mlflow", "deepspeed", "ray", "tensorflow", "optuna")
    expected |= {f"extra.{n}" for n in engines}
    assert expected | {"launch.local"} == set(checks)
    assert report["exit_code"] == 0 and report["counts"]["error"] == 0
    assert checks["gpus"]["verdict"] == "info" and checks["gpus"]["facts"]["count"] == 0
    assert checks["backends"]["facts"]["gloo"] is True
    assert checks["shm"]["facts"]["bytes"] == _shm_bytes()
    assert checks["launch.local"]["facts"]["backend"] == "gloo"
    assert checks["extra.pyspark"]["facts"]["version"] == metadata.version("pyspark")


def _shm_bytes() -> int:
    stat = os.statvfs("/dev/shm")
    return stat.f_frsize * stat.f_blocks


def test_gpu_launch_without_gpus_blocks() -> None:
    # A GPU launch where CUDA_VISIBLE_DEVICES hides every GPU: what the launch would refuse.
    done = _doctor("--gpu", "--processes", "2", CUDA_VISIBLE_DEVICES="")
    assert done.returncode == 1, done.stdout
    line = _line(done.stdout, "launch.local")
    assert line.split()[0] == "ERROR" and "no GPU is visible" in line
    assert "fix: pass use_gpu=False (--cpu)" in done.stdout
    assert "block a launch (gpus, launch.local)" in done.stdout


def test_too_few_spark_slots_blocks_through_the_cli() -> None:
    # local[1] has one task slot; a barrier stage of 2 CPU tasks cannot run there.
    done = _doctor(
        "--spark-master", "local[1]", "--processes", "2", "--cpu",
        "--spark-conf", f"spark.driver.extraJavaOptions={FAST_JVM}",
        "--spark-conf", "spark.driver.host=127.0.0.1",
        "--spark-conf", "spark.driver.bindAddress=127.0.0.1",
    )  # fmt: skip
    assert done.returncode == 1, done.stdout + done.stderr
    assert _line(done.stdout, "spark.slots").split()[:3] == ["ok", "spark.slots", "1"]
    barrier = _line(done.stdout, "spark.barrier")
    assert barrier.split()[0] == "ERROR" and "1 task slot(s)" in barrier
    assert "fix: pass 1 processes or fewer (--processes 1)" in done.stdout
    assert "a master of local[2] or more" in done.stdout


def test_bad_options_exit_two() -> None:
    assert _doctor("--processes", "0").returncode == 2
    assert _doctor("--spark-conf", "novalue").returncode == 2


def test_too_few_slots_on_the_session(spark: Any) -> None:
    # local-cluster[2,1,1024] with one GPU per task: two task slots.
    report = run_checks(spark, processes=8)
    assert report.exit_code == 1
    barrier = report.get("spark.barrier")
    assert barrier.verdict == "error"
    assert "needs 8 barrier tasks" in barrier.found and "2 task slot(s)" in barrier.found
    assert "--processes 2" in barrier.fix and "spark.executor.instances" in barrier.fix
    assert report.get("spark.slots").facts["slots"] == 2
    assert report.get("spark.executors").facts["executors"] == 2
    gpu = report.get("spark.gpu")
    assert gpu.verdict == "ok" and gpu.facts["task_amount"] == "1"
    assert "spark.barrier" in str(report) and "fix: pass 2 processes" in str(report)

    fits = run_checks(spark, processes=2)
    assert fits.get("spark.barrier").verdict == "ok"
    assert fits.get("spark.barrier").facts["device"] == "cuda"
    assert fits.exit_code == 0, str(fits)


def test_active_session_is_examined(spark: Any) -> None:
    report = run_checks(processes=2, use_gpu=False)
    assert report.get("spark.session").facts["master"] == "local-cluster[2,1,1024]"
    assert report.get("spark.barrier").facts["device"] == "cpu"
    alone = run_checks(processes=2, use_gpu=False, use_active_session=False)
    assert "spark.session" not in {c.name for c in alone.checks}
    assert alone.get("launch.local").verdict in ("ok", "warning")


class _Conf:
    def __init__(self, values: dict[str, str]) -> None:
        self.values = values

    def get(self, key: str, default: str | None = None) -> str | None:
        return self.values.get(key, default)


class _Session:
    """Only the ``conf`` of a session: the GPU settings check reads nothing else."""

    def __init__(self, **values: str) -> None:
        self.conf = _Conf({k.replace("_", "."): v for k, v in values.items()})


@pytest.mark.parametrize(
    ("conf", "use_gpu", "verdict", "words"),
    [
        ({}, None, "info", "run on CPU"),
        ({}, True, "error", "spark.task.resource.gpu.amount=1"),
        ({"spark_task_resource_gpu_amount": "0.5"}, None, "error", "whole number"),
        (
            {"spark_task_resource_gpu_amount": "1", "spark_executor_resource_gpu_amount": "4"},
            None,
            "warning",
            "discoveryScript",
        ),
    ],
)
def test_gpu_settings(conf: dict[str, str], use_gpu: bool | None, verdict: str, words: str) -> None:
    check = gpu_settings_check(_Session(**conf), use_gpu=use_gpu)
    assert check.verdict == verdict
    assert words in check.found + check.fix


def test_small_shm_warns_with_the_fix() -> None:
    small = shm_check(64 << 20)
    assert small.verdict == "warning" and "--shm-size" in small.fix
    assert "batches of up to 11 MB" in small.found  # 64 MB over 2 workers x 3 batches
    assert small.facts["torch_batch_bytes"] == (64 << 20) // 6
    assert shm_check(8 << 30).verdict == "ok"
    assert shm_check(None).verdict == "warning"


def test_import_is_cheap() -> None:
    code = (
        "import sys, sparktrain.doctor; "
        "print([m for m in ('torch', 'pyspark') if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_probe_runs_a_real_barrier_stage(spark: Any, tmp_path: Path) -> None:
    report = run_checks(spark, processes=2, probe=True, checkpoint_dir=tmp_path / "ckpt")
    probe = report.get("spark.probe")
    assert probe.verdict == "ok", probe.found
    rows = probe.facts["rows"]
    assert len(rows) == 2
    assert {r["executable"] for r in rows} == {sys.executable}
    assert {r["torch"] for r in rows} == {metadata.version("torch")}
    network = report.get("spark.network")  # local-cluster: every task on this host
    assert network.verdict == "ok" and network.facts["addresses"] == ["127.0.0.1"], network.found
    assert network.facts["interfaces"] == {"127.0.0.1": "lo"}
    written = report.get("checkpoint.nodes")  # each task wrote, read and removed its probe
    assert written.verdict == "ok" and "every task (2)" in written.found, written.found
    assert report.get("checkpoint.here").verdict == "ok"
    assert list((tmp_path / "ckpt").iterdir()) == []
    skipped = run_checks(spark, processes=8, probe=True).get("spark.probe")
    assert skipped.verdict == "info" and "not run" in skipped.found


def test_network_verdict_names_a_host_name_on_loopback_across_hosts() -> None:
    row = {"host": "vm", "resolved": "127.0.0.1", "address": "10.0.0.2", "interface": "eth1"}
    other = {**row, "address": "10.0.0.3"}
    check = network_verdict([row, other])
    assert check.verdict == "warning" and "host name vm resolves to 127.0.0.1" in check.found
    assert "remote=[127.0.0.1]" in check.found and check.fix.startswith("map vm to 10.0.0.2")
    assert network_verdict([row]).verdict == "ok"  # one host: nothing crosses a network
    routed = [{**row, "resolved": "10.0.0.2"}, {**other, "resolved": "10.0.0.3"}]
    assert network_verdict(routed).verdict == "ok"
    natted = network_verdict([routed[0], {**routed[1], "interface": ""}])
    assert natted.verdict == "warning" and "GLOO_SOCKET_IFNAME" in natted.fix


def test_a_checkpoint_directory_no_process_can_write_is_an_error_naming_it(
    tmp_path: Path,
) -> None:
    blocked = tmp_path / "a-file"
    blocked.write_text("not a folder")
    done = _doctor("--cpu", "--checkpoint-dir", str(blocked / "ckpt"))
    assert done.returncode == 1, done.stdout + done.stderr
    line = _line(done.stdout, "checkpoint.here")
    assert f"cannot write checkpoints to {blocked / 'ckpt'}" in line and "NotADirectory" in line
    report = run_checks(checkpoint_dir=tmp_path / "ok", use_active_session=False)
    assert report.get("checkpoint.here").verdict == "ok"
    assert list((tmp_path / "ok").iterdir()) == []  # the probe and its folder are removed
    rows = [{"host": "a", "checkpoint": ""}, {"host": "b", "checkpoint": "PermissionError: x"}]
    nodes = nodes_verdict("/mnt/ckpt", rows)
    assert nodes.verdict == "error" and "1 of 2 task(s)" in nodes.found and "on b" in nodes.found


def test_probe_verdict_names_the_missing_package() -> None:
    good = {"host": "h1", "python": "3.11.7", "executable": "/venv/bin/python"}
    good |= {"sparktrain": "0.1.0", "torch": "2.13.0"}
    bad = {**good, "host": "h2", "executable": "/usr/bin/python3", "torch": "error: not installed"}
    check = probe_verdict([good, bad], driver_python="3.11.7")
    assert check.verdict == "error"
    assert "1 of 2" in check.found and "/usr/bin/python3" in check.found
    assert "PYSPARK_PYTHON" in check.fix
    older = probe_verdict([{**good, "python": "3.10.4"}], driver_python="3.11.7")
    assert older.verdict == "error" and "Python 3.10.4" in older.found
    assert probe_verdict([good, good], driver_python="3.11.2").verdict == "ok"
