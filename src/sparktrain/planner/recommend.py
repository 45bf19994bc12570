"""Judge each strategy against the memory there is, pick one and say why, in plain words.

The rule: the first strategy, in order of preference (:data:`STRATEGIES`: least communication
first, CPU offload last), whose GPU total fits in ``(1 - headroom)`` of a GPU's memory and whose
offloaded states fit in ``(1 - headroom)`` of a node's CPU memory (when that is known). DDP,
ZeRO-1 and ZeRO-2 move the same 2 Psi per step (ZeRO paper section 7), so among them the one
that shards less is preferred, being simpler. Offload comes after every GPU-only strategy,
ZeRO-3 included: its speed hangs on the CPUs and the PCIe link, which the planner cannot see.
When nothing fits with headroom, the first that fits at all is recommended with a warning;
when nothing fits, nothing is recommended and the reasons say what to change.
"""

from __future__ import annotations

from dataclasses import dataclass

from sparktrain.planner.strategies import INFO, Strategy, StrategyMemory
from sparktrain.planner.units import format_bytes


@dataclass(frozen=True, kw_only=True)
class StrategyEstimate:
    """One strategy's memory and whether it fits.

    Attributes:
        memory: Bytes per GPU and per node's CPU.
        gpu_fraction: GPU total over one GPU's memory (1.0 = full).
        fits: The GPU total fits in a GPU, and the offloaded states in the CPU memory when known.
        fits_with_headroom: The same with ``headroom`` of each memory kept free.
        cpu_checked: Whether the CPU side was checked (``False`` when it offloads and the CPU
            memory was not given).
        fits_with_headroom_on_gpu: The GPU side alone fits with headroom.
    """

    memory: StrategyMemory
    gpu_fraction: float
    fits: bool
    fits_with_headroom: bool
    cpu_checked: bool
    fits_with_headroom_on_gpu: bool

    @property
    def strategy(self) -> Strategy:
        """The strategy's name."""
        return self.memory.strategy


def assess(
    memory: StrategyMemory, *, gpu_memory: int, cpu_memory: int | None, headroom: float
) -> StrategyEstimate:
    """Compare ``memory`` with a GPU's (and a node's CPU) memory."""
    cpu_needed = memory.cpu_per_node
    cpu_checked = cpu_needed == 0 or cpu_memory is not None
    cpu_fits = cpu_memory is None or cpu_needed <= cpu_memory
    cpu_roomy = cpu_memory is None or cpu_needed <= (1 - headroom) * cpu_memory
    gpu_roomy = memory.gpu_total <= (1 - headroom) * gpu_memory
    return StrategyEstimate(
        memory=memory,
        gpu_fraction=memory.gpu_total / gpu_memory,
        fits=memory.gpu_total <= gpu_memory and cpu_fits,
        fits_with_headroom=gpu_roomy and cpu_roomy,
        cpu_checked=cpu_checked,
        fits_with_headroom_on_gpu=gpu_roomy,
    )


def recommend(
    estimates: tuple[StrategyEstimate, ...],
    *,
    gpu_memory: int,
    cpu_memory: int | None,
    headroom: float,
) -> tuple[Strategy | None, tuple[str, ...]]:
    """Pick a strategy from ``estimates`` (in order of preference) and give the reasons."""
    chosen = next((e for e in estimates if e.fits_with_headroom), None)
    tight = chosen is None
    if chosen is None:
        chosen = next((e for e in estimates if e.fits), None)
    if chosen is None:
        why = [_why_not(e, gpu_memory, cpu_memory, headroom) for e in estimates]
        return None, (*why, _nothing_fits(estimates, gpu_memory))
    earlier = estimates[: estimates.index(chosen)]
    reasons = [_why_not(e, gpu_memory, cpu_memory, headroom) for e in earlier]
    info = INFO[chosen.strategy]
    where = (
        f"{chosen.strategy} needs {format_bytes(chosen.memory.gpu_total)} per GPU "
        f"({chosen.gpu_fraction:.0%} of {format_bytes(gpu_memory)})"
    )
    if tight:
        reasons.append(f"Nothing fits with {headroom:.0%} headroom; {where}: " + _tight(chosen))
    else:
        among = "and of the strategies that fit it" if earlier else "and it"
        reasons.append(
            f"{where}, within the {headroom:.0%} headroom, {among} communicates least: "
            f"{info.communication}."
        )
    if chosen.memory.cpu_per_node:
        cpu = format_bytes(chosen.memory.cpu_per_node)
        reasons.append(
            f"It keeps {cpu} of offloaded state in each node's CPU memory"
            + ("." if chosen.cpu_checked else "; pass cpu_memory= (--cpu-memory) to check it.")
        )
    reasons.append(f"Run it as: {info.runs_as}.")
    return chosen.strategy, tuple(reasons)


def _tight(chosen: StrategyEstimate) -> str:
    if chosen.fits_with_headroom_on_gpu:
        return (
            f"its {format_bytes(chosen.memory.cpu_per_node)} of CPU memory per node leaves little "
            "for the OS, data loading and pinned buffers (DeepSpeed's estimator adds 50 % for "
            "buffers). More CPU memory, or more nodes to spread the states, would be safer."
        )
    return (
        "it fits, but with little to spare for activations, the CUDA context and "
        "fragmentation, so expect out-of-memory errors. More GPUs or larger ones would be safer."
    )


def _why_not(
    estimate: StrategyEstimate, gpu_memory: int, cpu_memory: int | None, headroom: float
) -> str:
    memory = estimate.memory
    name, gpu = memory.strategy, format_bytes(memory.gpu_total)
    if memory.gpu_total > gpu_memory:
        return f"{name} needs {gpu} per GPU, more than the {format_bytes(gpu_memory)} a GPU has."
    if memory.gpu_total > (1 - headroom) * gpu_memory:
        return (
            f"{name} needs {gpu} per GPU ({estimate.gpu_fraction:.0%}): it would fit, but leaves "
            f"less than the {headroom:.0%} headroom kept for what is not counted."
        )
    assert cpu_memory is not None  # only the CPU side can fail now
    cpu = format_bytes(memory.cpu_per_node)
    if memory.cpu_per_node > cpu_memory:
        return (
            f"{name} fits on the GPU ({gpu}) but needs {cpu} of CPU memory per node, more than "
            f"the {format_bytes(cpu_memory)} given."
        )
    return (
        f"{name} fits on the GPU ({gpu}) but its {cpu} per node leaves less than "
        f"{headroom:.0%} of the {format_bytes(cpu_memory)} of CPU memory free."
    )


def _nothing_fits(estimates: tuple[StrategyEstimate, ...], gpu_memory: int) -> str:
    smallest = min(estimates, key=lambda e: e.memory.gpu_total)
    text = (
        f"Nothing fits. The least GPU memory is {format_bytes(smallest.memory.gpu_total)} per GPU "
        f"({smallest.strategy}). Add GPUs (sharded states shrink as 1/N), use GPUs with more "
        "memory, or shrink the activations (smaller micro-batch, activation checkpointing)"
    )
    if any(e.memory.cpu_per_node and e.memory.gpu_total <= gpu_memory for e in estimates):
        text += ", or give each node more CPU memory for the offload variants"
    return text + "."
