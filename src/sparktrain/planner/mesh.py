"""Memory per GPU of every tensor x pipeline x FSDP mesh, and the one to use. Pure arithmetic.

For ``tp`` ranks splitting each layer (inside a node), ``pp`` pipeline stages and ``dp = N / (tp
* pp)`` data-parallel replicas sharding what is left (FSDP, ZeRO-3), as
``prepare_model(..., tp=, pp=)`` runs them:

- **Stages.** The model is the sequence embedding, ``L`` equal layers, head (``V*h`` each, the
  head absent when tied), cut where the stages' parameter counts are most even (as sparktrain
  cuts an ``nn.Sequential``). Each layer holds ``(Psi - embedding - head) / L`` parameters.
- **Tensor parallelism** splits a layer's projections over ``tp`` (its ``2*h`` norm weights stay
  whole) and the embedding over the vocabulary; the head stays whole (sparktrain's built-in plan).
- **Model states** per GPU are ``(p + g + K) * stage parameters / dp``; FSDP also gathers one
  layer at a time, ``(p + g) * layer / tp`` (nothing when ``dp == 1``).
- **Activations** follow Korthikanti et al. 2022, table 2 (tensor parallel, no sequence
  parallel): ``s*b*h*(10 + 24/t)`` per layer and micro-batch, ``+ 5*a*s^2*b/t`` when attention
  stores its scores; with checkpointing, ``2*s*b*h`` per layer plus one layer's whole. Under 1F1B
  stage ``i`` holds ``min(m, pp - i)`` micro-batches in flight (GPipe holds all ``m``); the last
  stage adds fp32 logits, ``4*s*b*V``.
- **Bubble**: ``(pp - 1) / (m + pp - 1)`` of each step is idle (GPipe and 1F1B).

The preference: the fewest model-parallel splits (``tp * pp``) that fit with headroom, then the
smaller pipeline (tensor parallelism inside a node costs no bubble), then the least memory.
"""

from __future__ import annotations

from dataclasses import dataclass

from sparktrain.planner.bytemodel import ByteModel
from sparktrain.planner.partition import balanced_bounds
from sparktrain.planner.units import format_bytes


@dataclass(frozen=True, kw_only=True)
class MeshShapeSpec:
    """The transformer's shape and the run's, as the mesh arithmetic needs them."""

    params: int
    trainable_params: int
    layers: int
    hidden: int
    heads: int
    vocab: int
    tied: bool
    seq_len: int
    micro_batch: int
    microbatches: int | None
    width: int
    checkpointing: bool
    attention_scores: bool


@dataclass(frozen=True, kw_only=True)
class MeshEstimate:
    """One mesh's memory per GPU (its fullest stage) and whether it fits.

    Attributes:
        tp: Tensor-parallel degree.
        pp: Pipeline stages.
        dp: Data-parallel (FSDP) replicas.
        microbatches: Micro-batches per step (1 without a pipeline).
        stage_states: Model states (parameters, gradients, optimizer) per GPU of each stage.
        stage_layers: Layers of each stage.
        states: Model states per GPU on the fullest stage.
        gathered: FSDP's gathered layer on that stage.
        activations: Activations per GPU on that stage.
        total: GPU total on the fullest stage.
        bubble: Idle fraction of a step (pipeline fill and drain).
        fits: The total fits in one GPU.
        fits_with_headroom: The total fits with the headroom kept free.
    """

    tp: int
    pp: int
    dp: int
    microbatches: int
    stage_states: tuple[int, ...]
    stage_layers: tuple[int, ...]
    states: int
    gathered: int
    activations: int
    total: int
    bubble: float
    fits: bool
    fits_with_headroom: bool

    @property
    def name(self) -> str:
        """``tp=8 pp=2 dp=4``."""
        return f"tp={self.tp} pp={self.pp} dp={self.dp}"


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _layer_activations(spec: MeshShapeSpec, tp: int) -> int:
    s, b, h = spec.seq_len, spec.micro_batch, spec.hidden
    per = s * b * h * 10 + (s * b * h * 24) // tp
    if spec.attention_scores:
        per += (5 * spec.heads * s * s * b) // tp
    return spec.width * per


