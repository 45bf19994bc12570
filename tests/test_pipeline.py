"""prepare_model(..., pp=N): real gloo ranks running pipeline schedules against one process."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from tests.test_tensor_parallel import (
    DIM,
    STEPS,
    VOCAB,
    Block,
    _batch,
    loss_fn,
    one_process,
    run_steps,
)
from torch import nn

from sparktrain import ConfigError, launch
from sparktrain.planner.partition import balanced_bounds
from sparktrain.strategies.split import (
    check_microbatches,
    check_schedule,
    split_children,
)


def pipe_model() -> nn.Sequential:
    """The test transformer as an nn.Sequential: embedding, 4 blocks, norm + head."""
    return nn.Sequential(
        nn.Embedding(VOCAB, DIM),
        Block(),
        Block(),
        Block(),
        Block(),
        nn.Sequential(nn.LayerNorm(DIM), nn.Linear(DIM, VOCAB)),
    )


def reference(steps: int = STEPS) -> list[float]:
    return one_process(pipe_model, steps)


def train(
    strategy: str, options: dict[str, Any], checkpoints: str | None = None, resume: bool = False
) -> Any:
    import torch.distributed as dist

    import sparktrain

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = sparktrain.prepare_model(pipe_model(), strategy, **options)
    losses = run_steps(model, checkpoints, resume)
    return losses, sparktrain.full_state_dict(model), sorted(model.state_dict())


def _whole_model_state_loads(state: dict[str, torch.Tensor]) -> None:
    plain = pipe_model()
    plain.load_state_dict(state)  # strict: every stage's keys, whole tensors
    x, y = _batch()
    assert loss_fn(plain(x), y).item() == pytest.approx(reference(STEPS + 1)[-1], rel=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize(
    "options",
    [
        {"pp": 2, "schedule": "gpipe", "microbatches": 2},
        {"pp": 2, "schedule": "1f1b", "microbatches": 4},
        {"pp": 2, "schedule": "interleaved1f1b", "microbatches": 2},
    ],
    ids=["gpipe", "1f1b", "interleaved"],
)
def test_pp2_schedules_match_one_process(options: dict[str, Any]) -> None:
    result = launch(train, ("ddp", options), num_processes=2, use_gpu=False)
    losses, state, local_keys = result.value  # rank 0: the first stage(s) only
    assert losses == pytest.approx(reference(), rel=1e-5, abs=1e-6)
    assert "0.weight" in local_keys and "5.1.weight" not in local_keys
    _whole_model_state_loads(state)


@pytest.mark.slow
def test_pp2_x_tp2_fsdp_matches_one_process_and_resumes_bit_identically(tmp_path: Path) -> None:
    options = {"pp": 2, "tp": 2, "microbatches": 2}
    through = launch(train, ("fsdp", options, str(tmp_path)), num_processes=4, use_gpu=False)
    assert through.value[0] == pytest.approx(reference(), rel=1e-5, abs=1e-6)
    _whole_model_state_loads(through.value[1])
    resumed = launch(train, ("fsdp", options, str(tmp_path), True), num_processes=4, use_gpu=False)
    assert resumed.value[0] == through.value[0][2:]
    for name, tensor in through.value[1].items():
        assert torch.equal(tensor, resumed.value[1][name]), name


@pytest.mark.slow
def test_pp2_x_dp2_fsdp_matches_one_process() -> None:
    result = launch(train, ("fsdp", {"pp": 2}), num_processes=4, use_gpu=False)
    assert result.value[0] == pytest.approx(reference(), rel=1e-5, abs=1e-6)


def test_split_balances_parameters_and_keeps_names() -> None:
    assert balanced_bounds([10, 1, 1, 1, 1, 10], 2) == [(0, 3), (3, 6)]
    assert balanced_bounds([1, 1, 1, 1], 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    names = [str(i) for i in range(6)]
    assert split_children(names, [1] * 6, 3) == [["0", "1"], ["2", "3"], ["4", "5"]]
    assert split_children(names, [1] * 6, 2, ["4"]) == [["0", "1", "2", "3"], ["4", "5"]]


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: split_children(["0", "1"], [1, 1], 3), "3 pipeline stages need at least 3 layers"),
        (lambda: split_children(["a", "b"], [1, 1], 2, ["c"]), "names 'c', which is no child"),
        (lambda: split_children(["a", "b", "c"], [1] * 3, 3, ["b"]), "3 stages need 2 split"),
        (lambda: split_children(["a", "b", "c"], [1] * 3, 3, ["c", "b"]), "in the model's order"),
        (lambda: check_schedule("zigzag", None), "schedule='zigzag' is not a pipeline schedule"),
        (lambda: check_schedule("interleaved1f1b", 1), "use stages_per_rank=2 or more"),
        (lambda: check_schedule("1f1b", 2), "runs one stage a rank, not 2"),
        (lambda: check_microbatches("1f1b", 2, 4), "microbatches=2 < pp=4"),
        (lambda: check_microbatches("interleaved1f1b", 6, 4), "not a multiple of 4"),
        (lambda: check_microbatches("gpipe", 0, 2), "microbatches=0 must be a positive"),
    ],
)
def test_split_and_schedule_errors_name_the_fix(call: Any, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        call()


def _refused(options: dict[str, Any], model: str, batch: int) -> None:
    import torch.distributed as dist

    import sparktrain

    dist.init_process_group("gloo")
    net = pipe_model() if model == "sequential" else nn.Transformer(d_model=8, nhead=2)
    prepared = sparktrain.prepare_model(net, "fsdp", **options)
    x, y = _batch()
    for size in (4, batch):
        sparktrain.forward_backward(prepared, x[:size], y[:size], loss_fn)


@pytest.mark.parametrize(
    ("options", "model", "batch", "message"),
    [
        ({"pp": 2}, "transformer", 4, "cuts an nn.Sequential into stages, and the model is a"),
        ({"pp": 2, "microbatches": 4}, "sequential", 2, "a batch of 2 does not split into"),
        ({"pp": 2, "microbatches": 2}, "sequential", 2, "the batch shapes changed"),
        ({"pp": 2, "stages_per_rank": 4, "schedule": "loopedbfs"}, "sequential", 4, "8 pipeline"),
        (
            {"pp": 3},
            "sequential",
            4,
            r"pp=3 does not divide 2, so no tp fits with it\. Use pp "
            r"in \[1, 2\]",
        ),
    ],
)
def test_errors_in_the_ranks_name_the_fix(
    options: dict[str, Any], model: str, batch: int, message: str
) -> None:
    with pytest.raises(Exception, match=message):
        launch(_refused, (options, model, batch), num_processes=2, use_gpu=False)
