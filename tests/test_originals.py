"""Behaviours of the original front doors that other people's tests and code rely on.

Each test is written from the original's own tests or documentation, named in its docstring:
pyspark's ``python/pyspark/ml/torch/tests/test_distributor.py`` and
``ml/deepspeed/tests/test_deepspeed_distributor.py``, spark-tensorflow-distributor's
``tests/integration/test_mirrored_strategy_runner.py``, Horovod's
``test/integration/test_interactiverun.py``. Only the import is changed.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import cloudpickle
import pytest

from sparktrain import (
    ClusterConfigError,
    ConfigError,
    DeepspeedTorchDistributor,
    MirroredStrategyRunner,
    TorchDistributor,
    launch,
)

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # executors cannot import tests/


def _rank() -> int:
    import os

    return int(os.environ["RANK"])


# -- pyspark's TorchDistributor -------------------------------------------------------------


@pytest.mark.parametrize("num_processes", [1, 2])
def test_input_params_hold_the_constructors_values(num_processes: int) -> None:
    """test_validate_correct_inputs: input_params == {num_processes, local_mode, use_gpu,
    num_tasks} (local mode: num_tasks == num_processes)."""
    distributor = TorchDistributor(num_processes, True, False)
    assert distributor.input_params == {
        "num_processes": num_processes,
        "local_mode": True,
        "use_gpu": False,
        "num_tasks": num_processes,
    }


def test_a_non_positive_count_is_a_value_error() -> None:
    """test_validate_incorrect_inputs: a count of 0 raises ValueError matching 'positive'."""
    with pytest.raises(ValueError, match="positive"):
        TorchDistributor(0, True, False)


def test_gpu_conditions_are_runtime_errors_naming_the_driver() -> None:
    """test_get_num_tasks_fails: use_gpu=True in local mode without GPUs on the driver raises
    RuntimeError matching 'driver' (and it is our ConfigError too)."""
    for count in (1, 5, 4):
        with pytest.raises(RuntimeError, match="driver") as raised:
            TorchDistributor(count, True, True)
        assert isinstance(raised.value, ClusterConfigError)
        assert isinstance(raised.value, ConfigError)


def test_deepspeed_num_gpus_true_is_one() -> None:
    """test_pytorch_file_e2e passes numGpus=True, which pyspark reads as numGpus * nnodes = 1;
    input_params adds deepspeed_config."""
    distributor = DeepspeedTorchDistributor(numGpus=True, useGpu=False, localMode=True)
    assert distributor.plan.world_size == 1
    assert distributor.input_params == {
        "deepspeed_config": None,
        "num_processes": 1,
        "local_mode": True,
        "use_gpu": False,
        "num_tasks": 1,
    }
    with pytest.raises(ConfigError, match="numGpus=False"):
        DeepspeedTorchDistributor(numGpus=False, useGpu=False)


DRIVER_GPUS = """
import os, sys
os.environ["PYSPARK_PYTHON"] = sys.executable
from pyspark.sql import SparkSession
from sparktrain import MirroredStrategyRunner, TorchDistributor
script = sys.argv[1]
spark = (
    SparkSession.builder.master("local[1]")
    .config("spark.ui.enabled", "false")
    .config("spark.driver.resource.gpu.amount", "2")
    .config("spark.driver.resource.gpu.discoveryScript", script)
    .getOrCreate()
)
print("TORCH", TorchDistributor(2, True, True).plan.gpus)
print("TF", MirroredStrategyRunner(num_slots=2, local_mode=True, use_gpu=True).prepared.plan.gpus)
os.environ["CUDA_VISIBLE_DEVICES"] = "3,4"
print("TRANSLATED", TorchDistributor(1, True, True).plan.gpus)
try:
    TorchDistributor(3, True, True)
except RuntimeError as error:
    print("TOO_MANY", type(error).__name__)
