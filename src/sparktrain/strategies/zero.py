"""DeepSpeed ZeRO stages behind the same three calls as DDP and FSDP.

DeepSpeed wraps the model and the optimizer together (``deepspeed.initialize``), so
``prepare_model`` returns a :class:`ZeroModel` (the module, moved to the device, plus its ZeRO
configuration) and ``prepare_optimizer`` builds the engine from it and the user's torch
optimizer; from then on the model's forward goes through the engine, and
:func:`sparktrain.backward` and ``optimizer.step()`` call the engine's ``backward`` and ``step``.
A torch optimizer is used as given, so no DeepSpeed op has to be compiled for it.

Runs inside a rank. One :class:`ZeroStrategy` object per stage and offload variant; each names
the planner row that prices it. The planner has no row for stage 1 with offload: DeepSpeed's
ZeRO-Offload moves the gradients to the CPU at stage 1 as at stage 2 (one optimizer runs both), so
``zero2_offload`` prices it. Every stage keeps a weightless skeleton for ``plain_module``: ZeRO-3
partitions the parameters, and at every stage DeepSpeed casts the module to bf16 or fp16 in place,
so the plain module is rebuilt in the user's dtypes on the CPU.
"""

from __future__ import annotations

import copy
from typing import Any

from torch import nn

from sparktrain.ground.errors import ConfigError
from sparktrain.planner.strategies import Strategy as PlannerRow
from sparktrain.strategies.base import Strategy, mark
from sparktrain.strategies.options import PrepareOptions

#: strategy name -> (ZeRO stage, optimizer states offloaded to CPU, parameters offloaded)
STAGES: dict[str, tuple[int, bool, bool]] = {
    "zero1": (1, False, False),
    "zero2": (2, False, False),
    "zero3": (3, False, False),
    "zero1_offload": (1, True, False),
    "zero2_offload": (2, True, False),
    "zero3_offload": (3, True, True),
}

_config_for_ranks: dict[str, Any] | None = None


def set_config(config: dict[str, Any] | None) -> None:
    """Record the DeepSpeed configuration given to the launch (``DeepspeedTorchDistributor``)."""
    global _config_for_ranks  # noqa: PLW0603 - one configuration per rank process
    _config_for_ranks = config


def deepspeed_config() -> dict[str, Any] | None:
    """Inside a rank: the DeepSpeed configuration given to ``DeepspeedTorchDistributor``."""
    return copy.deepcopy(_config_for_ranks)


def _deepspeed() -> Any:
    try:
        import deepspeed
    except ImportError:
        raise ConfigError(
            "the ZeRO strategies run through DeepSpeed: pip install --no-build-isolation "
            "'deepspeed>=0.14' (after torch), or use strategy='fsdp'."
        ) from None
    return deepspeed


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def zero_config(
    strategy: str, precision: str | None, user: dict[str, Any] | None
) -> dict[str, Any]:
    """The DeepSpeed configuration of a ZeRO strategy; the user's settings win."""
    stage, offload_optimizer, offload_params = STAGES[strategy]
    zero: dict[str, Any] = {"stage": stage}
    if offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu"}
    if offload_params:
        zero["offload_param"] = {"device": "cpu"}
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "zero_optimization": zero,
        "zero_force_ds_cpu_optimizer": False,  # the user's torch optimizer is used as it is
    }
    if precision == "bf16":
        config["bf16"] = {"enabled": True}
    elif precision == "fp16":
        config["fp16"] = {"enabled": True}
    return _merge(config, user or {})


