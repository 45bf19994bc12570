"""``prepare_model``: one word picks the strategy; the module comes back ready to train.

Strategies (the registry lists them in its error):

- ``ddp``: a full copy per rank, gradients all-reduced (``DistributedDataParallel``).
- ``fsdp``: parameters, gradients and optimizer states sharded over the ranks with FSDP2
  ``fully_shard`` (ZeRO-3). ``reshard_after_forward=False`` keeps parameters gathered between
  forward and backward (ZeRO-2: less communication, more memory); ``cpu_offload=True`` keeps
  shards and optimizer states in CPU memory (ZeRO-Offload).
- ``auto``: :func:`sparktrain.plan` for this model and these GPUs picks the strategy with the
  least communication that fits, and maps it onto the ones above (or onto a ``tp``/``pp``
  mesh; see :mod:`sparktrain.strategies.auto`).

- ``zero1``, ``zero2``, ``zero3``, ``zero1_offload``, ``zero2_offload``, ``zero3_offload``:
  DeepSpeed ZeRO stages (the ``deepspeed`` extra); see :mod:`sparktrain.strategies.zero`.
  They also need :func:`prepare_optimizer` and :func:`backward`, which the other strategies
  accept too, so one loop serves all.
"""

from __future__ import annotations

import copy
import logging
import os
from typing import Any

from sparktrain.errors import ConfigError
from sparktrain.strategies import zero
from sparktrain.strategies.composed import Pipelining, prepare_parallel
from sparktrain.tracking.rank import log_params

log = logging.getLogger("sparktrain.strategies")

STRATEGIES = (
    "ddp",
    "fsdp",
    "zero1",
    "zero2",
    "zero3",
    "zero1_offload",
    "zero2_offload",
    "zero3_offload",
    "auto",
)
_PRECISIONS = (None, "bf16", "fp16")