def estimate_mesh(
    spec: MeshShapeSpec,
    b: ByteModel,
    *,
    tp: int,
    pp: int,
    dp: int,
    gpu_memory: int,
    headroom: float,
) -> MeshEstimate:
    """The memory per GPU of the ``(pp, dp, tp)`` mesh (see the module docstring)."""
    emb = spec.vocab * spec.hidden
    head = 0 if spec.tied else emb
    layer = max(0, (spec.params - emb - head) // spec.layers)
    layer_local = (layer - 2 * spec.hidden) // tp + 2 * spec.hidden
    emb_local = emb // tp if spec.vocab % tp == 0 and not spec.tied else emb
    sizes = [emb, *([layer] * spec.layers), head]
    bounds = balanced_bounds(sizes, pp)
    ratio = spec.trainable_params / spec.params if spec.params else 1.0
    m = 1 if pp == 1 else (spec.microbatches or 4 * pp)
    per_layer = _layer_activations(spec, tp)
    stages = []  # (states, gathered, activations, layers) of each stage
    for index, (start, stop) in enumerate(bounds):
        count = sum(1 for i in range(start, stop) if 0 < i <= spec.layers)
        local = count * layer_local + (emb_local if start == 0 else 0)
        local += head if stop == len(sizes) else 0
        state = (b.param_bytes * local + (b.grad_bytes + b.optimizer_bytes) * local * ratio) / dp
        biggest = max([layer_local if count else 0, emb_local if start == 0 else 0])
        gathered = (b.param_bytes + b.grad_bytes) * biggest if dp > 1 else 0
        in_flight = min(m, pp - index)
        if spec.checkpointing:
            acts = count * 2 * spec.seq_len * spec.micro_batch * spec.hidden * spec.width
            acts = in_flight * acts + per_layer
        else:
            acts = in_flight * count * per_layer
        if stop == len(sizes):
            acts += 4 * spec.seq_len * spec.micro_batch * spec.vocab
        stages.append((int(state), int(gathered), acts, count))
    states, gathered, acts, _ = max(stages, key=lambda stage: sum(stage[:3]))
    total = states + gathered + acts
    return MeshEstimate(
        tp=tp,
        pp=pp,
        dp=dp,
        microbatches=m,
        stage_states=tuple(stage[0] for stage in stages),
        stage_layers=tuple(stage[3] for stage in stages),
        states=states,
        gathered=gathered,
        activations=acts,
        total=total,
        bubble=(pp - 1) / (m + pp - 1),
        fits=total <= gpu_memory,
        fits_with_headroom=total <= (1 - headroom) * gpu_memory,
    )


def plan_meshes(
    spec: MeshShapeSpec,
    b: ByteModel,
    *,
    gpus_per_node: int,
    nodes: int,
    gpu_memory: int,
    headroom: float,
) -> tuple[tuple[MeshEstimate, ...], MeshEstimate | None, tuple[str, ...]]:
    """Every mesh that the cluster and the model allow, the recommended one, and why.

    ``tp`` divides a node; ``pp`` divides what is left and is at most the layer count.
    """
    world = gpus_per_node * nodes
    found = []
    for tp in _divisors(gpus_per_node):
        for pp in _divisors(world // tp):
            if pp > spec.layers:
                continue
            found.append(
                estimate_mesh(
                    spec,
                    b,
                    tp=tp,
                    pp=pp,
                    dp=world // (tp * pp),
                    gpu_memory=gpu_memory,
                    headroom=headroom,
                )
            )
    ordered = tuple(sorted(found, key=lambda e: (e.tp * e.pp, e.pp, e.total)))
    chosen = next((e for e in ordered if e.fits_with_headroom), None)
    return ordered, chosen, _reasons(ordered, chosen, gpu_memory, headroom)


def _reasons(
    ordered: tuple[MeshEstimate, ...], chosen: MeshEstimate | None, gpu: int, headroom: float
) -> tuple[str, ...]:
    room = format_bytes(int((1 - headroom) * gpu))
    fsdp = ordered[0]
    if chosen is None:
        least = min(ordered, key=lambda e: e.total)
        return (
            f"no mesh fits in {room} per GPU: the smallest, {least.name}, needs "
            f"{format_bytes(least.total)} ({format_bytes(least.activations)} of activations). "
            "Turn on activation checkpointing, shorten the micro-batch or sequence, or add GPUs.",
        )
    if chosen is fsdp:
        return (
            f"FSDP alone ({fsdp.name}) fits: {format_bytes(fsdp.total)} of {room} per GPU, "
            "with no tensor-parallel all-reduces and no pipeline bubble.",
        )
    lines = [
        f"FSDP alone ({fsdp.name}) needs {format_bytes(fsdp.total)} per GPU "
        f"({format_bytes(fsdp.activations)} of activations), more than the {room} usable.",
    ]
    if chosen.tp > 1:
        lines.append(
            f"tp={chosen.tp} splits each layer's projections and most of its activations over "
            f"{chosen.tp} GPUs of a node (two all-reduces per layer, forward and backward, on "
            "the node's fast links)."
        )
    if chosen.pp > 1:
        lines.append(
            f"pp={chosen.pp} puts {max(chosen.stage_layers)} layers or fewer on each stage "
            f"(across nodes); with {chosen.microbatches} micro-batches the bubble idles "
            f"{chosen.bubble:.0%} of each step."
        )
    lines.append(
        f"{chosen.name}: {format_bytes(chosen.total)} per GPU on its fullest stage, the fewest "
        "model-parallel splits that fit."
    )
    return tuple(lines)
