"""The strategies and their memory per GPU: the ZeRO paper's formulas, plus CPU offload.

With Psi parameters, N data-parallel GPUs and the byte model's p, g, K (see ``bytemodel``), the
model states per GPU are (Rajbhandari et al. 2020, section 5, figure 1)::

    ddp    (p + g + K) * Psi             16 Psi for mixed-precision Adam
    zero1  (p + g) * Psi + K * Psi / N   4 Psi + 12 Psi / N   (optimizer states partitioned)
    zero2  p * Psi + (g + K) * Psi / N   2 Psi + 14 Psi / N   (+ gradients)
    zero3  (p + g + K) * Psi / N         16 Psi / N           (+ parameters; = FSDP FULL_SHARD)

The offload variants follow DeepSpeed's ZeRO-Offload and its estimators
(``estimate_zero2_model_states_mem_needs``, ``estimate_zero3_model_states_mem_needs``): the
optimizer states and an fp32 copy of each GPU's gradient partition live in CPU memory, so the
host holds (K + 4) * Psi / N per GPU (16 Psi per node for mixed Adam, as DeepSpeed's
``16 * total_params / num_nodes``); with parameter offload the host also keeps the parameters,
(p + K + 4) * Psi / N (DeepSpeed's 18). Gradients leave the GPU in buckets, whose transient
buffers are not counted. ZeRO-3 also gathers the full parameters (and gradients) of one module at
a time: (p + g) * largest module, when the model's modules are known.

Gradients and optimizer states scale with the trainable parameters, parameters with all of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from sparktrain.ground.errors import ConfigError
from sparktrain.planner.bytemodel import ByteModel
from sparktrain.planner.model import ModelSize

Strategy = Literal[
    "ddp", "zero1", "zero2", "zero3", "zero2_offload", "zero3_offload", "zero3_offload_params"
]
#: Every strategy, in order of preference: least communication first, offload last.
STRATEGIES: tuple[Strategy, ...] = get_args(Strategy)

_CPU_GRAD_BYTES = 4  # the fp32 gradient partition the CPU optimizer reads


@dataclass(frozen=True, kw_only=True)
class StrategyInfo:
    """What a strategy is, in words.

    Attributes:
        title: Its usual name.
        runs_as: How to run it in PyTorch or DeepSpeed.
        communication: Its communication per step (ZeRO paper section 7) and any CPU traffic.
    """

    title: str
    runs_as: str
    communication: str


INFO: dict[Strategy, StrategyInfo] = {
    "ddp": StrategyInfo(
        title="DDP (plain data parallel)",
        runs_as="DistributedDataParallel",
        communication="all-reduce of the gradients, 2 Psi per step",
    ),
    "zero1": StrategyInfo(
        title="ZeRO-1 (optimizer states sharded)",
        runs_as="ZeroRedundancyOptimizer + DDP, or DeepSpeed stage 1",
        communication="2 Psi per step, as DDP",
    ),
    "zero2": StrategyInfo(
        title="ZeRO-2 (+ gradients sharded)",
        runs_as="FSDP SHARD_GRAD_OP, or DeepSpeed stage 2",
        communication="2 Psi per step, as DDP (reduce-scatter + all-gather)",
    ),
    "zero3": StrategyInfo(
        title="ZeRO-3 / FSDP (+ parameters sharded)",
        runs_as="FSDP FULL_SHARD or fully_shard, or DeepSpeed stage 3",
        communication="3 Psi per step, 1.5x DDP (parameters gathered in forward and backward)",
    ),
    "zero2_offload": StrategyInfo(
        title="ZeRO-2 + optimizer offload (ZeRO-Offload)",
        runs_as="DeepSpeed stage 2 with offload_optimizer to cpu",
        communication="2 Psi per step, plus gradients to and parameters from the CPU over PCIe "
        "and the optimizer step on the CPU",
    ),
    "zero3_offload": StrategyInfo(
        title="ZeRO-3 + optimizer offload",
        runs_as="DeepSpeed stage 3 with offload_optimizer to cpu",
        communication="3 Psi per step, plus PCIe traffic and the optimizer step on the CPU",
    ),
    "zero3_offload_params": StrategyInfo(
        title="ZeRO-3 + optimizer and parameter offload",
        runs_as="DeepSpeed stage 3 with offload_optimizer and offload_param to cpu, or FSDP "
        "with CPU offload",
        communication="3 Psi per step, every parameter over PCIe in forward and backward, the "
        "optimizer step on the CPU",
    ),
}


@dataclass(frozen=True, kw_only=True)
class StrategyMemory:
    """Bytes one strategy needs, per GPU and per node's CPU.

    Attributes:
        strategy: The strategy's name.
        params: Parameter bytes per GPU.
        grads: Gradient bytes per GPU.
        optimizer: Optimizer-state bytes per GPU (master copy included).
        working: ZeRO-3's gathered module (parameters and gradients), per GPU; 0 when unknown.
        activations: Activation bytes per GPU; 0 when not estimated.
        cpu_per_node: Host memory the offloaded states take on each node.
    """

    strategy: Strategy
    params: int
    grads: int
    optimizer: int
    working: int
    activations: int
    cpu_per_node: int

    @property
    def model_states(self) -> int:
        """Parameters + gradients + optimizer states per GPU: the ZeRO paper's figure."""
        return self.params + self.grads + self.optimizer

    @property
    def gpu_total(self) -> int:
        """Everything counted on one GPU."""
        return self.model_states + self.working + self.activations


