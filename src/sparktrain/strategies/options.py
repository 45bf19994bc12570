"""``prepare_model``'s keywords grouped by concern, as frozen values the strategies read.

Runs inside a rank. The public ``prepare_model(...)`` keeps its flat keywords, since users call
it with them; they are grouped once, here, so that each strategy object reads the group it owns
(FSDP the sharding, ``auto`` the budget, DeepSpeed its configuration) and the tensor x pipeline
layout travels as one value. ``auto`` rewrites a copy (:func:`dataclasses.replace`), never the
user's values.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sparktrain.strategies.composed import Pipelining


@dataclass(frozen=True, kw_only=True)
class Sharding:
    """How ``fsdp`` shards (FSDP2 ``fully_shard``).

    Attributes:
        reshard_after_forward: Free the gathered parameters after forward (ZeRO-3); ``False``
            keeps them until backward (ZeRO-2).
        cpu_offload: Keep parameter shards and optimizer states in CPU memory.
    """

    reshard_after_forward: bool = True
    cpu_offload: bool = False


@dataclass(frozen=True, kw_only=True)
class Parallelism:
    """The tensor x pipeline layout (``ddp`` and ``fsdp`` compose with it).

    Attributes:
        tp: Tensor-parallel degree.
        pp: Pipeline stages across ranks.
        plan: The user's ``parallelize_plan``, or ``None`` for the built-in one.
        pipelining: The pipeline's schedule, micro-batches and cut points.
    """

    tp: int = 1
    pp: int = 1
    plan: dict[str, Any] | None = None
    pipelining: Pipelining = field(default_factory=Pipelining)

    @property
    def composed(self) -> bool:
        """Whether the model is split (``tp``/``pp``, or a plan that asks for it)."""
        return self.tp != 1 or self.pp != 1 or self.plan is not None

    def settings(self) -> dict[str, Any]:
        """The layout's parameters for the tracking run (none when the model is not split)."""
        return {
            **({"tp": self.tp} if self.tp != 1 else {}),
            **({"pp": self.pp, "pp_schedule": self.pipelining.schedule} if self.pp != 1 else {}),
        }


@dataclass(frozen=True, kw_only=True)
class Budget:
    """What ``auto`` plans for.

    Attributes:
        gpu_memory: Memory of one GPU (``None``: read from the device).
        cpu_memory: CPU memory of one node, for the offload strategies.
        plan_shape: The run's shape for :func:`sparktrain.plan` (``seq_len``, ...).
    """

    gpu_memory: int | float | str | None = None
    cpu_memory: int | float | str | None = None
    plan_shape: dict[str, Any] | None = None


@dataclass(frozen=True, kw_only=True)
class PrepareOptions:
    """Everything ``prepare_model`` was told, by concern.

    Attributes:
        precision: ``None`` (fp32), ``"bf16"`` or ``"fp16"``.
        sharding: FSDP's options.
        parallel: The tensor x pipeline layout.
        budget: What ``auto`` plans for.
        deepspeed_config: ZeRO: settings merged over the stage's defaults.
    """

    precision: str | None = None
    sharding: Sharding = field(default_factory=Sharding)
    parallel: Parallelism = field(default_factory=Parallelism)
    budget: Budget = field(default_factory=Budget)
    deepspeed_config: dict[str, Any] | None = None
