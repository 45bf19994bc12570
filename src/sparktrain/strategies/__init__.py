"""Inside the training function: wrap the model and the data for the chosen strategy.

``prepare_model(model, strategy=...)`` moves the model to the rank's device and wraps it for
``"ddp"``, ``"fsdp"`` (PyTorch FSDP2 ``fully_shard``; ZeRO-3 equivalent, or ZeRO-2 with
``reshard_after_forward=False``, with CPU offload on request), the DeepSpeed ZeRO stages
(``"zero1"`` ... ``"zero3_offload"``) or ``"auto"``, which asks :func:`sparktrain.plan` and
takes its recommendation. With ``prepare_optimizer`` and ``backward``, the training loop stays
the same for every strategy.
"""

from sparktrain.strategies.data import prepare_data_loader
from sparktrain.strategies.memory import held_bytes
from sparktrain.strategies.prepare import (
    STRATEGIES,
    backward,
    device,
    forward_backward,
    prepare_model,
    prepare_optimizer,
)
from sparktrain.strategies.reshard import load_sharded_state, sharded_state, to_universal
from sparktrain.strategies.unwrap import full_state_dict, plain_module
from sparktrain.strategies.zero import deepspeed_config

__all__ = [
    "STRATEGIES",
    "backward",
    "deepspeed_config",
    "device",
    "forward_backward",
    "full_state_dict",
    "held_bytes",
    "load_sharded_state",
    "plain_module",
    "prepare_data_loader",
    "prepare_model",
    "prepare_optimizer",
    "sharded_state",
    "to_universal",
]
