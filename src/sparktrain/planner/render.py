"""Print a plan (and cluster advice) as a table for people, or as JSON-ready data for programs.

The table shows decimal units (GB = 10^9 bytes, as the ZeRO paper); the data keeps exact bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from sparktrain.planner.strategies import INFO, formula
from sparktrain.planner.units import format_bytes, format_count

if TYPE_CHECKING:
    from sparktrain.planner.api import MemoryPlan
    from sparktrain.planner.cluster import ClusterAdvice, ClusterOption
    from sparktrain.planner.mesh import MeshEstimate

_HEADER = ("strategy", "params", "grads", "optimizer", "other", "GPU total", "of GPU", "CPU/node")


def render_plan(plan: MemoryPlan) -> str:
    """The plan as text: a header line, the table, the recommendation, reasons, assumptions."""
    b = plan.bytes_model
    cpu = f", {format_bytes(plan.cpu_memory)} CPU per node" if plan.cpu_memory else ""
    lines = [
        f"Memory plan: {format_count(plan.model.params)} parameters, {b.precision} + "
        f"{b.optimizer}, {_plural(plan.nodes, 'node')} x {_plural(plan.gpus_per_node, 'GPU')} of "
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
                _verdict(e.fits, e.fits_with_headroom, e.cpu_checked),
            )
        )
    lines += _table(rows)
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
                _verdict(e.fits, e.fits_with_headroom, True),
            )
        )
    lines += _table(rows)
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
    lines += _table(rows, left=(0, 2, 3, 5))
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


def _plural(count: int, word: str) -> str:
    return f"{count} {word}" + ("s" if count != 1 else "")


def _verdict(fits: bool, roomy: bool, cpu_checked: bool) -> str:
    word = "yes" if roomy else "tight" if fits else "no"
    return word if cpu_checked or not fits else f"{word} ?"


def _table(rows: Sequence[Sequence[str]], left: tuple[int, ...] = (0,)) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    out = []
    for n, row in enumerate(rows):
        cells = [
            cell.ljust(w) if i in left else cell.rjust(w)
            for i, (cell, w) in enumerate(zip(row, widths, strict=True))
        ]
        out.append("  ".join(cells).rstrip())
        if n == 0:
            out.append("  ".join("-" * w for w in widths))
    return out