def device() -> Any:
    """This rank's device: ``cuda:LOCAL_RANK`` when the rank owns GPUs, else the CPU."""
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def world() -> Any:
    """``torch.distributed``, once its process group exists (else the error saying so)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise ConfigError(
            "prepare_model needs the process group: call "
            "torch.distributed.init_process_group(...) first, inside the training function."
        )
    return dist


def _check(strategy: object, precision: object) -> str:
    if strategy not in STRATEGIES:
        raise ConfigError(f"unknown strategy {strategy!r}; choose one of: {', '.join(STRATEGIES)}")
    if precision not in _PRECISIONS:
        raise ConfigError(f"precision={precision!r} must be None, 'bf16' or 'fp16'.")
    return str(strategy)


def _ddp(model: Any, where: Any) -> Any:
    from torch.nn.parallel import DistributedDataParallel

    ids = [where] if where.type == "cuda" else None
    return DistributedDataParallel(model.to(where), device_ids=ids)


def _fsdp(
    model: Any,
    where: Any,
    *,
    precision: str | None,
    reshard_after_forward: bool,
    cpu_offload: bool,
    mesh: Any = None,
) -> Any:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    if mesh is None:
        mesh = init_device_mesh(where.type, (world().get_world_size(),))
    options: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": reshard_after_forward}
    if precision is not None:
        dtype = torch.bfloat16 if precision == "bf16" else torch.float16
        options["mp_policy"] = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    if cpu_offload:
        options["offload_policy"] = CPUOffloadPolicy(pin_memory=where.type == "cuda")
    else:
        model = model.to(where)
    for child in model.modules():  # shard each layer that owns parameters, then the root
        if child is not model and any(True for _ in child.parameters(recurse=False)):
            fully_shard(child, **options)
    return fully_shard(model, **options)


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
        strategy: ``"ddp"``, ``"fsdp"`` or ``"auto"``.
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
    name = _check(strategy, precision)
    # A weightless copy of the plain module: log_model rebuilds it from gathered shards.
    skeleton = copy.deepcopy(model).to("meta")
    options: dict[str, Any] = {
        "reshard_after_forward": reshard_after_forward,
        "cpu_offload": cpu_offload,
    }
    if name == "auto":
        from sparktrain.strategies.auto import choose

        name, chosen = choose(model, gpu_memory, cpu_memory, precision, plan_shape)
        tp, pp = chosen.pop("tp", tp), chosen.pop("pp", pp)
        options.update(chosen)
    world()
    where = device()
    log_params(
        {
            "strategy": name,
            **({f"fsdp_{k}": v for k, v in options.items()} if name == "fsdp" else {}),
            **({"tp": tp} if tp != 1 else {}),
            **({"pp": pp, "pp_schedule": schedule} if pp != 1 else {}),
        }
    )
    prepared: Any
    if tp != 1 or pp != 1 or parallelize_plan is not None:
        prepared = prepare_parallel(
            model,
            name,
            where,
            tp=tp,
            pp=pp,
            plan=parallelize_plan,
            pipelining=Pipelining(schedule, microbatches, stages_per_rank, split_points),
            shard=lambda m, w, mesh: _fsdp(m, w, precision=precision, mesh=mesh, **options),
        )
    elif name == "ddp":
        return _ddp(model, where)
    elif name in zero.STAGES:
        user = zero.deepspeed_config() or {}
        config = zero.zero_config(name, precision, {**user, **(deepspeed_config or {})})
        prepared = zero.ZeroModel(model.to(where), config)
    else:
        prepared = _fsdp(model, where, precision=precision, **options)
    object.__setattr__(prepared, "_sparktrain_skeleton", skeleton)  # not a registered submodule
    return prepared


def prepare_optimizer(optimizer: Any, model: Any) -> Any:
    """The optimizer to step: the same one, or (ZeRO) the DeepSpeed engine's.

    Call it after :func:`prepare_model`, with a torch optimizer over ``model.parameters()``.
    """
    if isinstance(model, zero.ZeroModel):
        return zero.build_engine(model, optimizer)
    return optimizer


def backward(loss: Any, optimizer: Any = None) -> None:
    """``loss.backward()``, or the DeepSpeed engine's backward for the ZeRO strategies."""
    if isinstance(optimizer, zero.ZeroOptimizer):
        optimizer.engine.backward(loss)
    else:
        loss.backward()


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

    if isinstance(model, PipelineModel):
        return model.step(inputs, target, loss_fn)
    output = model(*inputs) if isinstance(inputs, tuple) else model(inputs)
    loss = loss_fn(output, target)
    backward(loss, optimizer)
    return loss.detach()


def full_state_dict(model: Any) -> dict[str, Any]:
    """The whole, unwrapped ``state_dict`` of a DDP or FSDP model, on every rank, on the CPU.

    A collective for FSDP and pipelines (the shards and stages are gathered): call it on every
    rank.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, zero.ZeroModel):
        return zero.full_state(model)
    from sparktrain.strategies.pipeline import PipelineModel, gather_state

    if isinstance(model, PipelineModel):  # each stage whole, then every stage
        return dict(gather_state(model, full_state_dict))
    if isinstance(model, DistributedDataParallel):
        model = model.module
    options = StateDictOptions(full_state_dict=True, cpu_offload=False)
    state: dict[str, Any] = dict(get_model_state_dict(model, options=options))
    return {k: v.detach().cpu() if hasattr(v, "detach") else v for k, v in state.items()}


def plain_module(model: Any) -> Any:
    """``model`` as a plain module with whole weights, loadable without a process group.

    DDP, FSDP1 and sparktrain's ZeRO-1/2 wrappers are unwrapped; FSDP2 and ZeRO-3 modules are
    rebuilt from their gathered state, which is a collective: call it on every rank.
    """
    skeleton = getattr(model, "_sparktrain_skeleton", None)
    if skeleton is not None:  # FSDP2 / ZeRO-3: rebuild from the gathered state
        state = full_state_dict(model)
        plain = copy.deepcopy(skeleton).to_empty(device="cpu")
        plain.load_state_dict(state)
        return plain
    module = getattr(model, "module", model)  # DDP, FSDP1, sparktrain's ZeRO-1/2 model
    return getattr(module, "module", module)
