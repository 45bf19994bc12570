"""Training resumed at another world size continues as if it had not stopped: DDP, FSDP2, ZeRO.

An elastic run restarts from its latest checkpoint with fewer or more ranks. Each test runs the
same function twice on real gloo ranks. The first run (the reference) trains a tiny model for
``STEPS`` steps, checkpoints it, and goes on for one more step without stopping. The second run,
at another world size, builds the model from another seed, loads the checkpoint, and takes that
same step (the same global batch, split over its own ranks). On every rank of the second run the
gathered parameters and optimizer state must equal the saved ones bit for bit, and the step's loss
and parameters must equal the reference's up to the order of the gradient sums.

- DDP: rank 0's full state (``checkpoint.save``), or every rank's through torch distributed
  checkpoint (``sharded=True``).
- FSDP2: each rank's shards, resharded on load by torch distributed checkpoint (unevenly too).
- ZeRO-1/2/3 (DeepSpeed engines): ``engine.save_checkpoint`` converted to a DeepSpeed universal
  checkpoint, loaded with ``{"checkpoint": {"load_universal": True}}``.
- ZeRO-2 and ZeRO-3: each rank's fragments of its partitions through sparktrain's asynchronous
  sharded format (``sharded_state`` and ``load_sharded_state``), resharded on load.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from sparktrain import TrainingFailedError, launch

GLOBAL_BATCH = 12  # divides among 1, 2, 3 and 4 ranks
STEPS = 2  # trained before the checkpoint
LR = 1e-2
PERSIST = "stage3_param_persistence_threshold"  # ZeRO-3 keeps smaller parameters whole


def _model(seed: int) -> nn.Module:
    """16 rows then 4: three ranks shard them unevenly (6, 6, 4 and 2, 2, 0)."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def _step(model: Any, optimizer: Any, step: int) -> float:
    """One step on this rank's share of the global batch of ``step``; the global mean loss."""
    import torch.distributed as dist

    import sparktrain.strategies as st

    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(GLOBAL_BATCH, 8, generator=g)
    y = torch.randn(GLOBAL_BATCH, 4, generator=g)
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = slice(rank * GLOBAL_BATCH // world, (rank + 1) * GLOBAL_BATCH // world)
    loss = nn.functional.mse_loss(model(x[mine]), y[mine])
    optimizer.zero_grad()
    st.backward(loss, optimizer)
    optimizer.step()
    total = loss.detach().clone()
    dist.all_reduce(total)
    return float(total) / world


def _torch_full(model: Any, optimizer: Any) -> dict[str, Any]:
    """Whole parameters and optimizer state (gathered from the shards), keyed by name."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    options = StateDictOptions(full_state_dict=True)
    params, optim = get_state_dict(model, optimizer, options=options)
    clone = {k: v.detach().clone() for k, v in params.items()}
    states = {
        name: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}
        for name, state in optim["state"].items()
    }
    groups = [{k: v for k, v in group.items() if k != "params"} for group in optim["param_groups"]]
    return {"params": clone, "optim": states, "groups": groups}


def train_or_resume(ckpt: str, strategy: str, sharded: bool, seed: int) -> dict[str, Any]:
    """DDP or FSDP2: resume from ``ckpt`` if it holds a checkpoint, else train and save one."""
    import torch.distributed as dist

    import sparktrain.strategies as st
    from sparktrain import checkpoint

    dist.init_process_group("gloo")
    model = st.prepare_model(_model(seed), strategy)
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    fresh = st.full_state_dict(model)
    rescaled: list[tuple[int, int]] = []
    if sharded:
        loaded = st.load_sharded_state(
            model, optimizer, ckpt, on_rescale=lambda old, new: rescaled.append((old, new))
        )
    else:
        loaded = checkpoint.load_latest(
            ckpt, on_rescale=lambda old, new: rescaled.append((old, new))
        )
        if loaded is not None:
            model.module.load_state_dict(loaded.state["model"])
            optimizer.load_state_dict(loaded.state["optim"])
    if loaded is None:
        for step in range(STEPS):
            _step(model, optimizer, step)
        if sharded:
            state = st.sharded_state(model, optimizer)
        else:
            state = {"model": model.module.state_dict(), "optim": optimizer.state_dict()}
        checkpoint.save(state, ckpt, STEPS, sharded=sharded)
    at = _torch_full(model, optimizer)
    loss = _step(model, optimizer, STEPS)
    after = st.full_state_dict(model)
    dist.destroy_process_group()
    saved_by = loaded.world_size if loaded is not None else None
    return {
        "fresh": fresh,
        "saved_by": saved_by,
        "rescaled": rescaled,
        "at": at,
        "loss": loss,
        "after": after,
    }


def _equal(a: Any, b: Any) -> bool:
    """Bit for bit, through dicts and lists."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and torch.equal(a, b)
        )
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def _two_runs(fn: Any, args: tuple, saved_at: int, loaded_at: int) -> tuple[dict, dict[int, dict]]:
    """The reference (seed 0) at ``saved_at`` ranks, then the resumed run (seed 1)."""
    reference = launch(fn, (*args, 0), num_processes=saved_at, use_gpu=False).value
    resumed = launch(
        fn, (*args, 1), num_processes=loaded_at, use_gpu=False, return_all=True
    ).return_values
    assert sorted(resumed) == list(range(loaded_at))
    return reference, dict(resumed)


