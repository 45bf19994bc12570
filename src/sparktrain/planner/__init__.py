"""The memory planner: how much memory each strategy needs per GPU, and which one to use.

``plan("13B", gpus_per_node=4, gpu_memory="80GB")`` returns a :class:`MemoryPlan` for DDP,
ZeRO-1, ZeRO-2, ZeRO-3 (FSDP) and the CPU-offload variants, with the recommended strategy and
the reasons; ``advise_cluster("70B")`` advises a GPU kind and the number of nodes. Everything
here is pure arithmetic on values: importing it imports neither torch nor transformers.
"""

from __future__ import annotations

from sparktrain.planner.activations import Activations
from sparktrain.planner.api import plan
from sparktrain.planner.bytemodel import OPTIMIZERS, PRECISIONS, ByteModel, Optimizer, Precision
from sparktrain.planner.cluster import (
    GPU_KINDS,
    ClusterAdvice,
    ClusterOption,
    GpuKind,
    advise_cluster,
)
from sparktrain.planner.memory_plan import MemoryPlan
from sparktrain.planner.model import ModelSize, model_size
from sparktrain.planner.recommend import StrategyEstimate
from sparktrain.planner.strategies import STRATEGIES, Strategy, StrategyMemory

__all__ = [
    "GPU_KINDS",
    "OPTIMIZERS",
    "PRECISIONS",
    "STRATEGIES",
    "Activations",
    "ByteModel",
    "ClusterAdvice",
    "ClusterOption",
    "GpuKind",
    "MemoryPlan",
    "ModelSize",
    "Optimizer",
    "Precision",
    "Strategy",
    "StrategyEstimate",
    "StrategyMemory",
    "advise_cluster",
    "model_size",
    "plan",
]
