"""``prepare_model``: one word picks the strategy; the module comes back ready to train.

Runs inside a rank. Each name is a strategy object of the registry
(:mod:`sparktrain.strategies.registry`, whose error lists them): ``ddp``, ``fsdp`` (with
``tp``/``pp``), the DeepSpeed ZeRO stages ``zero1`` ... ``zero3_offload`` and ``auto``.
``prepare_model`` checks its arguments, groups them by concern
(:mod:`sparktrain.strategies.options`; its flat keywords are the public surface and stay), looks
the strategy up, lets it resolve (``auto`` picks another), and runs its steps. The prepared model
records the object that made it, so :func:`prepare_optimizer`, ``full_state_dict`` and
``plain_module`` (:mod:`sparktrain.strategies.unwrap`) ask it rather than test the model's
type; models wrapped elsewhere take the steps that fit their type
(:func:`~sparktrain.strategies.registry.strategy_of`). With
:func:`prepare_optimizer` and :func:`backward`, which the ZeRO stages need and the others accept,
one loop serves all.
"""

from __future__ import annotations

import logging
from typing import Any

from sparktrain.ground.errors import ConfigError
from sparktrain.strategies import registry
from sparktrain.strategies.base import Strategy, device, mark, world
from sparktrain.strategies.composed import Pipelining
from sparktrain.strategies.options import Budget, Parallelism, PrepareOptions, Sharding
from sparktrain.strategies.skeleton import weightless_copy
from sparktrain.strategies.unwrap import SKELETON
from sparktrain.tracking.rank import log_params

log = logging.getLogger("sparktrain.strategies")

#: Every strategy name, in the order the registry lists them.
STRATEGIES: tuple[str, ...] = registry.names()
_PRECISIONS = (None, "bf16", "fp16")

__all__ = [
    "STRATEGIES",
    "backward",
    "device",
    "forward_backward",
    "prepare_model",
    "prepare_optimizer",
    "world",
]


def prepare_model(
    model: Any,
    strategy: str = "ddp",
    *,
    precision: str | None = None,
    reshard_after_forward: bool = True,
    cpu_offload: bool = False,
    gpu_memory: int | float | str | None = None,
    cpu_memory: int | float | str | None = None,
    deepspeed_config: dict[str, Any] | None = None,
    tp: int = 1,
    parallelize_plan: dict[str, Any] | None = None,
    pp: int = 1,
    schedule: str = "1f1b",
    microbatches: int | None = None,
    stages_per_rank: int | None = None,
    split_points: list[str] | None = None,
    plan_shape: dict[str, Any] | None = None,
) -> Any:
    """Move ``model`` to this rank's device and wrap it for ``strategy``.

    Call it inside the training function, after ``init_process_group`` and before creating the
    optimizer (``fsdp`` replaces the parameters with their shards).

    Args:
        model: The ``nn.Module`` to train.
        strategy: A name of :data:`STRATEGIES`: ``"ddp"``, ``"fsdp"``, ``"zero1"`` ...
            ``"zero3_offload"`` or ``"auto"``.
        precision: ``None`` (fp32), ``"bf16"`` or ``"fp16"`` mixed precision (``fsdp``).
        reshard_after_forward: ``fsdp``: free gathered parameters after forward (ZeRO-3);
            ``False`` keeps them until backward (ZeRO-2).
        cpu_offload: ``fsdp``: keep parameter shards and optimizer states in CPU memory.
        gpu_memory: ``auto``: memory of one GPU (default: read from the device).
        cpu_memory: ``auto``: CPU memory of one node, for the offload strategies.
        deepspeed_config: ZeRO strategies: settings merged over the stage's defaults (and over
            the configuration given to ``DeepspeedTorchDistributor``).
        tp: Tensor-parallel degree (``ddp`` or ``fsdp``): each layer split over ``tp``
            consecutive ranks of a node, the model sharded (``fsdp``) over the rest. Build the
            model identically (same seed) on every rank. See
            :mod:`sparktrain.strategies.tensor_parallel`.
        parallelize_plan: Your own tensor-parallel plan (module name to a
            ``torch.distributed.tensor.parallel`` style) instead of the built-in one.
        pp: Pipeline stages (``ddp`` or ``fsdp``; the model an ``nn.Sequential``): its
            children cut into ``pp`` runs over ranks ``tp * dp`` apart (across nodes). Train
            with :func:`forward_backward`. See :mod:`sparktrain.strategies.pipeline`.
        schedule: ``pp``: ``"1f1b"``, ``"gpipe"``, ``"interleaved1f1b"``, ``"loopedbfs"`` or
            ``"interleavedzerobubble"`` (the last three run several stages a rank).
        microbatches: ``pp``: micro-batches each batch is split into (default ``pp``); more
            shrink the pipeline bubble, ``(pp - 1) / (microbatches + pp - 1)`` of the step.
        stages_per_rank: ``pp``: stages each rank runs (default 1, or 2 for the interleaved
            schedules).
        split_points: ``pp``: the children that begin stages 2, 3, ... (default: cut where
            the stages' parameter counts are most even).
        plan_shape: ``auto``: the run's shape for :func:`sparktrain.plan` (``seq_len``,
            ``micro_batch``, and ``layers``/``hidden``/``vocab`` when the model does not give
            them); with it ``auto`` weighs activations and may choose a ``tp``/``pp`` mesh.

    Returns:
        The wrapped module (``DistributedDataParallel``, the module sharded in place, or with
        ``pp`` a :class:`~sparktrain.strategies.pipeline.PipelineModel` of this rank's stages).

    Raises:
        ConfigError: Unknown strategy (the message lists them), no process group, or ``auto``
            found nothing that fits.
    """
    strategy_object = registry.get(strategy)
    if precision not in _PRECISIONS:
        raise ConfigError(f"precision={precision!r} must be None, 'bf16' or 'fp16'.")
    options = PrepareOptions(
        precision=precision,
        sharding=Sharding(reshard_after_forward=reshard_after_forward, cpu_offload=cpu_offload),
        parallel=Parallelism(
            tp=tp,
            pp=pp,
            plan=parallelize_plan,
            pipelining=Pipelining(schedule, microbatches, stages_per_rank, split_points),
        ),
        budget=Budget(gpu_memory=gpu_memory, cpu_memory=cpu_memory, plan_shape=plan_shape),
        deepspeed_config=deepspeed_config,
    )
    return _run_steps(strategy_object, model, options)