spark.stop()
"""


@pytest.mark.spark
def test_local_mode_uses_the_drivers_spark_gpus(tmp_path: Path) -> None:
    """pyspark's local mode takes the driver's GPU resources (spark.driver.resource.gpu.*),
    read through the driver's CUDA_VISIBLE_DEVICES (test_get_gpus_owned_local: addresses 0,1,2
    with CUDA_VISIBLE_DEVICES=3,4,5 are 3,4,5); spark-tensorflow-distributor's too. The plans
    are checked; nothing runs (this machine has no GPU)."""
    pytest.importorskip("pyspark")
    script = tmp_path / "gpus.sh"
    script.write_text('#!/bin/sh\necho \'{"name": "gpu", "addresses": ["0", "1"]}\'\n')
    script.chmod(0o755)
    client = tmp_path / "client.py"
    client.write_text(DRIVER_GPUS)
    env = {k: v for k, v in __import__("os").environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    done = subprocess.run(
        [sys.executable, str(client), str(script)],
        capture_output=True, text=True, timeout=240, check=False, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "TORCH ('0', '1')" in done.stdout and "TF ('0', '1')" in done.stdout
    assert "TRANSLATED ('3',)" in done.stdout
    assert "TOO_MANY ClusterConfigError" in done.stdout


# -- TLS: pyspark's and spark-tensorflow-distributor's encryption checks ---------------------


@pytest.fixture
def tls(spark: Any) -> Iterator[Any]:
    """The shared session with ``spark.ssl.enabled=true`` (runtime conf), restored after."""
    keys = (
        "spark.ssl.enabled",
        "pytorch.spark.distributor.ignoreSsl",
        "deepspeed.spark.distributor.ignoreSsl",
        "tensorflow.spark.distributor.ignoreSsl",
        "spark.sparktrain.ignoreSsl",
    )
    spark.conf.set("spark.ssl.enabled", "true")
    try:
        yield spark
    finally:
        for key in keys:
            spark.conf.unset(key)


@pytest.mark.spark
def test_a_tls_cluster_is_refused_unless_overridden(tls: Any) -> None:
    """test_encryption_fails / test_encryption_passes (pyspark) and test_run_on_ssl_cluster
    (_override) (spark-tensorflow-distributor): with spark.ssl.enabled=true a distributed run
    raises an error matching 'encryption' unless the original's ignoreSsl conf is 'true'."""
    torch_run = TorchDistributor(2, False, False)
    with pytest.raises(RuntimeError, match="encryption") as raised:
        torch_run.run(_rank)
    assert "pytorch.spark.distributor.ignoreSsl" in str(raised.value)
    assert "not encrypted" in str(raised.value)
    tls.conf.set("pytorch.spark.distributor.ignoreSsl", "TRUE")
    assert torch_run.run(_rank) == 0
    assert TorchDistributor(2, True, False).run(_rank) == 0  # local mode: never checked

    with pytest.raises(RuntimeError, match=r"deepspeed\.spark\.distributor\.ignoreSsl"):
        DeepspeedTorchDistributor(numGpus=2, useGpu=False, localMode=False).run(_rank)
    runner = MirroredStrategyRunner(num_slots=2, use_gpu=False, use_custom_strategy=True)
    with pytest.raises(Exception, match=r"tensorflow\.spark\.distributor\.ignoreSsl"):
        runner.run(_rank)
    with pytest.raises(RuntimeError, match=r"spark\.sparktrain\.ignoreSsl"):
        launch(_rank, num_processes=2, use_gpu=False, backend="spark")
    tls.conf.set("spark.sparktrain.ignoreSsl", "true")  # sparktrain's own: every front door
    assert launch(_rank, num_processes=2, use_gpu=False, backend="spark").value == 0
    tls.conf.set("spark.sparktrain.ignoreSsl", "yes")
    with pytest.raises(ConfigError, match=r"ignoreSsl='yes' must be 'true'"):
        launch(_rank, num_processes=2, use_gpu=False, backend="spark")


# -- Horovod outside HorovodRunner -----------------------------------------------------------


def _horovod_fn(a: int, b: int, c: int, d: int) -> object:
    """Horovod's test_interactiverun.py::test_happy_run function."""
    import horovod.torch as hvd
    import torch

    hvd.init()
    rank = hvd.rank()
    res = hvd.allgather(torch.tensor([rank, a + b + c + d])).tolist()
    if rank == 0:
        return res
    if rank == 1:
        return "ret_val_of_rank_1"
    return None


def _horovod_fails() -> None:
    import horovod.torch as hvd

    hvd.init()
    if hvd.rank() == 1:
        raise ValueError("rank 1 broke")


def test_horovod_run_returns_every_ranks_value_in_rank_order() -> None:
    """test_happy_run: run(fn, (1, 20), {"c": 300, "d": 4000}, np=1 / np=3); test_failed_run:
    a rank that raises makes run raise a RuntimeError."""
    from sparktrain import horovod

    args, kwargs = (1, 20), {"c": 300, "d": 4000}
    assert horovod.run(_horovod_fn, args, kwargs, np=1) == [[0, 4321]]
    assert horovod.run(_horovod_fn, args, kwargs, num_proc=3) == [
        [0, 4321, 1, 4321, 2, 4321],
        "ret_val_of_rank_1",
        None,
    ]
    with pytest.raises(RuntimeError, match="rank 1 broke"):
        horovod.run(_horovod_fails, np=2)
    with pytest.raises(ConfigError, match=r"horovod.run\(hosts=...\) does not apply"):
        horovod.run(_horovod_fn, args, kwargs, np=2, hosts="otherhost:2")


def _mnist_main(args: dict[str, int]) -> tuple[int, int, float]:
    import horovod.torch as hvd
    import torch

    hvd.init()
    total = hvd.allreduce(torch.tensor([float(hvd.rank() + args["seed"])]), op=hvd.Sum).item()
    return hvd.rank(), hvd.size(), total


