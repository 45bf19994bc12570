"""HorovodRunner and sparktrain.horovod.torch: the seeds' Horovod example, unchanged, on ranks."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import cloudpickle
import pytest
import torch

from conftest import EXAMPLES
from sparktrain import ConfigError, HorovodRunner, TorchDistributor, TrainingFailedError
from sparktrain.horovod.torch.unsupported import HorovodUnsupportedError

cloudpickle.register_pickle_by_value(sys.modules[__name__])
sys.path.insert(0, str(EXAMPLES))
import horovod_mlp  # noqa: E402
import train_mlp  # noqa: E402

cloudpickle.register_pickle_by_value(horovod_mlp)
cloudpickle.register_pickle_by_value(train_mlp)


def _seed_example_with_checks(epochs: int) -> tuple[torch.nn.Module, list[float]]:
    import horovod.torch as hvd

    model = horovod_mlp.train_hvd(epochs=epochs)
    flat = torch.nn.utils.parameters_to_vector(model.parameters()).detach()
    gathered = hvd.allgather(flat.unsqueeze(0))
    spread = [float((row - gathered[0]).abs().max()) for row in gathered]
    return model, spread


def test_seed_example_unchanged_matches_ddp(capfd: pytest.CaptureFixture[str]) -> None:
    model, spread = HorovodRunner(np=-2).run(_seed_example_with_checks, epochs=2)
    assert spread == [0.0, 0.0]  # every rank ends with rank 0's parameters
    data = train_mlp.make_dataset()
    assert train_mlp.mean_loss(model, data) < 0.5 * train_mlp.mean_loss(
        train_mlp.make_model(), data
    )
    out = capfd.readouterr()
    said = "Horovod is not installed; `import horovod.torch` gives sparktrain.horovod.torch"
    assert (out.out + out.err).count(said) == 2  # once in each rank's log
    assert "rank 1 epoch 1 loss" in out.out
    assert "horovod" not in sys.modules  # the alias lives in the ranks only
    # The DDP version of the same example: same seed, same effective learning rate (1e-3 * 2).
    ddp = TorchDistributor(2, True, False).run(train_mlp.train_fn, epochs=2, lr=2e-3)
    for p_hvd, p_ddp in zip(model.parameters(), ddp.parameters(), strict=True):
        torch.testing.assert_close(p_hvd, p_ddp, rtol=1e-4, atol=1e-5)


def _accumulate(lr: float) -> dict[str, object]:
    import horovod.torch as hvd

    hvd.init()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    optimizer = hvd.DistributedOptimizer(
        optimizer, named_parameters=model.named_parameters(), backward_passes_per_step=2
    )
    for k in range(2):
        model(_batch(hvd.rank(), k)).pow(2).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
    try:
        for k in range(3):
            model(_batch(hvd.rank(), k)).pow(2).sum().backward()
        error = ""
    except AssertionError as exc:
        error = str(exc)
    return {"state": {k: v.clone() for k, v in model.state_dict().items()}, "error": error}


def _batch(rank: int, k: int) -> torch.Tensor:
    return torch.randn(3, 4, generator=torch.Generator().manual_seed(10 * rank + k))


def test_backward_passes_per_step_accumulates_then_averages() -> None:
    out = HorovodRunner(np=-2, use_gpu=False).run(_accumulate, lr=0.1)
    torch.manual_seed(0)
    reference = torch.nn.Linear(4, 1)
    start = {k: v.clone() for k, v in reference.state_dict().items()}
    for rank in range(2):  # each rank sums two passes; Horovod averages the sums over ranks
        for k in range(2):
            reference(_batch(rank, k)).pow(2).sum().backward()
    for name, param in reference.named_parameters():
        assert param.grad is not None
        expected = start[name] - 0.1 * param.grad / 2
        torch.testing.assert_close(out["state"][name], expected)
    assert "more than backward_passes_per_step times" in out["error"]


def _collectives() -> dict[str, object]:
    import horovod.torch as hvd

    hvd.init()
    r = hvd.rank()
    mine = torch.tensor([1.0 + r, 10.0])
    handle = hvd.allreduce_async(mine, op=hvd.Sum)
    model = torch.nn.Linear(2, 2)
    torch.nn.init.constant_(model.weight, float(r))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1 * (r + 1))
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    hvd.broadcast_parameters(model.state_dict(), root_rank=1)
    hvd.broadcast_optimizer_state(optimizer, root_rank=1)
    return {
        "ranks": (hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size()),
        "nodes": (hvd.cross_rank(), hvd.cross_size()),
        "average": hvd.allreduce(mine).tolist(),
        "sum_async": hvd.synchronize(handle).tolist(),
        "fp16": hvd.allreduce(mine, compression=hvd.Compression.fp16).dtype,
        "max": hvd.allreduce(mine, op=hvd.Max).tolist(),
        "gather": hvd.allgather(torch.arange(r + 1)).tolist(),
        "objects": hvd.allgather_object({"rank": r}),
        "broadcast": hvd.broadcast(mine, root_rank=1).tolist(),
        "object": hvd.broadcast_object(f"from {r}", root_rank=1),
        "weight": model.weight.detach().clone(),
        "lr": optimizer.param_groups[0]["lr"],
        "joined": hvd.join(),
    }


def test_collectives_on_two_ranks() -> None:
    out = HorovodRunner(np=-2, use_gpu=False).run(_collectives)
    assert out["ranks"] == (0, 2, 0, 2) and out["nodes"] == (0, 1)
    assert out["average"] == [1.5, 10.0] and out["sum_async"] == [3.0, 20.0]
    assert out["fp16"] == torch.float32 and out["max"] == [2.0, 10.0]
    assert out["gather"] == [0, 0, 1] and out["objects"] == [{"rank": 0}, {"rank": 1}]
    assert out["broadcast"] == [2.0, 10.0] and out["object"] == "from 1"
    assert out["lr"] == pytest.approx(0.2)  # rank 1's optimizer state reached rank 0
    assert not torch.equal(out["weight"], torch.zeros(2, 2))
    assert out["joined"] in (0, 1)


def _calls_reducescatter() -> None:
    import horovod.torch as hvd

    hvd.init()
    hvd.reducescatter(torch.ones(4))


def test_unsupported_call_is_named_in_the_failure() -> None:
    with pytest.raises(TrainingFailedError) as info:
        HorovodRunner(np=-1, use_gpu=False).run(_calls_reducescatter)
    message = str(info.value)
    assert "horovod.torch.reducescatter is not provided" in message
    assert "torch.distributed.reduce_scatter_tensor" in message


def test_unsupported_names_and_adasum_in_process() -> None:
    import sparktrain.horovod.torch as hvd

    with pytest.raises(HorovodUnsupportedError, match=r"alltoall .*all_to_all_single"):
        hvd.alltoall(torch.ones(2))
    assert not hasattr(hvd, "SyncBatchNorm")  # still an AttributeError for hasattr
    with pytest.raises(ValueError, match=r"hvd\.init\(\)"):
        hvd.rank()
    hvd.init()  # outside any launch: a group of one, as Horovod without horovodrun
    try:
        assert (hvd.rank(), hvd.size()) == (0, 1)
        model = torch.nn.Linear(2, 1)
        with pytest.raises(ConfigError, match="op=MAX cannot reduce gradients"):
            hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), op=hvd.Max)
        with pytest.raises(ConfigError, match="not named"):
            hvd.DistributedOptimizer(
                torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=[("w", model.weight)]
            )
    finally:
        hvd.shutdown()


def _which_horovod() -> str:
    import horovod.torch

    return str(horovod.torch.__file__)


def test_installed_horovod_is_used_as_is(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    package = tmp_path / "horovod"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "torch.py").write_text("def init():\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))  # the ranks inherit the caller's sys.path
    assert HorovodRunner(np=-1, use_gpu=False).run(_which_horovod) == str(package / "torch.py")
    assert "using the installed Horovod" in capfd.readouterr().err
    sys.modules.pop("horovod", None)


def test_bad_inputs_name_the_value() -> None:
    with pytest.raises(ConfigError, match=r"np='2' \(str\) must be an int"):
        HorovodRunner(np="2")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="np=True"):
        HorovodRunner(np=True)
    with pytest.raises(ConfigError, match="driver_log_verbosity='some'"):
        HorovodRunner(np=-1, driver_log_verbosity="some")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="must be the training function"):
        HorovodRunner(np=-1, use_gpu=False).run("train.py")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="use_gpu=False"):
            HorovodRunner(np=-2, use_gpu=True)


@pytest.mark.spark
def test_np_positive_runs_on_spark_executors(spark: object) -> None:
    out = HorovodRunner(np=2, use_gpu=False).run(_collectives)
    assert out["ranks"][:2] == (0, 2) and out["nodes"] == (0, 2)  # one rank per executor
    assert out["average"] == [1.5, 10.0] and out["gather"] == [0, 0, 1]
    assert HorovodRunner(np=0, use_gpu=False).num_processes == 2  # every task slot
    assert os.environ.get("HOROVOD_RANK") is None


# -- Adasum --------------------------------------------------------------------------------


def test_adasum_sums_orthogonal_and_averages_parallel_tensors() -> None:
    """Horovod's definition (docs/adasum_user_guide.rst): a sum for orthogonal gradients, an
    average for parallel ones."""
    from sparktrain.horovod.torch import adasum

    a, b = torch.tensor([1.0, 0.0, 0.0]), torch.tensor([0.0, 2.0, 0.0])
    assert torch.allclose(adasum.combine(a, b), a + b)
    assert torch.allclose(adasum.combine(a, a), a)
    assert torch.allclose(adasum.combine(torch.zeros(3), b), b)
    c = torch.tensor([3.0, 1.0, -1.0])
    assert torch.allclose(adasum.tree([a, b, c]), adasum.combine(adasum.combine(a, b), c))


def _adasum_ranks() -> dict[str, object]:
    import horovod.torch as hvd

    from sparktrain.horovod.torch import adasum

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    mine = torch.tensor([float(rank + 1), float(rank) ** 2, 1.0])
    reduced = hvd.allreduce(mine, op=hvd.Adasum)
    expected = adasum.tree([torch.tensor([float(r + 1), float(r) ** 2, 1.0]) for r in range(size)])
    torch.manual_seed(rank)  # different data on each rank
    model = torch.nn.Linear(3, 1)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(), op=hvd.Adasum
    )
    x, y = torch.randn(16, 3), torch.randn(16, 1)
    losses = []
    for _ in range(5):
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(float(loss))
    weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return {"reduced": reduced, "expected": expected, "weights": weights, "losses": losses}


@pytest.mark.parametrize("ranks", [2, 3])
def test_adasum_allreduce_and_optimizer_on_ranks(ranks: int) -> None:
    """op=hvd.Adasum: every rank gets the same Adasum of all ranks' tensors (3 ranks too, which
    Horovod refuses on CPUs), and DistributedOptimizer(op=Adasum) keeps every rank's parameters
    equal while it trains."""
    from sparktrain import launch

    values = launch(_adasum_ranks, num_processes=ranks, use_gpu=False, return_all=True)
    outs = [values.return_values[r] for r in range(ranks)]
    for out in outs:
        assert torch.allclose(out["reduced"], out["expected"], atol=1e-6)
        assert torch.equal(out["weights"], outs[0]["weights"])
    assert outs[0]["losses"][-1] < outs[0]["losses"][0]
