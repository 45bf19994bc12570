"""What the planner answers: a :class:`MemoryPlan`, as values, as a table, and as data.

The table shows decimal units (GB = 10^9 bytes, as the ZeRO paper); the data keeps exact bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sparktrain.ground.errors import ConfigError
from sparktrain.planner.activations import ActivationEstimate
from sparktrain.planner.bytemodel import ByteModel
from sparktrain.planner.mesh import MeshEstimate
from sparktrain.planner.model import ModelSize
from sparktrain.planner.recommend import StrategyEstimate
from sparktrain.planner.strategies import INFO, Strategy, check_strategy, formula
from sparktrain.planner.tables import plural, table, verdict
from sparktrain.planner.units import format_bytes, format_count

_HEADER = ("strategy", "params", "grads", "optimizer", "other", "GPU total", "of GPU", "CPU/node")


@dataclass(frozen=True, kw_only=True)
class MemoryPlan:
    """Memory per GPU of every strategy for one model on one cluster, and the recommendation.

    Attributes:
        model: The model's size (and shape, when known).
        bytes_model: Bytes per parameter for the precision and optimizer.
        gpus_per_node: GPUs on each node.
        nodes: Nodes.
        gpu_memory: Bytes of memory of one GPU.
        cpu_memory: Bytes of CPU memory of one node, or ``None`` when not given.
        headroom: Fraction of each memory kept free for what the model does not count.
        activations: The activation estimate, or ``None`` when it was not asked for.
        estimates: One estimate per strategy, in order of preference.
        recommended: The strategy to use, or ``None`` when nothing fits.
        reasons: Why, in plain sentences.
        assumptions: What the numbers assume, to print with them.
        meshes: Tensor x pipeline x FSDP meshes (when the activations are estimated), in order
            of preference; see :mod:`sparktrain.planner.mesh`.
        recommended_mesh: The mesh to use, or ``None`` (not estimated, or nothing fits).
        mesh_reasons: Why.
    """

    model: ModelSize
    bytes_model: ByteModel
    gpus_per_node: int
    nodes: int
    gpu_memory: int
    cpu_memory: int | None
    headroom: float
    activations: ActivationEstimate | None
    estimates: tuple[StrategyEstimate, ...]
    recommended: Strategy | None
    reasons: tuple[str, ...]
    assumptions: tuple[str, ...]
    meshes: tuple[MeshEstimate, ...] = ()
    recommended_mesh: MeshEstimate | None = None
    mesh_reasons: tuple[str, ...] = ()

    def mesh(self, tp: int = 1, pp: int = 1) -> MeshEstimate:
        """The estimate of one mesh by its tensor and pipeline degrees.

        Raises:
            ConfigError: No such mesh was planned (activations not given, or it does not fit
                the cluster's layout).
        """
        for estimate in self.meshes:
            if (estimate.tp, estimate.pp) == (tp, pp):
                return estimate
        planned = ", ".join(f"tp={e.tp} pp={e.pp}" for e in self.meshes) or "none"
        raise ConfigError(
            f"no mesh tp={tp} pp={pp} in this plan (planned: {planned}). Meshes need the "
            "activations (seq_len=..., micro_batch=...) and a tp that divides gpus_per_node."
        )

    @property
    def world_size(self) -> int:
        """``N``: GPUs in all, each a data-parallel rank."""
        return self.gpus_per_node * self.nodes

    def estimate(self, strategy: str) -> StrategyEstimate:
        """The estimate of one strategy, by name (``"ddp"``, ``"zero3"``, ...).

        Raises:
            ConfigError: Not a strategy; the message lists them.
        """
        name = check_strategy(strategy)
        return next(e for e in self.estimates if e.strategy == name)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready data: every number in bytes."""
        return plan_to_dict(self)

    def __str__(self) -> str:
        return render_plan(self)


def render_plan(plan: MemoryPlan) -> str:
    """The plan as text: a header line, the table, the recommendation, reasons, assumptions."""
    b = plan.bytes_model
    cpu = f", {format_bytes(plan.cpu_memory)} CPU per node" if plan.cpu_memory else ""
    lines = [
        f"Memory plan: {format_count(plan.model.params)} parameters, {b.precision} + "
        f"{b.optimizer}, {plural(plan.nodes, 'node')} x {plural(plan.gpus_per_node, 'GPU')} of "
        f"{format_bytes(plan.gpu_memory)}{cpu} (N = {plan.world_size})",
        "",
    ]
    rows = [(*_HEADER, "fits")]
    for e in plan.estimates:
        m = e.memory
        other = m.working + m.activations
        rows.append(
            (
                m.strategy,
                format_bytes(m.params),
                format_bytes(m.grads),
                format_bytes(m.optimizer),
                format_bytes(other) if other else "-",
                format_bytes(m.gpu_total),
                f"{e.gpu_fraction:.0%}",
                format_bytes(m.cpu_per_node) if m.cpu_per_node else "-",
                verdict(e.fits, e.fits_with_headroom, e.cpu_checked),
            )
        )
    lines += table(rows)
    lines.append("")
    lines.append(
        "other = ZeRO-3's gathered module + activations; fits: yes (with headroom), "
        "tight (without), no" + ("; ? = CPU memory not checked" if plan.cpu_memory is None else "")
    )
    lines.append("")
    if plan.recommended is None:
        lines.append("Recommended: nothing fits")
    else:
        lines.append(f"Recommended: {plan.recommended} - {INFO[plan.recommended].title}")
    lines += [f"  - {reason}" for reason in plan.reasons]
    if plan.meshes:
        lines += ["", *_render_meshes(plan)]
    lines.append("")
    lines.append("Assumptions:")
    lines += [f"  - {line}" for line in plan.assumptions]
    return "\n".join(lines)


def plan_to_dict(plan: MemoryPlan) -> dict[str, Any]:
    """The plan as JSON-ready data, every size in bytes."""
    b = plan.bytes_model
    return {
        "model": {
            "params": plan.model.params,
            "trainable_params": plan.model.trainable_params,
            "source": plan.model.source,
        },
        "cluster": {
            "gpus_per_node": plan.gpus_per_node,
            "nodes": plan.nodes,
            "world_size": plan.world_size,
            "gpu_memory_bytes": plan.gpu_memory,
            "cpu_memory_bytes": plan.cpu_memory,
        },
        "precision": b.precision,
        "optimizer": b.optimizer,
        "bytes_per_param": {
            "params": b.param_bytes,
            "grads": b.grad_bytes,
            "optimizer": b.optimizer_bytes,
            "total": b.total,
        },
        "headroom": plan.headroom,
        "activation_bytes": plan.activations.bytes if plan.activations else None,
        "strategies": [
            {
                "name": e.strategy,
                "formula": formula(e.strategy, b),
                "params_bytes": e.memory.params,
                "grads_bytes": e.memory.grads,
                "optimizer_bytes": e.memory.optimizer,
                "working_bytes": e.memory.working,
                "activation_bytes": e.memory.activations,
                "gpu_total_bytes": e.memory.gpu_total,
                "gpu_fraction": round(e.gpu_fraction, 4),
                "cpu_per_node_bytes": e.memory.cpu_per_node,
                "fits": e.fits,
                "fits_with_headroom": e.fits_with_headroom,
                "cpu_checked": e.cpu_checked,
            }
            for e in plan.estimates
        ],
        "recommended": plan.recommended,
        "reasons": list(plan.reasons),
        "meshes": [_mesh_dict(e) for e in plan.meshes],
        "recommended_mesh": None if plan.recommended_mesh is None else plan.recommended_mesh.name,
        "mesh_reasons": list(plan.mesh_reasons),
        "assumptions": list(plan.assumptions),
    }


def _render_meshes(plan: MemoryPlan) -> list[str]:
    lines = ["Meshes (tensor x pipeline x FSDP, per GPU on the fullest stage; 1F1B schedule):"]
    rows = [("mesh", "states", "gathered", "activations", "GPU total", "of GPU", "bubble", "fits")]
    for e in plan.meshes:
        rows.append(
            (
                e.name,
                format_bytes(e.states),
                format_bytes(e.gathered) if e.gathered else "-",
                format_bytes(e.activations),
                format_bytes(e.total),
                f"{e.total / plan.gpu_memory:.0%}",
                f"{e.bubble:.0%}" if e.pp > 1 else "-",
                verdict(e.fits, e.fits_with_headroom, True),
            )
        )
    lines += table(rows)
    lines.append("")
    chosen = plan.recommended_mesh
    if chosen is None:
        lines.append("Recommended mesh: nothing fits")
    else:
        call = f"prepare_model(model, 'fsdp', tp={chosen.tp}, pp={chosen.pp})"
        lines.append(f"Recommended mesh: {chosen.name}  ({call})")
    lines += [f"  - {reason}" for reason in plan.mesh_reasons]
    return lines


def _mesh_dict(e: MeshEstimate) -> dict[str, Any]:
    return {
        "tp": e.tp,
        "pp": e.pp,
        "dp": e.dp,
        "microbatches": e.microbatches,
        "stage_layers": list(e.stage_layers),
        "stage_states_bytes": list(e.stage_states),
        "states_bytes": e.states,
        "gathered_bytes": e.gathered,
        "activation_bytes": e.activations,
        "gpu_total_bytes": e.total,
        "bubble": round(e.bubble, 4),
        "fits": e.fits,
        "fits_with_headroom": e.fits_with_headroom,
    }