def check_strategy(name: object) -> Strategy:
    """Return ``name`` as a :data:`Strategy`.

    Raises:
        ConfigError: Not a strategy; the message lists them.
    """
    found = next((s for s in STRATEGIES if s == name), None)
    if found is None:
        raise ConfigError(f"unknown strategy {name!r}; choose one of: {', '.join(STRATEGIES)}.")
    return found


def strategy_memory(
    strategy: Strategy,
    *,
    size: ModelSize,
    bytes_model: ByteModel,
    gpus_per_node: int,
    nodes: int,
    activations: int = 0,
) -> StrategyMemory:
    """The memory ``strategy`` needs for ``size`` on ``gpus_per_node * nodes`` GPUs."""
    n = gpus_per_node * nodes
    p, g, k = bytes_model.param_bytes, bytes_model.grad_bytes, bytes_model.optimizer_bytes
    total, trainable = size.params, size.trainable_params
    sharded_params = strategy.startswith("zero3")
    sharded_grads = strategy in ("zero2", "zero3")
    sharded_optimizer = strategy != "ddp"
    offload = "offload" in strategy
    offload_params = strategy == "zero3_offload_params"
    params = 0 if offload_params else _share(p * total, n if sharded_params else 1)
    grads = 0 if offload else _share(g * trainable, n if sharded_grads else 1)
    optimizer = 0 if offload else _share(k * trainable, n if sharded_optimizer else 1)
    cpu_per_gpu = _share((k + _CPU_GRAD_BYTES) * trainable, n) if offload else 0
    if offload_params:
        cpu_per_gpu += _share(p * total, n)
    working = (p + g) * (size.largest_layer_params or 0) if sharded_params else 0
    return StrategyMemory(
        strategy=strategy,
        params=params,
        grads=grads,
        optimizer=optimizer,
        working=working,
        activations=activations,
        cpu_per_node=cpu_per_gpu * gpus_per_node,
    )


def formula(strategy: Strategy, bytes_model: ByteModel) -> str:
    """The strategy's per-GPU formula with the byte model's numbers, e.g. ``4 Psi + 12 Psi/N``."""
    p, g, k = bytes_model.param_bytes, bytes_model.grad_bytes, bytes_model.optimizer_bytes
    cpu = k + _CPU_GRAD_BYTES
    return {
        "ddp": f"{p + g + k} Psi",
        "zero1": f"{p + g} Psi + {k} Psi/N",
        "zero2": f"{p} Psi + {g + k} Psi/N",
        "zero3": f"{p + g + k} Psi/N",
        "zero2_offload": f"GPU {p} Psi; CPU {cpu} Psi/N per GPU",
        "zero3_offload": f"GPU {p} Psi/N; CPU {cpu} Psi/N per GPU",
        "zero3_offload_params": f"GPU 0 (one module at a time); CPU {p + cpu} Psi/N per GPU",
    }[strategy]


def _share(nbytes: int, parts: int) -> int:
    return -(-nbytes // parts)
