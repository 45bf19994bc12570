"""What a memory plan's numbers assume: the lines printed under the table.

Runs wherever :func:`sparktrain.planner.plan` runs (the caller's process); pure text from the
plan's values. The formulas are cited where they come from (the ZeRO paper, DeepSpeed's
ZeRO-Offload estimators, Korthikanti et al. 2022), so a reader can check each number.
"""

from __future__ import annotations

from sparktrain.planner.activations import ActivationEstimate
from sparktrain.planner.bytemodel import ByteModel
from sparktrain.planner.mesh import MeshEstimate
from sparktrain.planner.model import ModelSize
from sparktrain.planner.strategies import STRATEGIES, formula
from sparktrain.planner.units import format_bytes, format_count


def assumptions(
    size: ModelSize,
    bytes_model: ByteModel,
    world_size: int,
    acts: ActivationEstimate | None,
    headroom: float,
    *,
    meshes: tuple[MeshEstimate, ...] = (),
    microbatches: int | None = None,
) -> tuple[str, ...]:
    """What a plan's numbers assume, one line each, to print with them.

    Args:
        size: The model's size.
        bytes_model: Bytes per parameter.
        world_size: GPUs in all.
        acts: The activation estimate, or ``None``.
        headroom: The fraction of each memory kept free.
        meshes: The meshes planned (their assumptions are added when there are some).
        microbatches: The micro-batches per step the meshes assume (``None``: ``4 * pp``).
    """
    lines = [f"model: {size.source}"]
    if size.trainable_params != size.params:
        lines.append(
            f"trainable: {format_count(size.trainable_params)} of {format_count(size.params)} "
            "parameters; gradients and optimizer states count only those"
        )
    lines.append(
        f"bytes per parameter ({bytes_model.precision}, {bytes_model.optimizer}): "
        f"{bytes_model.describe()}"
    )
    gpu_only = ", ".join(f"{s} {formula(s, bytes_model)}" for s in STRATEGIES[:4])
    offload = "; ".join(f"{s} {formula(s, bytes_model)}" for s in STRATEGIES[4:])
    lines.append(
        f"per GPU, Psi = {format_count(size.params)} parameters, N = {world_size} GPUs (ZeRO "
        f"paper, Rajbhandari et al. 2020, section 5): {gpu_only}"
    )
    lines.append(f"offload (DeepSpeed ZeRO-Offload estimators): {offload}")
    if size.largest_layer_params:
        p_g = bytes_model.param_bytes + bytes_model.grad_bytes
        largest = size.largest_layer_params
        lines.append(
            f"ZeRO-3 gathers one module at a time: {p_g} bytes x {format_count(largest)} "
            f"parameters of the largest = {format_bytes(p_g * largest)}"
        )
    else:
        lines.append("ZeRO-3's gathered module is not counted (a bare count gives no modules)")
    if acts is None:
        lines.append(
            "activations are not counted (pass activation=Activations(seq_len=..., "
            "batch_size=...)); the headroom has to hold them"
        )
    else:
        lines.append(acts.formula)
    lines.append(
        f"headroom: {headroom:.0%} of each GPU's (and node's CPU) memory kept free for the CUDA "
        "context, allocator fragmentation and communication buckets (DDP's can add up to "
        "another g Psi unless gradient_as_bucket_view=True)"
    )
    lines.append("GB = 10^9 bytes, as in the ZeRO paper (a GPU sold as 80 GB has about 85e9)")
    if meshes:
        lines.append(
            "meshes: stages cut where parameters are most even; tp splits layer projections "
            "(not norms) and the embedding, the head stays whole; FSDP gathers one layer; "
            "activations s*b*h*(10 + 24/t) per layer (Korthikanti et al. 2022, table 2), "
            "min(m, pp - i) micro-batches in flight on stage i under 1F1B, "
            f"m = {microbatches or '4*pp'} micro-batches a step"
        )
    return tuple(lines)