def test_horovod_run_takes_pytorch_mnists_defaults_spelled_out() -> None:
    """Horovod's examples/pytorch/pytorch_mnist.py --num-proc 2 calls
    horovod.run(main, args=(args,), np=2, hosts=None, use_gloo=False, use_mpi=False): Horovod's
    defaults, spelled out. They run; each rank's value comes back in rank order."""
    from sparktrain import horovod

    values = horovod.run(
        _mnist_main, args=({"seed": 10},), np=2, hosts=None, use_gloo=False, use_mpi=False
    )
    assert values == [(0, 2, 21.0), (1, 2, 21.0)]


@pytest.mark.parametrize(
    ("option", "named"),
    [
        ({"use_mpi": True}, r"horovod.run\(use_mpi=...\) does not apply here: use_mpi=True; .*MPI"),
        ({"hosts": "a:1,b:1"}, r"hosts='a:1,b:1'; it names other hosts \(a, b\).*backend='spark'"),
        ({"hostfile": "/etc/hosts"}, r"hostfile='/etc/hosts'; a host file lists hosts"),
        ({"hosts": "localhost:1"}, r"hosts='localhost:1'; 1 slot\(s\) for num_proc=2"),
        ({"ssh_port": 22}, r"horovod.run\(ssh_port=...\) does not apply here: ssh_port=22"),
    ],
)
def test_horovod_run_refuses_what_a_launch_cannot_do(option: dict[str, Any], named: str) -> None:
    """A value that asks for MPI, other hosts or SSH is refused before anything starts, naming
    the option, its value and what to do instead."""
    from sparktrain import horovod

    with pytest.raises(ConfigError, match=named):
        horovod.run(_mnist_main, args=({"seed": 1},), np=2, use_gloo=False, **option)


def test_horovod_options_at_harmless_values_are_accepted() -> None:
    """Horovod's default hosts (localhost:<num_proc>), falsy use_mpi, any use_gloo and the
    launcher's tuning options pass the check (which starts nothing)."""
    from sparktrain.horovod.runner import check_horovod_options

    harmless = {
        "hosts": "localhost:2", "hostfile": None, "use_mpi": False, "use_gloo": True,
        "verbose": 2, "start_timeout": 30, "mpi_args": None, "min_num_proc": None,
    }  # fmt: skip
    check_horovod_options(harmless, 2, "local")
    check_horovod_options({"hosts": "localhost:1,127.0.0.1:1", "use_mpi": 0}, 2, "local")
    with pytest.raises(ConfigError, match=r"hosts='localhost:2'; it names this machine, but"):
        check_horovod_options({"hosts": "localhost:2"}, 2, "spark")


HOROVOD_SCRIPT = """
import horovod
import horovod.torch as hvd
import torch

hvd.init()
total = hvd.allreduce(torch.tensor([float(hvd.rank() + 1)]), op=hvd.Sum).item()
built = (hvd.nccl_built(), hvd.gloo_built(), hvd.mpi_built())
print("RANK", hvd.rank(), "SIZE", hvd.size(), "TOTAL", total, "BUILT", built, type(built[0]))
print("RUN", callable(horovod.run))
"""


def test_a_horovod_script_runs_under_sparktrain_run(tmp_path: Path) -> None:
    """A script doing `import horovod.torch as hvd`, run with `sparktrain run --nproc 2`
    (Horovod not installed): the alias is there in every rank; Horovod's build queries answer
    with Horovod's types (nccl_built() an int: 0 without NCCL)."""
    script = tmp_path / "train.py"
    script.write_text(HOROVOD_SCRIPT)
    cli = Path(sys.executable).parent / "sparktrain"
    done = subprocess.run(
        [str(cli), "run", "--nproc", "2", str(script)],
        capture_output=True, text=True, timeout=240, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    for rank in (0, 1):
        line = f"[rank {rank}] RANK {rank} SIZE 2 TOTAL 3.0 BUILT (0, True, False) <class 'int'>"
        assert line in done.stdout
    assert "[rank 0] RUN True" in done.stdout


# -- tracebacks ------------------------------------------------------------------------------


def _fails_on_rank_one() -> None:
    if _rank() == 1:
        raise ValueError("bad batch on rank 1")


def test_a_failing_ranks_traceback_shows_the_users_frames_only() -> None:
    from sparktrain import TrainingFailedError

    with pytest.raises(TrainingFailedError) as raised:
        launch(_fails_on_rank_one, num_processes=2, use_gpu=False)
    text = raised.value.culprit.traceback
    assert text.splitlines()[1].startswith(f'  File "{__file__}"')  # the first frame: ours
    assert "_BecomeRank" not in text and "During handling" not in text
    assert "sparktrain/rank/worker.py" not in text
