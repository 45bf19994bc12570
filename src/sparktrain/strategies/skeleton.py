"""The weightless skeleton: the plain module's structure, for rebuilding a sharded model.

Runs inside a rank. ``plain_module`` and ``log_model`` need the user's module back from a model
whose parameters are shards (FSDP2, ZeRO-3), pieces (``tp``/``pp``) or cast in place (DeepSpeed's
bf16 and fp16). ``prepare_model`` keeps a copy of the module whose parameters and buffers are on
the meta device, made before the strategy changes the module, and only for the strategies that
need it (:meth:`~sparktrain.strategies.base.Strategy.needs_skeleton`).

``copy.deepcopy(model).to("meta")`` would copy every weight first, briefly doubling the model in
memory. Instead the deep copy starts from a memo that already maps each parameter and buffer to
an empty meta tensor of its shape and dtype, so ``deepcopy`` never reaches the weights' storage;
everything else (submodules, hooks, attributes, tied parameters) is copied as ``deepcopy``
copies it.
"""

from __future__ import annotations

import copy
from itertools import chain
from typing import Any


def _meta_like(tensor: Any) -> Any:
    import torch
    from torch import nn

    empty = torch.empty_like(tensor, device="meta")
    if isinstance(tensor, nn.Parameter):
        return nn.Parameter(empty, requires_grad=tensor.requires_grad)
    return empty


def weightless_copy(model: Any) -> Any:
    """A deep copy of ``model`` with its parameters and buffers on the meta device.

    No weight is read or copied: the memo hands ``deepcopy`` a meta tensor for each one (tied
    parameters stay tied, as they are one object).
    """
    memo: dict[int, Any] = {}
    for tensor in chain(model.parameters(), model.buffers()):
        if id(tensor) not in memo:
            memo[id(tensor)] = _meta_like(tensor)
    return copy.deepcopy(model, memo)


def rebuild(skeleton: Any, state: dict[str, Any]) -> Any:
    """A plain CPU module: a copy of ``skeleton`` filled with ``state``."""
    plain = copy.deepcopy(skeleton).to_empty(device="cpu")
    plain.load_state_dict(state)
    return plain