class ZeroModel(nn.Module):
    """A module bound for a DeepSpeed engine; forward goes through the engine once built."""

    def __init__(self, module: nn.Module, config: dict[str, Any]) -> None:
        """Hold ``module`` until :func:`prepare_optimizer` builds its engine with ``config``."""
        super().__init__()
        self.module = module
        self.config = config
        self.engine: Any = None

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the module, through the engine once there is one.

        With bf16 or fp16, floating-point inputs are cast to that type, as DeepSpeed expects
        (so the training loop needs no change between strategies).
        """
        runner = self.engine if self.engine is not None else self.module
        dtype = self._half()
        if dtype is not None:
            args = tuple(_cast(a, dtype) for a in args)
            kwargs = {k: _cast(v, dtype) for k, v in kwargs.items()}
        return runner(*args, **kwargs)

    def _half(self) -> Any:
        import torch

        if self.config.get("bf16", {}).get("enabled"):
            return torch.bfloat16
        if self.config.get("fp16", {}).get("enabled"):
            return torch.float16
        return None


def _cast(value: Any, dtype: Any) -> Any:
    import torch

    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.to(dtype)
    return value


class ZeroOptimizer:
    """The optimizer side of a DeepSpeed engine: ``step`` is the engine's."""

    def __init__(self, engine: Any) -> None:
        """Wrap ``engine``."""
        self.engine = engine
        self.optimizer = engine.optimizer

    def step(self) -> None:
        """The engine's step (it also clears the gradients)."""
        self.engine.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing to do: the engine clears gradients in ``step``."""

    @property
    def param_groups(self) -> Any:
        """The wrapped optimizer's parameter groups (learning-rate schedulers read them)."""
        return self.optimizer.param_groups


def build_engine(model: ZeroModel, optimizer: Any) -> ZeroOptimizer:
    """``deepspeed.initialize`` for ``model`` with the user's ``optimizer``."""
    deepspeed = _deepspeed()
    engine, _, _, _ = deepspeed.initialize(
        model=model.module, optimizer=optimizer, config=model.config
    )
    model.engine = engine
    return ZeroOptimizer(engine)


def full_state(model: ZeroModel) -> dict[str, Any]:
    """The whole state dict of a ZeRO model on every rank (ZeRO-3 shards are gathered)."""
    deepspeed = _deepspeed()
    params = list(model.module.parameters())
    with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
        return {k: v.detach().cpu().clone() for k, v in model.module.state_dict().items()}


class ZeroStrategy(Strategy):
    """A DeepSpeed ZeRO stage: :class:`ZeroModel`, then the engine from the user's optimizer."""

    def __init__(self, name: str, row: PlannerRow) -> None:
        """The strategy ``name`` (a key of :data:`STAGES`), priced by the planner's ``row``."""
        self.name = name
        self.row = row

    def priced_as(self, options: PrepareOptions) -> PlannerRow:
        """The planner row named at construction."""
        return self.row

    def needs_skeleton(self, options: PrepareOptions) -> bool:
        """Yes: DeepSpeed partitions (ZeRO-3) or casts (bf16, fp16) the module in place."""
        return True

    def prepare_module(self, model: Any, options: PrepareOptions, where: Any) -> Any:
        """A :class:`ZeroModel`: the module on ``where`` and the stage's configuration.

        The user's settings win: those given to the launch, then ``deepspeed_config``.
        """
        user = {**(deepspeed_config() or {}), **(options.deepspeed_config or {})}
        return ZeroModel(model.to(where), zero_config(self.name, options.precision, user))

    def prepare_optimizer(self, model: Any, optimizer: Any) -> Any:
        """The engine's optimizer (:class:`ZeroOptimizer`), built from ``optimizer``."""
        stepping = build_engine(model, optimizer)
        mark(stepping, self)
        return stepping

    def backward(self, loss: Any, optimizer: Any) -> None:
        """The engine's backward (it scales the loss and reduces the gradients)."""
        optimizer.engine.backward(loss)

    def full_state_dict(self, model: Any) -> dict[str, Any]:
        """:func:`full_state`: gathered from the partitions at ZeRO-3."""
        return full_state(model)


#: One object per ``prepare_model`` name of :data:`STAGES`, in its order.
ZERO_STRATEGIES: tuple[ZeroStrategy, ...] = (
    ZeroStrategy("zero1", "zero1"),
    ZeroStrategy("zero2", "zero2"),
    ZeroStrategy("zero3", "zero3"),
    ZeroStrategy("zero1_offload", "zero2_offload"),
    ZeroStrategy("zero2_offload", "zero2_offload"),
    ZeroStrategy("zero3_offload", "zero3_offload_params"),  # offload_param too: see STAGES
)
