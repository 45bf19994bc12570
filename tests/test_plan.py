"""Pure planning: every bad input is refused before any process starts, with the fix."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import pytest

from sparktrain import ClusterConfigError, ConfigError, HorovodRunner, TorchDistributor
from sparktrain.contract.env import RankEnv, rank_environ
from sparktrain.driver.launch import prepare
from sparktrain.launchplan.layout import make_plan
from sparktrain.launchplan.options import run_options
from sparktrain.launchplan.topology import Topology

CPU = Topology(cpus=2, gpus=(), hostname="h")
TWO_GPUS = Topology(cpus=8, gpus=("3", "5"), hostname="h")


@pytest.mark.parametrize("bad", [0, -1, "2", 2.0, True, None])
def test_num_processes_must_be_positive_int(bad: object) -> None:
    with pytest.raises(ConfigError, match=r"num_processes=.*(not an int|at least 1)"):
        make_plan(bad, topology=CPU)


def test_cpu_plan() -> None:
    plan = make_plan(2, topology=CPU, use_gpu=None)
    assert (plan.device, plan.dist_backend, plan.world_size, plan.gpus) == ("cpu", "gloo", 2, ())
    assert plan.threads_per_rank == 1
    assert plan.describe() == "2 ranks on 1 node, cpu (gloo)"


def test_use_gpu_true_without_gpu() -> None:
    with pytest.raises(ConfigError, match=r"use_gpu=True but no GPU .* use_gpu=False"):
        make_plan(1, topology=CPU, use_gpu=True)


def test_more_processes_than_gpus_is_an_error() -> None:
    with pytest.raises(ConfigError, match=r"num_processes=3 but only 2 GPU\(s\) .*3, 5"):
        make_plan(3, topology=TWO_GPUS, use_gpu=True)
    with pytest.raises(ConfigError, match="num_processes=3"):
        make_plan(3, topology=TWO_GPUS, use_gpu=None)


def test_gpu_plan_takes_the_first_gpus() -> None:
    plan = make_plan(1, topology=TWO_GPUS)
    assert (plan.device, plan.dist_backend, plan.gpus) == ("cuda", "nccl", ("3",))
    assert make_plan(2, topology=TWO_GPUS, use_gpu=False).device == "cpu"


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"use_gpu": "yes"}, r"use_gpu='yes' must be True, False, or None"),
        ({"timeout": -1}, r"timeout=-1 must be a positive number"),
        ({"timeout": "10"}, r"timeout='10'"),
        ({"log_ranks": [5]}, r"log_ranks=\[5\] names \[5\], not ranks of this run \(0 to 1\)"),
        ({"log_ranks": "0"}, r"log_ranks='0' must be a collection"),
    ],
)
def test_bad_options(kwargs: dict[str, object], pattern: str) -> None:
    use_gpu = kwargs.pop("use_gpu", None)
    with pytest.raises(ConfigError, match=pattern):
        prepare(2, topology=CPU, use_gpu=use_gpu, options=run_options(**kwargs))


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"timout": 3}, r"unknown option 'timout' \(did you mean 'timeout'\?\); the run"),
        ({"max_restarts": -1}, r"max_restarts=-1 must be a whole number >= 0"),
        ({"exit_grace": 0}, r"exit_grace=0 must be a positive, finite number of seconds"),
        ({"on_report": 3}, r"on_report=3 must be a function"),
        ({"mlflow": "yes"}, r"mlflow='yes' must be True or False"),
    ],
)
def test_run_options_name_the_bad_value(kwargs: dict[str, object], pattern: str) -> None:
    with pytest.raises(ConfigError, match=pattern):
        run_options(**kwargs)


def _front_doors() -> dict[str, Callable[..., object]]:
    from sparktrain import DeepspeedTorchDistributor, MirroredStrategyRunner, launch, tune

    return {
        "launch": lambda **o: launch(print, num_processes=2, use_gpu=False, **o),
        "TorchDistributor": lambda **o: TorchDistributor(2, True, False, **o),
        "DeepspeedTorchDistributor": lambda **o: DeepspeedTorchDistributor(2, 1, True, False, **o),
        "HorovodRunner": lambda **o: HorovodRunner(-2, use_gpu=False, **o),
        "MirroredStrategyRunner": lambda **o: MirroredStrategyRunner(2, True, False, **o),
        "tune": lambda **o: tune(print, {}, num_trials=1, metric="m", use_gpu=False, **o),
    }


@pytest.mark.parametrize("door", sorted(_front_doors()))
def test_every_front_door_takes_the_same_options(door: str) -> None:
    make = _front_doors()[door]
    with pytest.raises(ConfigError, match=r"timeout=-1 must be a positive number of seconds"):
        make(timeout=-1)
    with pytest.raises(ConfigError, match=r"unknown option 'max_restart' \(did you mean"):
        make(max_restart=1)
    with pytest.raises(ConfigError, match=r"exit_grace='x' must be a positive"):
        make(exit_grace="x")


def test_the_command_line_takes_the_same_options(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    from sparktrain.cli import main

    script = tmp_path / "train.py"
    script.write_text("print('never runs')\n")
    assert main(["run", "--nproc", "2", "--cpu", "--timeout", "-1", str(script)]) == 2
    assert "timeout=-1.0 must be a positive number of seconds" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        main(["run", "--log-ranks", "a,b", "x.py"])
    assert info.value.code == 2
    assert "--log-ranks 'a,b': 'a,b' must be comma-separated ranks" in capsys.readouterr().err


def test_distributor_checks_before_starting(monkeypatch: pytest.MonkeyPatch) -> None:
    from pyspark.sql import SparkSession
    from pyspark.sql.connect.session import SparkSession as ConnectSession

    def no_session(cls: object) -> None:
        raise RuntimeError("no session")  # as pyspark does when none exists

    # Other tests' Spark session lives for the whole run: hide it, as on a fresh driver.
    monkeypatch.setattr(SparkSession, "getActiveSession", classmethod(lambda cls: None))
    monkeypatch.setattr(SparkSession, "active", classmethod(no_session))
    monkeypatch.setattr(ConnectSession, "_get_default_session", classmethod(lambda cls: None))
    with pytest.raises(ConfigError, match="num_processes=0"):
        TorchDistributor(0, True, False)
    with pytest.raises(ConfigError, match=r"local_mode=False .* local_mode=True"):
        TorchDistributor(2, False, False)
    with pytest.raises(ConfigError, match="use_gpu=True but no GPU"):
        TorchDistributor(1, True, True)


def test_rank_environment_contract() -> None:
    rank_env = RankEnv(
        rank=1,
        local_rank=1,
        world_size=2,
        local_world_size=2,
        node_rank=0,
        nodes=1,
        master_addr="127.0.0.1",
        master_port=29400,
        run_id="abc",
        visible_devices=("3", "5"),
        threads=4,
    )
    base = {"RANK": "7", "HOME": "/root", "OMP_NUM_THREADS": "2"}
    env = rank_environ(base, rank_env)
    assert env["RANK"] == "1" and env["WORLD_SIZE"] == "2" and env["LOCAL_RANK"] == "1"
    assert env["MASTER_PORT"] == "29400" and env["CUDA_VISIBLE_DEVICES"] == "3,5"
    assert env["HOME"] == "/root" and env["OMP_NUM_THREADS"] == "2"  # the user's choice stays
    assert env["TORCHELASTIC_USE_AGENT_STORE"] == "True"


from sparktrain.launchplan.layout import ClusterFacts, make_cluster_plan  # noqa: E402


def test_cluster_plan_cpu_one_rank_per_task() -> None:
    plan = make_cluster_plan(4, facts=ClusterFacts(task_gpus=0, task_cpus=2, slots=4))
    assert (plan.nodes, plan.procs_per_node, plan.device, plan.threads_per_rank) == (
        4,
        1,
        "cpu",
        2,
    )


def test_cluster_plan_gpu_ranks_per_task() -> None:
    plan = make_cluster_plan(4, facts=ClusterFacts(task_gpus=2, task_cpus=4, slots=2))
    assert (plan.nodes, plan.procs_per_node, plan.device) == (2, 2, "cuda")
    assert (
        make_cluster_plan(
            2, facts=ClusterFacts(task_gpus=1, task_cpus=1, slots=2), use_gpu=False
        ).device
        == "cpu"
    )


NO_GPU = ClusterFacts(task_gpus=0, task_cpus=1, slots=8)
TWO_GPU_TASKS = ClusterFacts(task_gpus=2, task_cpus=1, slots=8)
TWO_SLOTS = ClusterFacts(task_gpus=0, task_cpus=1, slots=2)
ONE_GPU_SLOT = ClusterFacts(task_gpus=1, task_cpus=1, slots=1)


@pytest.mark.parametrize(
    ("facts", "num", "use_gpu", "pattern"),
    [
        (NO_GPU, 2, True, r"spark\.task\.resource\.gpu\.amount is unset"),
        (TWO_GPU_TASKS, 3, True, r"num_processes=3 is not a multiple of .*=2"),
        (TWO_SLOTS, 3, False, r"needs 3 barrier tasks .* has 2 task slot"),
        (ONE_GPU_SLOT, 2, None, r"needs 2 barrier tasks \(1 GPU\(s\) each\)"),
    ],
)
def test_cluster_plan_errors(facts: ClusterFacts, num: int, use_gpu: object, pattern: str) -> None:
    # pyspark's TorchDistributor raises RuntimeError for these: so does ours (and ConfigError)
    with pytest.raises(RuntimeError, match=pattern) as raised:
        make_cluster_plan(num, facts=facts, use_gpu=use_gpu)
    assert isinstance(raised.value, ClusterConfigError)


from sparktrain.backends.spark import slots as spark_slots  # noqa: E402
from sparktrain.launchplan.layout import check_slots  # noqa: E402

AUTOSCALING = "spark.databricks.clusterUsageTags.clusterScalingType"
MAX_WORKERS = "spark.databricks.clusterUsageTags.clusterMaxWorkers"


@pytest.mark.parametrize(
    ("conf", "why", "most"),
    [
        ({}, None, None),
        ({"spark.dynamicAllocation.enabled": "false"}, None, None),
        ({"spark.dynamicAllocation.enabled": "true"}, "spark.dynamicAllocation.enabled=true", None),
        (
            {
                "spark.dynamicAllocation.enabled": "true",
                "spark.dynamicAllocation.maxExecutors": "8",
            },
            "spark.dynamicAllocation.enabled=true, spark.dynamicAllocation.maxExecutors=8",
            8,
        ),
        ({AUTOSCALING: "autoscaling"}, "a Databricks autoscaling cluster", None),
        (
            {MAX_WORKERS: "5"},
            f"a Databricks autoscaling cluster, {MAX_WORKERS}=5",
            5,
        ),
    ],
)
def test_whether_a_cluster_can_grow_is_read_from_its_conf(
    conf: dict[str, str], why: str | None, most: int | None
) -> None:
    growth = spark_slots.growth_from_conf(conf)
    assert (growth and growth.why, growth and growth.max_executors) == (why, most)


def test_the_wait_is_for_growth_only_where_the_cluster_can_reach_the_tasks() -> None:
    """Two executors of one slot each: maxExecutors=8 reaches 8 slots, not 100."""
    unbounded = spark_slots.Growth(why="grows", max_executors=None)
    bounded = spark_slots.Growth(why="grows", max_executors=8)
    for growth, tasks, seconds, for_growth in [
        (None, 100, spark_slots.SLOT_WAIT_SECONDS, False),
        (unbounded, 100, 7.0, True),
        (bounded, 8, 7.0, True),
        (bounded, 100, spark_slots.SLOT_WAIT_SECONDS, False),
    ]:
        wait = spark_slots.wait_bound(growth, slots=2, executors=2, tasks=tasks, grow_seconds=7.0)
        assert (wait.seconds, wait.for_growth) == (seconds, for_growth)
    short = spark_slots.wait_bound(bounded, slots=2, executors=2, tasks=100, grow_seconds=7.0)
    assert short.note() == " and can grow to 8 at most (grows)"
    assert spark_slots.slot_decision(slots=2, tasks=2, waited=99.0, bound=1.0) == "run"
    assert spark_slots.slot_decision(slots=1, tasks=2, waited=0.5, bound=1.0) == "wait"
    assert spark_slots.slot_decision(slots=1, tasks=2, waited=1.0, bound=1.0) == "fail"


def test_a_cluster_that_can_grow_is_waited_for_then_refused() -> None:
    """A fake slot counter that never grows: counted again until the (tiny) bound, one line
    told, then refused with the same message as a cluster that cannot grow, plus the wait."""
    import time

    counted: list[float] = []

    def count() -> int:
        counted.append(time.monotonic())
        return 2

    growth = spark_slots.growth_from_conf({AUTOSCALING: "autoscaling"})
    wait = spark_slots.wait_bound(growth, slots=2, executors=2, tasks=100, grow_seconds=0.3)
    told: list[int] = []
    started = time.monotonic()
    slots = spark_slots.wait_for_slots(count, 100, bound=wait.seconds, on_wait=told.append)
    assert slots == 2 and told == [2] and len(counted) >= 2
    assert 0.3 <= counted[-1] - started < 2.0
    plan = make_cluster_plan(100, facts=ClusterFacts(task_gpus=0, task_cpus=1, slots=None))
    with pytest.raises(ClusterConfigError) as raised:
        check_slots(plan, NO_GPU, slots, name="num_processes", note=wait.note())
    assert str(raised.value).startswith(
        "num_processes=100 needs 100 barrier tasks running at once, but the cluster has 2 task "
        "slot(s) now after waiting 0.3s for the cluster to grow (a Databricks autoscaling "
        "cluster; spark.sparktrain.capacityWaitSeconds sets the wait); a barrier stage would "
        "wait or fail. Lower num_processes, or add executors/cores (or GPUs)."
    )


def test_slots_that_arrive_during_the_wait_end_it() -> None:
    counts = iter([2, 2, 100])
    told: list[int] = []
    slots = spark_slots.wait_for_slots(lambda: next(counts), 100, bound=30.0, on_wait=told.append)
    assert slots == 100 and told == [2]


@pytest.mark.parametrize(("per_task", "slots"), [(1, 2), (1, 8), (2, 4), (2, 6), (4, 6), (4, 2)])
def test_task_gpu_sharing_splits_slots_as_spark_tensorflow_distributor(
    per_task: int, slots: int
) -> None:
    """Its test_equal_gpu_allocation: ceil(num_slots / amount) tasks, task i owning
    num_slots // tasks + (i < num_slots % tasks) GPUs, one worker each."""
    facts = ClusterFacts(task_gpus=per_task, task_cpus=1, slots=8)
    plan = make_cluster_plan(slots, facts=facts, use_gpu=True, gpus="task")
    tasks = -(-slots // per_task)
    assert (plan.nodes, plan.procs_per_node, plan.world_size) == (tasks, 1, tasks)
    assert plan.gpu_shares == tuple(slots // tasks + (i < slots % tasks) for i in range(tasks))
    assert sum(plan.gpu_shares) == slots
    cpu = make_cluster_plan(slots, facts=facts, use_gpu=False, gpus="task")
    assert (cpu.nodes, cpu.gpu_shares) == (slots, None)


class _Resource:
    def __init__(self, addresses: list[str]) -> None:
        self.addresses = addresses


class _Context:
    def __init__(self, addresses: list[str]) -> None:
        self._resources = {"gpu": _Resource(addresses)}

    def resources(self) -> dict[str, _Resource]:
        return self._resources


def test_task_gpu_addresses_must_be_plain_integers(monkeypatch: pytest.MonkeyPatch) -> None:
    from sparktrain.backends.spark.node.task import _gpus
    from sparktrain.contract.spec import NodeSpec
    from sparktrain.launchplan.options import RunOptions

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    spec = NodeSpec(
        run_id="r", world_size=2, procs_per_node=1, use_gpu=True, threads=1, payload=None,
        script=None, keep=frozenset(), data_uri=None, attempt=0, options=RunOptions(),
    )  # fmt: skip
    assert _gpus(_Context(["3"]), spec, 0) == ("3",)
    with pytest.raises(ValueError, match=r"\['GPU-1f2e'\] are not plain integers"):
        _gpus(_Context(["GPU-1f2e"]), spec, 0)
    with pytest.raises(ValueError, match="gave this task 2 GPU"):
        _gpus(_Context(["0", "1"]), spec, 0)


def test_a_spark_gpu_address_is_a_position_in_the_executors_cuda_visible_devices(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """pyspark's _get_gpus_owned and spark-tensorflow-distributor read address i as the i-th
    entry of an existing CUDA_VISIBLE_DEVICES (their tests: addresses 0,1,2 with
    CUDA_VISIBLE_DEVICES=3,4,5 are GPUs 3,4,5)."""
    from sparktrain.backends.spark.node.task import _gpus
    from sparktrain.contract.spec import NodeSpec
    from sparktrain.launchplan.options import RunOptions
    from sparktrain.launchplan.topology import spark_gpus

    assert spark_gpus(["0", "1", "2"], ("3", "4", "5")) == ("3", "4", "5")
    assert spark_gpus(["2"], None) == ("2",)
    with pytest.raises(ClusterConfigError, match="has 3 entries"):
        spark_gpus(["3"], ("3", "4", "5"))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "10,11,12,13")
    spec = NodeSpec(
        run_id="r", world_size=4, procs_per_node=2, use_gpu=True, threads=1, payload=None,
        script=None, keep=frozenset(), data_uri=None, attempt=0, options=RunOptions(),
    )  # fmt: skip
    assert _gpus(_Context(["1", "3"]), spec, 1) == ("11", "13")
    shared = dataclasses.replace(spec, world_size=2, procs_per_node=1, gpu_shares=(3, 3))
    assert _gpus(_Context(["0", "1", "2", "3"]), shared, 1) == ("10", "11", "12")


def test_an_unknown_backend_is_refused_with_the_known_ones() -> None:
    from sparktrain import launch

    message = r"backend='sprak' is not one of: local, ray, spark \(or a sparktrain"
    with pytest.raises(ConfigError, match=message):
        launch(print, num_processes=2, use_gpu=False, backend="sprak")
    with pytest.raises(ConfigError, match=message):
        TorchDistributor(2, backend="sprak")  # type: ignore[arg-type]