def _continues_exactly(reference: dict, got: dict) -> None:
    saved = reference["at"]["params"]
    assert got["fresh"].keys() == saved.keys()
    assert not any(torch.equal(got["fresh"][k], saved[k]) for k in saved)  # the load has work
    assert _equal(got["at"], reference["at"])  # parameters and optimizer state, bit for bit
    assert got["loss"] == pytest.approx(reference["loss"], rel=1e-6, abs=0)
    torch.testing.assert_close(got["after"], reference["after"], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize(
    ("strategy", "sharded", "saved_at", "loaded_at"),
    [
        ("ddp", False, 2, 3),  # rank 0's full state
        ("ddp", True, 2, 1),  # every rank's, through torch distributed checkpoint
        ("fsdp", True, 4, 2),
        ("fsdp", True, 2, 3),  # uneven shards, one of them empty
    ],
)
def test_ddp_and_fsdp_resume_at_another_world_size(
    tmp_path: Path, strategy: str, sharded: bool, saved_at: int, loaded_at: int
) -> None:
    reference, resumed = _two_runs(
        train_or_resume, (str(tmp_path), strategy, sharded), saved_at, loaded_at
    )
    assert reference["saved_by"] is None  # the reference trained from scratch
    for got in resumed.values():
        assert got["saved_by"] == saved_at
        assert got["rescaled"] == [(saved_at, loaded_at)]
        _continues_exactly(reference, got)


def _zero_full(model: Any, optimizer: Any) -> dict[str, Any]:
    """A ZeRO model's whole parameters (module and fp32 master) and Adam state, gathered."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    import sparktrain.strategies as st

    out: dict[str, Any] = {"params": st.full_state_dict(model), "master": {}, "optim": {}}
    for name, param in model.module.named_parameters():
        out["master"][name] = safe_get_full_fp32_param(param).clone()
        out["optim"][name] = {
            key: safe_get_full_optimizer_state(param, key).clone()
            for key in ("exp_avg", "exp_avg_sq")
        }
    inner = optimizer.engine.optimizer.optimizer  # the torch Adam over this rank's partitions
    out["adam_steps"] = sorted({float(s["step"]) for s in inner.state.values()})
    out["engine_steps"] = optimizer.engine.global_steps
    return out


def zero_train_or_resume(ckpt: str, strategy: str, how: str, seed: int) -> dict[str, Any]:
    """ZeRO: resume from the checkpoint in ``ckpt`` if there is one, else train and save one.

    ``how``: ``"universal"``: DeepSpeed's checkpoint, which rank 0 first converts to a universal
    one, which the engine (built with ``load_universal``) loads; ``"deepspeed"``: the engine
    loads DeepSpeed's own checkpoint; ``"sparktrain"``: ``sharded_state`` saved with
    ``checkpoint.save(..., sharded=True)`` (asynchronous) and ``load_sharded_state``.
    """
    import torch.distributed as dist

    import sparktrain.strategies as st
    from sparktrain import checkpoint

    dist.init_process_group("gloo")
    if how == "sparktrain":
        resume = checkpoint.latest_step(ckpt) is not None
    else:
        resume = os.path.exists(os.path.join(ckpt, "latest"))
    config: dict[str, Any] = {}
    if resume and how == "universal":
        config = {"checkpoint": {"load_universal": True}}
    if strategy == "zero3-partitioned":  # no parameter kept whole on every rank
        strategy, config = "zero3", {"zero_optimization": {"stage": 3, PERSIST: 0}}
    model = st.prepare_model(_model(seed), strategy, deepspeed_config=config)
    optimizer = st.prepare_optimizer(torch.optim.Adam(model.parameters(), lr=LR), model)
    fresh = st.full_state_dict(model)
    rescaled: list[tuple[int, int]] = []
    if resume and how == "sparktrain":
        model(torch.zeros(1, 8))  # a forward first: ZeRO-3 holds its parameters gathered
        on_rescale = lambda old, new: rescaled.append((old, new))  # noqa: E731
        assert st.load_sharded_state(model, optimizer, ckpt, on_rescale=on_rescale) is not None
    elif resume:
        if how == "universal":
            if dist.get_rank() == 0:
                st.to_universal(Path(ckpt, f"step{STEPS}"))
            dist.barrier()
        path, _ = model.engine.load_checkpoint(ckpt)
        assert path is not None
    else:
        for step in range(STEPS):
            _step(model, optimizer, step)
        if how == "sparktrain":
            checkpoint.save(st.sharded_state(model, optimizer), ckpt, STEPS, sharded=True)
        else:
            model.engine.save_checkpoint(ckpt, tag=f"step{STEPS}")
    at = _zero_full(model, optimizer)
    loss = _step(model, optimizer, STEPS)
    after = st.full_state_dict(model)
    dist.destroy_process_group()
    return {"fresh": fresh, "at": at, "loss": loss, "after": after, "rescaled": rescaled}


@pytest.mark.parametrize(
    ("strategy", "saved_at", "loaded_at"),
    [("zero1", 2, 3), ("zero2", 4, 2), ("zero3", 2, 3)],
)
def test_zero_resumes_at_another_world_size_through_a_universal_checkpoint(
    tmp_path: Path, strategy: str, saved_at: int, loaded_at: int
) -> None:
    pytest.importorskip("deepspeed")
    reference, resumed = _two_runs(
        zero_train_or_resume, (str(tmp_path), strategy, "universal"), saved_at, loaded_at
    )
    partitions = list((tmp_path / f"step{STEPS}").glob("*optim_states.pt"))
    assert len(partitions) == saved_at  # one optimizer partition per rank that saved
    assert (tmp_path / "latest_universal").read_text() == f"step{STEPS}_universal"
    assert reference["at"]["adam_steps"] == [float(STEPS)]
    assert reference["at"]["engine_steps"] == STEPS
    for got in resumed.values():
        _continues_exactly(reference, got)


def test_a_zero_checkpoint_alone_loads_only_at_its_own_world_size(tmp_path: Path) -> None:
    pytest.importorskip("deepspeed")
    launch(
        zero_train_or_resume,
        (str(tmp_path), "zero2", "deepspeed", 0),
        num_processes=2,
        use_gpu=False,
    )
    with pytest.raises(
        TrainingFailedError, match="used a DP world size of 2 but the current world"
    ):
        launch(
            zero_train_or_resume,
            (str(tmp_path), "zero2", "deepspeed", 1),
            num_processes=1,
            use_gpu=False,
        )


@pytest.mark.parametrize(
    ("strategy", "saved_at", "loaded_at"),
    [
        ("zero2", 4, 2),
        ("zero3", 2, 3),  # at 3 ranks every partition is padded; these small parameters are
        ("zero3-partitioned", 3, 2),  # kept whole on every rank unless told otherwise
        ("zero2_offload", 2, 3),  # the optimizer's state in host memory, its gradients kept
        ("zero3_offload", 3, 2),
    ],
)
def test_zero_resumes_at_another_world_size_from_sparktrains_sharded_format(
    tmp_path: Path, strategy: str, saved_at: int, loaded_at: int
) -> None:
    pytest.importorskip("deepspeed")
    reference, resumed = _two_runs(
        zero_train_or_resume, (str(tmp_path), strategy, "sparktrain"), saved_at, loaded_at
    )
    (saved,) = list(tmp_path.glob("step-*"))
    assert len(list(saved.glob("*.distcp"))) == saved_at  # every rank wrote its own fragments
    assert reference["at"]["adam_steps"] == [float(STEPS)]
    for got in resumed.values():
        assert got["rescaled"] == [(saved_at, loaded_at)]
        assert got["at"]["engine_steps"] == STEPS
        _continues_exactly(reference, got)


def test_a_zero0_model_or_one_without_its_engine_is_refused_by_the_sharded_state() -> None:
    from sparktrain import ConfigError
    from sparktrain.strategies import reshard, zero

    stage0 = zero.ZeroModel(nn.Linear(2, 2), {"zero_optimization": {"stage": 0}})
    with pytest.raises(ConfigError, match=r"ZeRO-0 model has no partitions .*full_state_dict"):
        reshard.sharded_state(stage0, torch.optim.SGD(stage0.parameters(), lr=0.1))
    stage3 = zero.ZeroModel(nn.Linear(2, 2), {"zero_optimization": {"stage": 3}})
    with pytest.raises(ConfigError, match=r"no engine yet: call .*prepare_optimizer"):
        reshard.load_sharded_state(stage3, None, "/nowhere")
