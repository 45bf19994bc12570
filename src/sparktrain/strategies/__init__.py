"""Inside the training function: wrap the model and the data for the chosen strategy.

``prepare_model(model, strategy=...)`` moves the model to the rank's device and wraps it for
``"ddp"``, ``"fsdp"`` (PyTorch FSDP2 ``fully_shard``; ZeRO-3 equivalent, or ZeRO-2 with
``reshard_after_forward=False``, with CPU offload on request) or ``"auto"``, which asks
:func:`sparktrain.plan` and takes its recommendation. The training loop stays the same for
every strategy.
"""

from sparktrain.strategies.data import prepare_data_loader
from sparktrain.strategies.prepare import (
    STRATEGIES,
    device,
    full_state_dict,
    prepare_model,
)

__all__ = ["STRATEGIES", "device", "full_state_dict", "prepare_data_loader", "prepare_model"]
