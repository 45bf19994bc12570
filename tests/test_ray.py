"""The Ray backend on a real local Ray cluster: results, logs, failures, restarts, cleanup."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import cloudpickle
import pytest
import torch

import test_faults
from conftest import EXAMPLES, free_port, wait_gone
from sparktrain import ConfigError, TorchDistributor, TrainingFailedError, launch
from sparktrain.backends.ray.layout import RayNode, make_ray_plan, placement

# Ray's workers do not have tests/ or examples/ on their path: ship these modules by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])
cloudpickle.register_pickle_by_value(test_faults)
sys.path.insert(0, str(EXAMPLES))
import train_mlp  # noqa: E402

cloudpickle.register_pickle_by_value(train_mlp)


# -- layout (pure) ------------------------------------------------------------------------------
def test_one_node_holds_every_rank_in_one_packed_bundle() -> None:
    plan = make_ray_plan(2, [RayNode("10.0.0.1", 8, 0)], use_gpu=False)
    assert (plan.nodes, plan.procs_per_node, plan.threads_per_rank) == (1, 2, 4)
    assert placement(plan) == ([{"CPU": 8.0}], "PACK")


def test_ranks_spread_over_the_fewest_nodes() -> None:
    nodes = [RayNode("a", 1, 0), RayNode("b", 1, 0), RayNode("c", 0, 0)]  # a Ray-on-Spark shape
    plan = make_ray_plan(2, nodes, use_gpu=False)
    assert (plan.nodes, plan.procs_per_node) == (2, 1)
    assert placement(plan) == ([{"CPU": 1.0}, {"CPU": 1.0}], "STRICT_SPREAD")
    gpus = make_ray_plan(4, [RayNode("a", 8, 2), RayNode("b", 8, 2)])
    assert (gpus.device, gpus.nodes, gpus.procs_per_node) == ("cuda", 2, 2)
    assert placement(gpus) == ([{"CPU": 2.0, "GPU": 2.0}] * 2, "STRICT_SPREAD")


def test_too_many_ranks_name_what_the_nodes_have() -> None:
    with pytest.raises(ConfigError, match=r"num_processes=3 does not fit .* \[2, 1\] CPU"):
        make_ray_plan(3, [RayNode("a", 2, 0), RayNode("b", 1, 0)], use_gpu=False)
    with pytest.raises(ConfigError, match="no node of the Ray cluster has a GPU"):
        make_ray_plan(1, [RayNode("a", 2, 0)], use_gpu=True)


def test_missing_ray_gives_the_install_hint(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)
    with pytest.raises(ConfigError, match=r"pip install 'sparktrain\[ray\]'"):
        launch(print, num_processes=2, backend="ray")


# -- on a local Ray cluster ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def ray_address() -> Iterator[str]:
    """A local Ray head node started with ``ray start`` (its daemons outlive the command, so
    they are not this process's children); ended by PID at the end of the module. Token
    authentication is off on both sides, whatever token file ``~/.ray`` holds."""
    pytest.importorskip("ray")
    saved = os.environ.get("RAY_AUTH_MODE")
    os.environ["RAY_AUTH_MODE"] = "disabled"
    from sparktrain.backends.ray import procs

    temp_dir = tempfile.mkdtemp(prefix="st-ray-", dir="/tmp")  # Ray's socket paths must be short
    port = free_port()
    ray_cli = str(Path(sys.executable).parent / "ray")
    command = [
        sys.executable, ray_cli, "start", "--head", f"--port={port}", "--num-cpus=2",
        "--num-gpus=0", "--include-dashboard=false", "--disable-usage-stats",
        f"--temp-dir={temp_dir}",
    ]  # fmt: skip
    started = subprocess.run(command, check=False, capture_output=True, text=True, timeout=120)
    assert started.returncode == 0, started.stdout + started.stderr
    try:
        yield f"127.0.0.1:{port}"
    finally:
        import ray

        ray.shutdown()
        found = procs.matching([temp_dir])
        for pid, _ in found:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        if saved is None:
            os.environ.pop("RAY_AUTH_MODE", None)
        else:
            os.environ["RAY_AUTH_MODE"] = saved
        assert procs.end(found, grace=10.0) == set()


def _tagged_train(epochs: int) -> torch.nn.Module:
    model = train_mlp.train_fn(epochs=epochs)
    model.module.trained_on_rank = int(os.environ["RANK"])
    model.module.pids = _lineage()
    return model


def _lineage() -> list[int]:
    """This rank, its fork server and the fork server's parent (the node's Ray actor)."""
    server = os.getppid()
    with open(f"/proc/{server}/stat") as stat:
        actor = int(stat.read().rsplit(")", 1)[1].split()[1])
    return [os.getpid(), server, actor]


def test_seed_mlp_on_ray(ray_address: str, capfd: pytest.CaptureFixture[str]) -> None:
    result = launch(
        _tagged_train,
        (2,),
        num_processes=2,
        use_gpu=False,
        backend="ray",
        ray_address=ray_address,
        return_all=True,
    )
    models = result.return_values
    assert models[0].trained_on_rank == 0 and models[1].trained_on_rank == 1
    for p0, p1 in zip(models[0].parameters(), models[1].parameters(), strict=True):
        assert torch.equal(p0, p1)
    data = train_mlp.make_dataset()
    before = train_mlp.mean_loss(train_mlp.make_model(), data)
    assert train_mlp.mean_loss(models[0], data) < 0.5 * before
    assert [node.ranks for node in result.nodes] == [(0, 1)]  # one Ray node: one actor
    host = result.nodes[0].host
    out = capfd.readouterr().out
    assert f"[rank 0 {host}] epoch 0 loss" in out and f"[rank 1 {host}] epoch 1 loss" in out
    assert models[0].pids[2] == models[1].pids[2]  # one actor per node
    assert wait_gone({*models[0].pids, *models[1].pids}) == []  # ranks, fork server, actor


def _fail_on_rank_one(pid_dir: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    Path(pid_dir, os.environ["RANK"]).write_text(" ".join(map(str, _lineage())))
    dist.barrier()
    if dist.get_rank() == 1:
        raise ValueError("loss is nan on rank 1")
    dist.barrier()


def test_failing_rank_is_named_with_its_traceback(ray_address: str, tmp_path: Path) -> None:
    import ray

    distributor = TorchDistributor(2, use_gpu=False, backend="ray", ray_address=ray_address)
    with pytest.raises(TrainingFailedError) as info:
        distributor.run(_fail_on_rank_one, str(tmp_path))
    error = info.value
    assert error.culprit is not None and error.culprit.rank == 1
    assert error.victims == (0,)
    assert "ValueError: loss is nan on rank 1" in str(error)
    assert "in _fail_on_rank_one" in error.culprit.traceback
    pids = {int(p) for f in tmp_path.iterdir() for p in f.read_text().split()}
    assert len(pids) == 4 and wait_gone(pids) == []
    groups = ray.util.placement_group_table().values()
    assert groups and all(g["state"] == "REMOVED" for g in groups)


def test_restart_resumes_from_checkpoint(ray_address: str, tmp_path: Path) -> None:
    result = launch(
        test_faults.resumable_train,
        (str(tmp_path), 4, 1, 2),  # rank 1 is SIGKILLed in epoch 2 of the first attempt
        num_processes=2,
        use_gpu=False,
        backend="ray",
        ray_address=ray_address,
        max_restarts=1,
    )
    assert result.attempts == 2
    # Resumed after epoch 1, or after epoch 0 when epoch 1's checkpoint was still in flight.
    assert result.value["start"] in (1, 2) and result.value["restart"] == 1


def test_reports_stop_and_tune_on_ray(ray_address: str) -> None:
    import sparktrain
    import test_progress
    import test_tune

    cloudpickle.register_pickle_by_value(test_progress)
    cloudpickle.register_pickle_by_value(test_tune)
    stopped = launch(
        test_progress._forever,
        num_processes=2,
        use_gpu=False,
        backend="ray",
        ray_address=ray_address,
        progress=False,
        timeout=120,
        on_report=lambda rank, record: record["step"] >= 10,
    )
    assert stopped.stopped and stopped.value is None
    result = sparktrain.tune(
        test_tune._fit,
        {"lr": sparktrain.tuning.choice([0.05, 0.4]), "epochs": 3},
        num_trials=2,
        metric="loss",
        num_processes_per_trial=2,
        scheduler=None,
        sampler=__import__("optuna").samplers.GridSampler({"lr": [0.05, 0.4]}),
        backend="ray",
        ray_address=ray_address,
    )
    assert sorted(t.config["lr"] for t in result.trials) == [0.05, 0.4]
    assert result.best_config is not None and result.best_config["lr"] == 0.4


def test_back_to_back_ddp_runs_never_hang_on_ray(ray_address: str) -> None:
    """The teardown deadlock's pattern (DDP, destroy, return), run after run, on Ray actors."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import stress_patterns

    cloudpickle.register_pickle_by_value(stress_patterns)
    values = [
        launch(
            stress_patterns.destroy_then_return, num_processes=2, use_gpu=False, timeout=60,
            backend="ray", ray_address=ray_address,
        ).value
        for _ in range(6)
    ]  # fmt: skip
    assert values == [stress_patterns.VALUE] * 6


