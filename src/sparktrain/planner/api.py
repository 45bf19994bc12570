"""``plan()``: the memory each strategy needs per GPU, and the one to use. A pure value.

Design choices:
- ``plan()`` has no side effects: it starts nothing, allocates no parameters and prints nothing.
  The :class:`MemoryPlan` it returns prints as a table (``str(plan)``) and converts to JSON-ready
  data (``plan.to_dict()``); ``plan.recommended`` is a strategy name for programs.
- Every input is checked once, here, and a bad one raises :class:`~sparktrain.ConfigError`
  naming the value and the fix.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from sparktrain.ground.errors import ConfigError
from sparktrain.planner.activations import ActivationEstimate, Activations, estimate_activations
from sparktrain.planner.assumptions import assumptions
from sparktrain.planner.bytemodel import ByteModel, Optimizer, Precision, byte_model
from sparktrain.planner.memory_plan import MemoryPlan
from sparktrain.planner.mesh import MeshEstimate, MeshShapeSpec, plan_meshes
from sparktrain.planner.model import ModelSize, model_size
from sparktrain.planner.recommend import StrategyEstimate, assess, recommend
from sparktrain.planner.shape import activation_shape, check_count, mesh_spec
from sparktrain.planner.strategies import STRATEGIES, strategy_memory
from sparktrain.planner.units import parse_bytes

DEFAULT_HEADROOM = 0.2


def plan(
    model_or_param_count: object = None,
    *,
    gpus_per_node: int,
    nodes: int = 1,
    gpu_memory: int | float | str,
    precision: Precision = "bf16-mixed",
    optimizer: Optimizer = "adam",
    cpu_memory: int | float | str | None = None,
    activation: Activations | None = None,
    headroom: float = DEFAULT_HEADROOM,
    params: int | str | None = None,
    layers: int | None = None,
    hidden: int | None = None,
    vocab: int | None = None,
    seq_len: int | None = None,
    micro_batch: int | None = None,
    microbatches: int | None = None,
    tied_embeddings: bool = False,
) -> MemoryPlan:
    """Work out the memory per GPU of DDP, ZeRO-1/2/3 and the offload variants; recommend one.

    Args:
        model_or_param_count: ``"13B"``, ``13_000_000_000``, an ``nn.Module`` (e.g. built under
            ``torch.device("meta")``), a callable that builds one (called on the meta device),
            or a Hugging Face config (object or ``config.json`` dict) of a dense decoder-only
            transformer.
        gpus_per_node: GPUs per node.
        nodes: Nodes; ``N = gpus_per_node * nodes`` data-parallel ranks.
        gpu_memory: One GPU's memory: ``"80GB"`` (10^9 bytes), ``"80GiB"`` or bytes.
        precision: ``"bf16-mixed"``, ``"fp16-mixed"`` (2 + 2 + fp32 master and states) or
            ``"fp32"`` (4 + 4 + states, no master copy).
        optimizer: ``"adam"``/``"adamw"`` (2 states), ``"sgd-momentum"`` (1) or ``"sgd"`` (0).
        cpu_memory: One node's CPU memory, to check the offload variants; ``None`` to skip that
            check (the CPU memory they need is still reported).
        activation: The run's sequence length and micro-batch (and the model's shape when the
            model does not give it) to estimate activations; ``None`` leaves them out.
        headroom: Fraction of each memory kept free for the CUDA context, fragmentation,
            communication buffers and, when not estimated, activations.
        params: The parameter count, instead of ``model_or_param_count``.
        layers: Transformer layers (with ``hidden``, ``seq_len``, ``micro_batch``: the shape
            for activations and meshes, as ``Activations(...)`` gives it).
        hidden: Hidden size.
        vocab: Vocabulary size (the embedding, the head and the logits).
        seq_len: Tokens per sequence.
        micro_batch: Sequences per micro-batch per GPU.
        microbatches: Micro-batches per step of a pipeline (default ``4 * pp``).
        tied_embeddings: Whether the output head shares the embedding's weight.

    With the activations known, the plan also holds every tensor x pipeline x FSDP mesh the
    cluster allows (:attr:`MemoryPlan.meshes`) and the one to use (``recommended_mesh``).

    Returns:
        A :class:`MemoryPlan`; ``str()`` of it is a table with the recommendation.

    Raises:
        ConfigError: A bad value; the message names it and says what to pass.
    """
    if (model_or_param_count is None) == (params is None):
        raise ConfigError(
            "plan() needs the model once: a model, a config or a count as the first argument, "
            "or params=... (e.g. params='13B'), not both or neither."
        )
    size = model_size(model_or_param_count if params is None else params)
    activation = activation_shape(
        activation,
        layers=layers,
        hidden=hidden,
        vocab=vocab,
        seq_len=seq_len,
        micro_batch=micro_batch,
    )
    bytes_model = byte_model(precision, optimizer)
    gpus_per_node = check_count("gpus_per_node", gpus_per_node)
    nodes = check_count("nodes", nodes)
    gpu_bytes = parse_bytes(gpu_memory, name="gpu_memory")
    cpu_bytes = None if cpu_memory is None else parse_bytes(cpu_memory, name="cpu_memory")
    headroom = _check_headroom(headroom)
    acts, spec = _activations(activation, size, precision, microbatches, tied_embeddings)
    return _planned(
        size,
        bytes_model,
        acts,
        spec,
        gpus_per_node=gpus_per_node,
        nodes=nodes,
        gpu_memory=gpu_bytes,
        cpu_memory=cpu_bytes,
        headroom=headroom,
    )


def _activations(
    activation: object,
    size: ModelSize,
    precision: Precision,
    microbatches: int | None,
    tied_embeddings: bool,
) -> tuple[ActivationEstimate | None, MeshShapeSpec | None]:
    """The activation estimate and the meshes' spec (both ``None`` without activations)."""
    if activation is None:
        return None, None
    if not isinstance(activation, Activations):
        raise ConfigError(
            f"activation={activation!r} must be an Activations(seq_len=..., batch_size=...) or "
            "None."
        )
    acts = estimate_activations(activation, size, precision)
    return acts, mesh_spec(size, activation, precision, microbatches, tied_embeddings)


