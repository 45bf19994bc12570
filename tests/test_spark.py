"""The Spark backend on a real local-cluster (two executor JVMs): results, failures, GPUs, data."""

from __future__ import annotations

import contextlib
import os
import sys
import time
from pathlib import Path
from typing import Any

import cloudpickle
import pytest
import torch

from conftest import EXAMPLES, wait_gone
from sparktrain import (
    ClusterConfigError,
    ConfigError,
    TorchDistributor,
    TrainingFailedError,
    launch,
)

pytestmark = pytest.mark.spark

# Executors do not have tests/ or examples/ on their path: ship these modules by value, as a
# notebook's functions are.
cloudpickle.register_pickle_by_value(sys.modules[__name__])
sys.path.insert(0, str(EXAMPLES))
import train_mlp  # noqa: E402

cloudpickle.register_pickle_by_value(train_mlp)


def _tagged_train(epochs: int) -> torch.nn.Module:
    model = train_mlp.train_fn(epochs=epochs)
    model.module.trained_on_rank = int(os.environ["RANK"])
    model.module.pid = os.getpid()
    return model


def test_seed_mlp_on_two_executors(spark: object, capfd: pytest.CaptureFixture[str]) -> None:
    result = launch(
        _tagged_train, (2,), num_processes=2, use_gpu=False, backend="spark", return_all=True
    )
    models = result.return_values
    assert models[0].trained_on_rank == 0 and models[1].trained_on_rank == 1
    for p0, p1 in zip(models[0].parameters(), models[1].parameters(), strict=True):
        assert torch.equal(p0, p1)
    data = train_mlp.make_dataset()
    assert train_mlp.mean_loss(models[0], data) < 0.5 * train_mlp.mean_loss(
        train_mlp.make_model(), data
    )
    assert [node.ranks for node in result.nodes] == [(0,), (1,)]
    out = capfd.readouterr().out
    assert "[rank 0 127.0.0.1] epoch 0 loss" in out and "[rank 1 127.0.0.1] epoch 1 loss" in out
    assert wait_gone([models[0].pid, models[1].pid]) == []


def test_distributor_returns_rank_zeros_value(spark: object) -> None:
    assert TorchDistributor(2, False, False).run(_rank_and_world) == (0, 2)


def test_run_options_travel_to_the_executors(spark: object) -> None:
    distributor = TorchDistributor(2, False, False, env={"ST_FROM_DRIVER": "yes"}, return_all=True)
    values = distributor.prepared.run(_variable, ("ST_FROM_DRIVER",)).return_values
    assert values == {0: "yes", 1: "yes"}


