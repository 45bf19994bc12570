"""The byte model: how many bytes each parameter costs, by precision and optimizer.

Following the ZeRO paper (Rajbhandari et al. 2020, section 3.1), a parameter costs ``p`` bytes
for its working copy, ``g`` for its gradient and ``K`` for the optimizer's states:

- mixed precision (``bf16-mixed``, ``fp16-mixed``): p = 2, g = 2, and K = 4 (the fp32 master
  copy) + 4 per optimizer state; for Adam K = 12, in all 16 bytes per parameter.
- ``fp32``: p = 4, g = 4, no master copy, K = 4 per optimizer state; for Adam 4 + 4 + 8 = 16.

Optimizer states: Adam and AdamW keep two (first and second moments), SGD with momentum one,
plain SGD none. Optimizers with other state (Adafactor, 8-bit Adam) are not modelled.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from sparktrain.ground.errors import ConfigError

Precision = Literal["bf16-mixed", "fp16-mixed", "fp32"]
Optimizer = Literal["adam", "adamw", "sgd", "sgd-momentum"]

PRECISIONS: tuple[Precision, ...] = get_args(Precision)
OPTIMIZERS: tuple[Optimizer, ...] = get_args(Optimizer)

_STATES: dict[Optimizer, int] = {"adam": 2, "adamw": 2, "sgd": 0, "sgd-momentum": 1}
_STATE_NAMES: dict[Optimizer, str] = {
    "adam": "Adam moments",
    "adamw": "AdamW moments",
    "sgd": "SGD states",
    "sgd-momentum": "SGD momentum",
}


@dataclass(frozen=True, kw_only=True)
class ByteModel:
    """Bytes per parameter, by what they hold.

    Attributes:
        precision: The training precision.
        optimizer: The optimizer.
        param_bytes: ``p``, the working copy of a parameter (2 in 16-bit, 4 in fp32).
        grad_bytes: ``g``, its gradient, in the working precision.
        master_bytes: The fp32 master copy kept by mixed precision (0 in fp32).
        state_bytes: The optimizer's states, 4 bytes (fp32) each.
    """

    precision: Precision
    optimizer: Optimizer
    param_bytes: int
    grad_bytes: int
    master_bytes: int
    state_bytes: int

    @property
    def optimizer_bytes(self) -> int:
        """``K``: everything the optimizer keeps per parameter (master copy + states)."""
        return self.master_bytes + self.state_bytes

    @property
    def total(self) -> int:
        """``p + g + K``, the bytes per parameter of plain data parallelism (16 for Adam)."""
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes

    def describe(self) -> str:
        """The arithmetic in words, e.g. ``2 (bf16 params) + 2 (bf16 grads) + 12 (...) = 16``."""
        kind = "fp32" if self.precision == "fp32" else self.precision.split("-")[0]
        parts = []
        if self.master_bytes:
            parts.append(f"fp32 master {self.master_bytes}")
        if self.state_bytes or not self.master_bytes:
            states = self.state_bytes // 4
            parts.append(f"{states} x 4 {_STATE_NAMES[self.optimizer]}")
        optimizer = " + ".join(parts)
        return (
            f"{self.param_bytes} ({kind} params) + {self.grad_bytes} ({kind} grads) + "
            f"{self.optimizer_bytes} (optimizer: {optimizer}) = {self.total} bytes per parameter"
        )


def byte_model(precision: object, optimizer: object) -> ByteModel:
    """The byte model of ``precision`` and ``optimizer``.

    Raises:
        ConfigError: An unknown precision or optimizer; the message lists the choices.
    """
    checked_precision = next((p for p in PRECISIONS if p == precision), None)
    if checked_precision is None:
        raise ConfigError(
            f"unknown precision={precision!r}; choose one of: {', '.join(PRECISIONS)}."
        )
    checked_optimizer = next((o for o in OPTIMIZERS if o == optimizer), None)
    if checked_optimizer is None:
        raise ConfigError(
            f"unknown optimizer={optimizer!r}; choose one of: {', '.join(OPTIMIZERS)}."
        )
    mixed = checked_precision != "fp32"
    return ByteModel(
        precision=checked_precision,
        optimizer=checked_optimizer,
        param_bytes=2 if mixed else 4,
        grad_bytes=2 if mixed else 4,
        master_bytes=4 if mixed else 0,
        state_bytes=4 * _STATES[checked_optimizer],
    )