def _planned(
    size: ModelSize,
    bytes_model: ByteModel,
    acts: ActivationEstimate | None,
    spec: MeshShapeSpec | None,
    *,
    gpus_per_node: int,
    nodes: int,
    gpu_memory: int,
    cpu_memory: int | None,
    headroom: float,
) -> MemoryPlan:
    """The plan of checked values: every strategy judged, one recommended, and the meshes."""
    cluster = _Cluster(gpus_per_node, nodes, gpu_memory, cpu_memory, headroom)
    estimates = _estimates(size, bytes_model, cluster, acts)
    recommended, reasons = recommend(
        estimates, gpu_memory=gpu_memory, cpu_memory=cpu_memory, headroom=headroom
    )
    meshes, chosen_mesh, mesh_reasons = _meshes(spec, bytes_model, cluster)
    return MemoryPlan(
        meshes=meshes,
        recommended_mesh=chosen_mesh,
        mesh_reasons=mesh_reasons,
        model=size,
        bytes_model=bytes_model,
        gpus_per_node=gpus_per_node,
        nodes=nodes,
        gpu_memory=gpu_memory,
        cpu_memory=cpu_memory,
        headroom=headroom,
        activations=acts,
        estimates=estimates,
        recommended=recommended,
        reasons=reasons,
        assumptions=assumptions(
            size,
            bytes_model,
            gpus_per_node * nodes,
            acts,
            headroom,
            meshes=meshes,
            microbatches=spec.microbatches if spec else None,
        ),
    )


@dataclass(frozen=True)
class _Cluster:
    """The cluster :func:`plan` was given, checked (memories in bytes)."""

    gpus_per_node: int
    nodes: int
    gpu_memory: int
    cpu_memory: int | None
    headroom: float


def _estimates(
    size: ModelSize, bytes_model: ByteModel, cluster: _Cluster, acts: ActivationEstimate | None
) -> tuple[StrategyEstimate, ...]:
    """Every strategy's memory on ``cluster``, judged, in order of preference."""
    return tuple(
        assess(
            strategy_memory(
                strategy,
                size=size,
                bytes_model=bytes_model,
                gpus_per_node=cluster.gpus_per_node,
                nodes=cluster.nodes,
                activations=acts.bytes if acts else 0,
            ),
            gpu_memory=cluster.gpu_memory,
            cpu_memory=cluster.cpu_memory,
            headroom=cluster.headroom,
        )
        for strategy in STRATEGIES
    )


def _meshes(
    spec: MeshShapeSpec | None, bytes_model: ByteModel, cluster: _Cluster
) -> tuple[tuple[MeshEstimate, ...], MeshEstimate | None, tuple[str, ...]]:
    """The meshes, the one to use and why (none without the activations' ``spec``)."""
    if spec is None:
        return (), None, ()
    return plan_meshes(
        spec,
        bytes_model,
        gpus_per_node=cluster.gpus_per_node,
        nodes=cluster.nodes,
        gpu_memory=cluster.gpu_memory,
        headroom=cluster.headroom,
    )


def _check_headroom(value: object) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or not 0 <= value < 1
    ):
        raise ConfigError(
            f"headroom={value!r} must be a fraction from 0 to below 1, e.g. headroom=0.2 to keep "
            "20 % of each GPU free."
        )
    return float(value)