def _stream_ids(dataset: object) -> list[int]:
    return [i for batch in dataset for i in batch["id"].tolist()]  # type: ignore[attr-defined]


def test_streamed_parquet_on_ray(ray_address: str, tmp_path: Path) -> None:
    import test_data
    from sparktrain.data import from_parquet

    path = test_data.write_ids(tmp_path / "data")
    dataset = from_parquet(path, batch_size=64, columns=["id"])
    result = launch(
        _stream_ids, (dataset,), num_processes=2, backend="ray", ray_address=ray_address,
        return_all=True,
    )  # fmt: skip
    shares = result.return_values
    assert len(shares[0]) == len(shares[1]) == 501
    assert set(shares[0]) | set(shares[1]) == set(range(test_data.ROWS))


def test_pipeline_stages_on_ray(ray_address: str) -> None:
    from tests import test_pipeline, test_tensor_parallel

    for module in (test_pipeline, test_tensor_parallel):
        cloudpickle.register_pickle_by_value(module)
    options = {"pp": 2, "schedule": "1f1b", "microbatches": 2}
    result = launch(
        test_pipeline.train,
        ("ddp", options),
        num_processes=2,
        use_gpu=False,
        backend="ray",
        ray_address=ray_address,
    )
    assert result.value[0] == pytest.approx(test_pipeline.reference(), rel=1e-5, abs=1e-6)


def test_score_files_on_ray_restarts_and_skips_written_parts(
    ray_address: str, tmp_path: Path
) -> None:
    from test_inference import scored_through_a_crash

    scored_through_a_crash(tmp_path, backend="ray", ray_address=ray_address)
