"""Advice on the cluster's shape: one node or several, and which GPU kind.

From the seeds' decision table: train on a single node while the model fits in one node's
combined GPU memory (no inter-node traffic, easier to debug), and go multi-node only when it does
not (multi-node wants InfiniBand or EFA between the nodes). For each GPU kind of the table
(A10G 24 GB, A100 40/80 GB, H100 80 GB) the advice finds the smallest layout where a GPU-only
strategy fits with headroom, trying 1, 2, 4, ... GPUs on one node, then 2, 3, ... full nodes.
The advice prefers one node, then the fewest GPUs, then the table's order (A100 before H100 at
equal memory: the H100 is about 3x faster at a higher price). CPU offload is mentioned as an
alternative to going multi-node, never chosen: its speed depends on the CPUs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sparktrain.ground.errors import ConfigError
from sparktrain.planner.activations import Activations
from sparktrain.planner.api import DEFAULT_HEADROOM, plan
from sparktrain.planner.bytemodel import Optimizer, Precision
from sparktrain.planner.memory_plan import MemoryPlan
from sparktrain.planner.model import model_size
from sparktrain.planner.strategies import Strategy
from sparktrain.planner.tables import table
from sparktrain.planner.units import format_bytes


@dataclass(frozen=True, kw_only=True)
class GpuKind:
    """A GPU from the seeds' table.

    Attributes:
        name: Its name, e.g. ``"A100 80GB"``.
        memory: Its memory in bytes (10^9 per GB, on the safe side of the real GiB).
        fp16_tflops: Its FP16 tensor throughput, as the table gives it.
        use_cases: What the table recommends it for.
        example_instance: An AWS instance that has it.
    """

    name: str
    memory: int
    fp16_tflops: int
    use_cases: str
    example_instance: str


GPU_KINDS: tuple[GpuKind, ...] = (
    GpuKind(
        name="A10G",
        memory=24 * 10**9,
        fp16_tflops=125,
        use_cases="inference of mid-sized models, lightweight fine-tuning (under ~7B)",
        example_instance="g5.xlarge - g5.48xlarge",
    ),
    GpuKind(
        name="A100 40GB",
        memory=40 * 10**9,
        fp16_tflops=312,
        use_cases="large-scale training, LLM fine-tuning",
        example_instance="p4d.24xlarge (8x A100 40GB)",
    ),
    GpuKind(
        name="A100 80GB",
        memory=80 * 10**9,
        fp16_tflops=312,
        use_cases="large-scale training, LLM fine-tuning",
        example_instance="p4de.24xlarge (8x A100 80GB)",
    ),
    GpuKind(
        name="H100",
        memory=80 * 10**9,
        fp16_tflops=990,
        use_cases="very large LLM training, FP8 via Transformer Engine",
        example_instance="p5.48xlarge (8x H100)",
    ),
)


@dataclass(frozen=True, kw_only=True)
class ClusterOption:
    """The smallest layout of one GPU kind where a GPU-only strategy fits with headroom.

    Attributes:
        gpu: The GPU kind.
        gpus_per_node: GPUs per node.
        nodes: Nodes.
        strategy: The strategy the planner recommends there.
        gpu_bytes: Memory per GPU it needs.
    """

    gpu: GpuKind
    gpus_per_node: int
    nodes: int
    strategy: Strategy
    gpu_bytes: int


@dataclass(frozen=True, kw_only=True)
class ClusterAdvice:
    """Which GPUs, how many, on how many nodes.

    Attributes:
        options: The smallest fitting layout of each GPU kind (kinds that fit nowhere within
            ``max_nodes`` are left out).
        recommended: The advised layout, or ``None`` when no kind fits.
        summary: The advice in one line.
        reasons: Why, in plain sentences.
    """

    options: tuple[ClusterOption, ...]
    recommended: ClusterOption | None
    summary: str
    reasons: tuple[str, ...]

    def __str__(self) -> str:
        return render_advice(self)


def advise_cluster(
    model_or_param_count: object,
    *,
    precision: Precision = "bf16-mixed",
    optimizer: Optimizer = "adam",
    activation: Activations | None = None,
    headroom: float = DEFAULT_HEADROOM,
    gpus_per_node: int = 8,
    max_nodes: int = 64,
) -> ClusterAdvice:
    """Advise a cluster shape and GPU kind for training the model (see the module docstring).

    Args:
        model_or_param_count: As for :func:`~sparktrain.planner.plan`.
        precision: As for :func:`~sparktrain.planner.plan`.
        optimizer: As for :func:`~sparktrain.planner.plan`.
        activation: As for :func:`~sparktrain.planner.plan`.
        headroom: As for :func:`~sparktrain.planner.plan`.
        gpus_per_node: GPUs of a full node (8 on the table's largest instances).
        max_nodes: The most nodes to consider.

    Raises:
        ConfigError: A bad value; the message names it and says what to pass.
    """
    for name, value in (("gpus_per_node", gpus_per_node), ("max_nodes", max_nodes)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{name}={value!r} must be a positive int, e.g. {name}=8.")
    size = model_size(model_or_param_count)
    layouts = [(g, 1) for g in (1, 2, 4, 8, 16) if g < gpus_per_node]
    layouts += [(gpus_per_node, n) for n in range(1, max_nodes + 1)]

    def plan_on(gpu: GpuKind, per_node: int, nodes: int) -> MemoryPlan:
        return plan(
            size,
            gpus_per_node=per_node,
            nodes=nodes,
            gpu_memory=gpu.memory,
            precision=precision,
            optimizer=optimizer,
            activation=activation,
            headroom=headroom,
        )

    options = [o for o in (_smallest_fit(g, layouts, plan_on) for g in GPU_KINDS) if o is not None]
    if not options:
        return ClusterAdvice(
            options=(),
            recommended=None,
            summary=f"no listed GPU fits within {max_nodes} nodes of {gpus_per_node}",
            reasons=(
                "Even ZeRO-3 on the largest cluster considered leaves no headroom; shrink the "
                "activations (micro-batch, checkpointing) or raise max_nodes.",
            ),
        )
    best = min(
        options,
        key=lambda o: (o.nodes > 1, o.nodes * o.gpus_per_node, GPU_KINDS.index(o.gpu)),
    )
    reasons = _reasons(best, options, gpus_per_node, plan_on)
    missing = [g.name for g in GPU_KINDS if g not in {o.gpu for o in options}]
    if missing:
        reasons.append(f"{', '.join(missing)}: no layout within {max_nodes} nodes fits.")
    return ClusterAdvice(
        options=tuple(options), recommended=best, summary=_summary(best), reasons=tuple(reasons)
    )


def _smallest_fit(
    gpu: GpuKind,
    layouts: list[tuple[int, int]],
    plan_on: Callable[[GpuKind, int, int], MemoryPlan],
) -> ClusterOption | None:
    """The first of ``layouts`` where a GPU-only strategy fits ``gpu`` with headroom, if any."""
    for per_node, nodes in layouts:
        fitting = [
            e
            for e in plan_on(gpu, per_node, nodes).estimates
            if e.fits_with_headroom and "offload" not in e.strategy
        ]
        if fitting:
            return ClusterOption(
                gpu=gpu,
                gpus_per_node=per_node,
                nodes=nodes,
                strategy=fitting[0].strategy,
                gpu_bytes=fitting[0].memory.gpu_total,
            )
    return None


def _summary(best: ClusterOption) -> str:
    where = "single node" if best.nodes == 1 else "multi-node"
    return (
        f"{where}: {best.nodes} node{'s' if best.nodes > 1 else ''} x "
        f"{best.gpus_per_node} {best.gpu.name} with "
        f"{best.strategy} ({format_bytes(best.gpu_bytes)} per GPU)"
    )


def _reasons(
    best: ClusterOption,
    options: list[ClusterOption],
    gpus_per_node: int,
    plan_on: Callable[[GpuKind, int, int], MemoryPlan],
) -> list[str]:
    reasons = []
    total = best.nodes * best.gpus_per_node
    if total == 1:
        reasons.append(
            "It fits on one GPU: train there, and add GPUs with DDP only for throughput."
        )
    elif best.nodes == 1:
        reasons.append(
            f"It fits in one node's combined GPU memory ({total} x {best.gpu.name}): no "
            "inter-node traffic and easier debugging. Start on one node; scale out only when "
            "memory or throughput runs short."
        )
    else:
        reasons.append(
            f"It does not fit on one node of {gpus_per_node} of any listed GPU, so it needs "
            f"{best.nodes} nodes; give them fast networking (InfiniBand, or EFA on AWS), as "
            "inter-node communication becomes the bottleneck."
        )
        single = plan_on(best.gpu, gpus_per_node, 1)
        if single.recommended and "offload" in single.recommended:
            e = single.estimate(single.recommended)
            reasons.append(
                f"Alternative: one node of {gpus_per_node} x {best.gpu.name} with "
                f"{single.recommended} ({format_bytes(e.memory.gpu_total)} per GPU), if each "
                f"node has {format_bytes(e.memory.cpu_per_node)} of CPU memory for the "
                "offloaded states; slower per step, but no inter-node network."
            )
    twin = next((o for o in options if o.gpu.name == "H100"), None)
    if (
        best.gpu.name == "A100 80GB"
        and twin
        and (twin.nodes, twin.gpus_per_node)
        == (
            best.nodes,
            best.gpus_per_node,
        )
    ):
        reasons.append(
            "H100 has the same 80 GB, so the same layout; it trains about 3x faster (FP8 "
            "Transformer Engine) at a higher price."
        )
    reasons.append(f"{best.gpu.name}: {best.gpu.use_cases}; e.g. {best.gpu.example_instance}.")
    return reasons


def render_advice(advice: ClusterAdvice) -> str:
    """Cluster advice as text: one row per GPU kind, then the advice and its reasons."""
    rows = [("GPU", "memory", "smallest layout that fits", "strategy", "per GPU", "example")]
    for option in advice.options:
        rows.append(
            (
                option.gpu.name,
                format_bytes(option.gpu.memory),
                _layout(option),
                option.strategy,
                format_bytes(option.gpu_bytes),
                option.gpu.example_instance,
            )
        )
    lines = ["Cluster advice (GPU-only strategies, one micro-batch per GPU):", ""]
    lines += table(rows, left=(0, 2, 3, 5))
    lines.append("")
    lines.append(f"Advice: {advice.summary}")
    lines += [f"  - {reason}" for reason in advice.reasons]
    return "\n".join(lines)


def advice_to_dict(advice: ClusterAdvice) -> dict[str, Any]:
    """Cluster advice as JSON-ready data."""
    return {
        "summary": advice.summary,
        "options": [
            {
                "gpu": o.gpu.name,
                "gpu_memory_bytes": o.gpu.memory,
                "gpus_per_node": o.gpus_per_node,
                "nodes": o.nodes,
                "strategy": o.strategy,
                "gpu_bytes": o.gpu_bytes,
            }
            for o in advice.options
        ],
        "recommended": None
        if advice.recommended is None
        else {
            "gpu": advice.recommended.gpu.name,
            "gpus_per_node": advice.recommended.gpus_per_node,
            "nodes": advice.recommended.nodes,
            "strategy": advice.recommended.strategy,
        },
        "reasons": list(advice.reasons),
    }


def _layout(option: ClusterOption) -> str:
    if option.nodes == 1:
        return f"1 node x {option.gpus_per_node}"
    return f"{option.nodes} nodes x {option.gpus_per_node}"