def _run_steps(strategy: Strategy, model: Any, options: PrepareOptions) -> Any:
    """Resolve ``strategy``, then its steps: log, skeleton, module; the prepared model marked."""
    world()
    strategy, options = strategy.resolve(model, options)
    where = device()
    log_params(strategy.settings(options))
    skeleton = weightless_copy(model) if strategy.needs_skeleton(options) else None
    prepared = strategy.prepare(model, options, where)
    mark(prepared, strategy)
    if skeleton is not None:  # log_model rebuilds the plain module from the gathered state
        object.__setattr__(prepared, SKELETON, skeleton)
    return prepared


def prepare_optimizer(optimizer: Any, model: Any) -> Any:
    """The optimizer to step: the same one, or (ZeRO) the DeepSpeed engine's.

    Call it after :func:`prepare_model`, with a torch optimizer over ``model.parameters()``.
    """
    return registry.strategy_of(model).prepare_optimizer(model, optimizer)


def backward(loss: Any, optimizer: Any = None) -> None:
    """``loss.backward()``, or the DeepSpeed engine's backward for the ZeRO strategies."""
    registry.strategy_of(optimizer).backward(loss, optimizer)


def forward_backward(
    model: Any, inputs: Any, target: Any, loss_fn: Any, optimizer: Any = None
) -> Any:
    """One batch's forward and backward under any strategy; the loss, detached, on every rank.

    ``loss_fn(model(inputs), target)`` then :func:`backward`; for a pipelined model
    (``prepare_model(..., pp=N)``) the pipeline schedule runs every micro-batch through the
    stages (the first stage reads ``inputs``, the last ``target``) and the mean micro-batch loss
    comes back on every rank. Step the optimizer after it as usual.

    Args:
        model: What :func:`prepare_model` returned.
        inputs: The batch's inputs (a tensor, or a tuple of the model's positional inputs).
        target: The batch's targets.
        loss_fn: ``fn(output, target) -> loss`` with a mean reduction.
        optimizer: What :func:`prepare_optimizer` returned (needed for the ZeRO strategies).
    """
    from sparktrain.strategies.pipeline import PipelineModel

    if isinstance(model, PipelineModel):  # the schedule runs forward and backward together
        return model.step(inputs, target, loss_fn)
    output = model(*inputs) if isinstance(inputs, tuple) else model(inputs)
    loss = loss_fn(output, target)
    backward(loss, optimizer)
    return loss.detach()