def test_the_distributor_plans_once_and_runs_that_plan(
    spark: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    from sparktrain.backends.spark import backend as spark_backend

    asked: list[object] = []
    plan = spark_backend.make_cluster_plan
    monkeypatch.setattr(
        spark_backend, "make_cluster_plan", lambda *a, **k: asked.append(a) or plan(*a, **k)
    )
    distributor = TorchDistributor(2, False, False)
    assert distributor.run(_rank_and_world) == (0, 2)
    assert distributor.run(_rank_and_world) == (0, 2)
    assert len(asked) == 1  # laid out in the constructor; each run counts the free slots only


def _variable(name: str) -> str | None:
    return os.environ.get(name)  # read in the rank (os.environ.get would pickle the caller's)


def _rank_and_world() -> tuple[int, int]:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    t = torch.ones(1)
    dist.all_reduce(t)
    return dist.get_rank(), int(t.item())


def _fail_on_rank_one(pid_dir: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    Path(pid_dir, os.environ["RANK"]).write_text(str(os.getpid()))
    dist.barrier()
    if dist.get_rank() == 1:
        raise ValueError("loss is nan on rank 1")
    dist.barrier()


def test_failure_names_rank_and_host(spark: object, tmp_path: Path) -> None:
    with pytest.raises(TrainingFailedError) as info:
        TorchDistributor(2, False, False).run(_fail_on_rank_one, str(tmp_path))
    error = info.value
    assert error.culprit is not None and error.culprit.rank == 1
    assert error.culprit.host == "127.0.0.1" and error.victims == (0,)
    assert str(error).startswith("rank 1 on 127.0.0.1 failed first: ValueError: loss is nan")
    assert "Py4J" not in str(error) and "in _fail_on_rank_one" in str(error)
    pids = [int(p.read_text()) for p in tmp_path.iterdir()]
    assert len(pids) == 2 and wait_gone(pids) == []


def test_capacity_error_names_both_numbers(spark: object) -> None:
    with pytest.raises(ConfigError, match=r"needs 3 barrier tasks .* has 2 task slot\(s\)"):
        TorchDistributor(3, False, False).run(_rank_and_world)


def test_more_ranks_than_slots_construct_and_the_run_refuses_them(
    spark: object, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """pyspark's test_validate_correct_inputs: TorchDistributor(100, False, False) constructs
    whatever the cluster's size. The run counts the 2 slots; this cluster cannot grow, so it is
    refused after the moment given to executors still registering (shortened here), saying
    nothing while it waits."""
    from sparktrain.backends.spark import slots as spark_slots

    monkeypatch.setattr(spark_slots, "SLOT_WAIT_SECONDS", 0.5)
    distributor = TorchDistributor(100, local_mode=False, use_gpu=False)
    assert distributor.input_params == {
        "num_processes": 100, "local_mode": False, "use_gpu": False, "num_tasks": 100,
    }  # fmt: skip
    started = time.monotonic()
    with pytest.raises(ClusterConfigError) as raised:
        distributor.run(_rank_and_world)
    assert time.monotonic() - started < 5
    assert str(raised.value).startswith(
        "num_processes=100 needs 100 barrier tasks running at once, but the cluster has 2 task "
        "slot(s) now; a barrier stage would wait or fail. Lower num_processes, or add "
        "executors/cores (or GPUs)."
    )
    assert "waiting" not in capfd.readouterr().err


def test_a_cluster_that_can_grow_is_waited_for_then_refused(
    spark: Any, capfd: pytest.CaptureFixture[str]
) -> None:
    """A Databricks autoscaling cluster (its tag set on the session), with a 2 s bound set by
    the conf: the run says once that it waits, counts the slots again, then is refused with the
    same message and the wait."""
    from sparktrain.backends.spark.slots import GROW_WAIT_CONF

    tag = "spark.databricks.clusterUsageTags.clusterScalingType"
    spark.conf.set(tag, "autoscaling")
    spark.conf.set(GROW_WAIT_CONF, "2")
    try:
        distributor = TorchDistributor(100, False, False)
        started = time.monotonic()
        with pytest.raises(ClusterConfigError) as raised:
            distributor.run(_rank_and_world)
        waited = time.monotonic() - started
    finally:
        spark.conf.unset(tag)
        spark.conf.unset(GROW_WAIT_CONF)
    assert 2 <= waited < 10
    message = str(raised.value)
    assert message.startswith("num_processes=100 needs 100 barrier tasks running at once, but")
    assert "has 2 task slot(s) now after waiting 2s for the cluster to grow" in message
    lines = [line for line in capfd.readouterr().err.splitlines() if "waiting up to" in line]
    assert lines == [
        "sparktrain: num_processes=100 needs 100 task slot(s) and the cluster has 2; waiting up "
        "to 2s for it to grow (a Databricks autoscaling cluster)"
    ]


def _gpu_environment() -> dict[str, str]:
    return {k: os.environ.get(k, "") for k in ("CUDA_VISIBLE_DEVICES", "LOCAL_RANK", "NODE_RANK")}


def test_gpus_are_sparks_assignment(spark: object) -> None:
    """Spark's address i is the i-th entry of the executor's CUDA_VISIBLE_DEVICES (10,11 in the
    fixture), as pyspark and spark-tensorflow-distributor read it: the ranks get 10 or 11."""
    result = launch(
        _gpu_environment, num_processes=2, use_gpu=True, backend="spark", return_all=True
    )
    for node in result.nodes:
        assert len(node.gpus) == 1 and node.gpus[0] in ("10", "11")
        (rank,) = node.ranks
        assert result.return_values[rank] == {
            "CUDA_VISIBLE_DEVICES": node.gpus[0],
            "LOCAL_RANK": "0",
            "NODE_RANK": str(node.node_rank),
        }


def _shard_summary(batch_size: int) -> tuple[int, int, list[int], list[int]]:
    from sparktrain.data import rank_dataloader, rank_dataset

    dataset = rank_dataset()
    ids = sorted({int(i) for i in dataset.tensors[0]})
    widths = [int(t.shape[1]) if t.dim() == 2 else 1 for t in dataset.tensors[1:]]
    return len(dataset), len(rank_dataloader(batch_size)), ids, widths


def _uneven_frame(spark: object) -> object:
    from pyspark.ml.feature import VectorAssembler
    from pyspark.sql import functions as F

    frame = spark.range(40)  # type: ignore[attr-defined]
    bucket = F.when(F.col("id") < 10, 0).otherwise(2)  # these two hash to different partitions
    frame = frame.withColumn("bucket", bucket).repartition(2, "bucket").drop("bucket")
    frame = frame.withColumn("x", F.col("id") * 0.5)
    frame = frame.withColumn("arr", F.array(F.col("x"), F.col("x") + 1))
    return VectorAssembler(inputCols=["x", "id"], outputCol="vec").transform(frame)


def test_train_on_dataframe_uneven_partitions(spark: object) -> None:
    frame = _uneven_frame(spark)
    sizes = frame.rdd.glom().map(len).collect()  # type: ignore[attr-defined]
    assert sorted(sizes) == [10, 30]
    distributor = TorchDistributor(2, False, False)
    rows0, batches0, _, widths = distributor.train_on_dataframe(_shard_summary, frame, 8)
    result = launch(
        _shard_summary,
        (8,),
        num_processes=2,
        use_gpu=False,
        backend="spark",
        dataframe=frame,
        return_all=True,
    )
    shares = result.return_values
    assert shares[0][:2] == shares[1][:2] == (20, 3)  # rows split evenly, not by partition
    assert (rows0, batches0) == (20, 3)
    assert sorted(shares[0][2] + shares[1][2]) == list(range(40))  # nothing lost or repeated
    assert widths == [1, 2, 2]  # x; the array column; the ML vector


def test_any_lineage_trains(spark: object) -> None:
    first = spark.range(0, 6, 1, 1)  # type: ignore[attr-defined]
    frame = first.union(spark.range(6, 9, 1, 1)).coalesce(2)  # type: ignore[attr-defined]
    rows, _, _, _ = TorchDistributor(2, False, False).train_on_dataframe(_shard_summary, frame, 2)
    assert rows == 5  # 9 rows: 5 a rank, one repeated to keep the batches equal


def test_train_on_dataframe_locally(spark: object) -> None:
    frame = _uneven_frame(spark)
    rows, batches, _, _ = TorchDistributor(2, True, False).train_on_dataframe(
        _shard_summary, frame, 8
    )
    assert (rows, batches) == (20, 3)
    shares = launch(
        _shard_summary, (8,), num_processes=2, use_gpu=False, dataframe=frame, return_all=True
    ).return_values
    assert sorted(shares[0][2] + shares[1][2]) == list(range(40))


def _read_ids(dataset: object) -> tuple[int, list[int]]:
    ids = [i for batch in dataset for i in batch["id"].tolist()]  # type: ignore[attr-defined]
    return int(os.environ["RANK"]), ids


def test_from_dataframe_streams_on_the_executors(spark: object, tmp_path: Path) -> None:
    from sparktrain import data
    from sparktrain.data import cache

    frame = spark.range(0, 300, 1, 3).selectExpr("id", "id * 0.5 AS x")  # type: ignore[attr-defined]
    stale = tmp_path / ".tmp-dead"  # an unfinished write of a process that no longer runs
    stale.mkdir()
    (stale / "_sparktrain_owner.json").write_text(
        f'{{"host": "{__import__("socket").gethostname()}", "pid": 999999999, "start": 1}}'
    )
    folder = data.materialise(frame, cache_dir=tmp_path)
    assert not stale.exists()
    written = sorted(Path(folder).glob("part-*.parquet"))
    assert len(written) == 3  # one file per partition, written by the executors
    assert data.materialise(frame, cache_dir=tmp_path) == folder  # the same plan: reused
    assert sorted(Path(folder).glob("part-*.parquet")) == written
    assert data.materialise(frame.limit(10), cache_dir=tmp_path) != folder
    dataset = data.from_dataframe(frame, cache_dir=tmp_path, batch_size=32)
    result = launch(_read_ids, (dataset,), num_processes=2, backend="spark", return_all=True)
    shares = dict(result.return_values.values())
    assert len(shares[0]) == len(shares[1]) == 150
    assert sorted(shares[0] + shares[1]) == list(range(300))
    assert data.delete_cache(frame, cache_dir=tmp_path) and not Path(folder).exists()
    assert cache.CONF == "spark.sparktrain.data.cacheDir"


def test_script_on_spark(spark: object, tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(
        "import os, sys\n"
        f"open(os.path.join({str(tmp_path)!r}, 'out-' + os.environ['RANK']), 'w')"
        ".write(' '.join(sys.argv[1:]))\n"
    )
    assert TorchDistributor(2, False, False).run(str(script), "--epochs", 3) is None
    assert [(tmp_path / f"out-{r}").read_text() for r in (0, 1)] == ["--epochs 3"] * 2


def test_no_active_session_is_a_clear_error() -> None:
    import subprocess

    code = "from sparktrain import TorchDistributor; TorchDistributor(2, False, False)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert "local_mode=False needs an active SparkSession" in done.stderr


def _sleep_on_rank_one() -> int:
    import time

    if os.environ["RANK"] == "1":
        time.sleep(120)
    return os.getpid()


def test_timeout_on_spark_names_running_rank(spark: object) -> None:
    from sparktrain import TrainingTimeoutError

    with pytest.raises(TrainingTimeoutError) as info:
        # the call's deadline counts the Spark tasks' start: room for rank 0 to start and end
        TorchDistributor(2, False, False, timeout=20).run(_sleep_on_rank_one)
    assert info.value.running == (1,)


def test_kill_and_restart_on_spark(
    spark: object, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    import test_faults

    cloudpickle.register_pickle_by_value(test_faults)
    clean = launch(
        test_faults.resumable_train, (str(tmp_path / "clean"), 4, -1, -1),
        num_processes=2, use_gpu=False,
    ).value  # fmt: skip
    faulty = TorchDistributor(2, False, False, max_restarts=1).run(
        test_faults.resumable_train, str(tmp_path / "faulty"), 4, 0, 2
    )
    # Killed as epoch 2 begins: epoch 1's checkpoint may still have been in flight.
    assert faulty["start"] in (1, 2) and faulty["restart"] == 1
    assert all(torch.equal(clean["params"][k], faulty["params"][k]) for k in clean["params"])
    # A barrier task ends with its attempt: nothing kept in memory, storage read, and said.
    err = capfd.readouterr().err
    assert "from storage: skeleton.pt" in err and "keep no checkpoint in memory across" in err


SPARK_CALLER = """
import os, sys, time
from pathlib import Path
from pyspark.sql import SparkSession
from sparktrain import TorchDistributor

def hang(folder):
    Path(folder, os.environ["RANK"]).write_text(str(os.getpid()))
    time.sleep(600)

if __name__ == "__main__":
    os.environ["PYSPARK_PYTHON"] = sys.executable
    spark = (
        SparkSession.builder.master("local-cluster[2,1,1024]")
        .config("spark.executor.memory", "512m").config("spark.ui.enabled", "false")
        .config("spark.driver.host", "127.0.0.1").config("spark.driver.bindAddress", "127.0.0.1")
        .getOrCreate()
    )
    TorchDistributor(2, False, False).run(hang, sys.argv[1])
"""


def test_caller_killed_leaves_no_rank_on_executors(spark: object, tmp_path: Path) -> None:
    import signal
    import subprocess
    import time

    script = tmp_path / "caller.py"
    script.write_text(SPARK_CALLER)
    pids = tmp_path / "pids"
    pids.mkdir()
    said = tmp_path / "caller.log"
    with open(said, "wb") as log:
        caller = subprocess.Popen(
            [sys.executable, str(script), str(pids)],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        # A new Spark (3 JVMs) starts first: on a loaded 2-core machine that took over 120 s
        # once; the bound only keeps a caller that never starts its ranks from running on.
        deadline = time.monotonic() + 240
        while len(list(pids.iterdir())) < 2:
            if time.monotonic() > deadline or caller.poll() is not None:
                tail = said.read_text(errors="replace")[-3000:]
                raise AssertionError(f"ranks did not start; the caller said:\n{tail}")
            time.sleep(0.2)
        time.sleep(0.5)
        ranks = [int(p.read_text()) for p in pids.iterdir()]
        caller.kill()  # SIGKILL: no cleanup code of the caller runs
        caller.wait()
        assert wait_gone(ranks, within=10.0) == []
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(caller.pid, signal.SIGKILL)  # the caller's JVMs, whatever happened


def test_deepspeed_distributor_on_spark(spark: object) -> None:
    pytest.importorskip("deepspeed")
    import test_deepspeed_distributor as tdd

    cloudpickle.register_pickle_by_value(tdd)
    from sparktrain import DeepspeedTorchDistributor

    result = DeepspeedTorchDistributor(1, 2, False, False, tdd.CONFIG).run(tdd.deepspeed_train, 4)
    assert result["stage"] == 2 and result["losses"][-1] < result["losses"][0]


def test_mlflow_tracking_on_spark(
    spark: object, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    mlflow = pytest.importorskip("mlflow")
    import test_tracking

    cloudpickle.register_pickle_by_value(test_tracking)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    TorchDistributor(2, False, False, mlflow=True).run(test_tracking.tracked_train, 4, "ddp")
    client = mlflow.tracking.MlflowClient(uri)
    (run,) = client.search_runs(["0"])
    assert run.info.status == "FINISHED" and run.data.params["backend"] == "spark"
    history = client.get_metric_history(run.info.run_id, "loss")
    assert sorted(m.step for m in history) == [0, 1, 2, 3]  # rank 0 only: one copy per step


def test_pipeline_stages_across_two_executors(spark: object) -> None:
    """pp=2 over two executors (one rank each): the stages span nodes, as pp does by default."""
    from tests import test_pipeline, test_tensor_parallel

    for module in (test_pipeline, test_tensor_parallel):
        cloudpickle.register_pickle_by_value(module)
    options = {"pp": 2, "schedule": "gpipe", "microbatches": 2}
    result = launch(test_pipeline.train, ("ddp", options), num_processes=2, backend="spark")
    assert result.value[0] == pytest.approx(test_pipeline.reference(), rel=1e-5, abs=1e-6)
    assert [node.ranks for node in result.nodes] == [(0,), (1,)]


def test_executors_without_sparktrain_are_told_what_to_set() -> None:
    from sparktrain.backends.spark.job import summarise_job_error

    text = (  # the shape of the real failure (a local master whose Python is /usr/bin/python3)
        "org.apache.spark.api.python.PythonException: Traceback (most recent call last):\n"
        '  File "pyspark/serializers.py", line 483, in loads\n'
        "    return cloudpickle.loads(obj, encoding=encoding)\n"
        "ModuleNotFoundError: No module named 'sparktrain'\n SQLSTATE: 38000"
    )
    line = summarise_job_error(RuntimeError(text))
    assert line.startswith("a task raised ModuleNotFoundError: No module named 'sparktrain'")
    assert f"os.environ['PYSPARK_PYTHON'] = {sys.executable!r}" in line
    other = summarise_job_error(RuntimeError(text.replace("sparktrain", "x")))
    assert "PYSPARK_PYTHON" not in other
