"""A prepared model back as a plain module with whole weights, or as its whole state.

Whatever :func:`~sparktrain.strategies.prepare_model` made of a model (DDP, FSDP, a ZeRO engine,
a pipeline's stage), :func:`full_state_dict` gathers its whole ``state_dict`` and
:func:`plain_module` rebuilds the plain module, from the weightless skeleton that
``prepare_model`` keeps on the prepared model under :data:`SKELETON`.
"""

from __future__ import annotations

from typing import Any

from sparktrain.strategies import registry
from sparktrain.strategies.skeleton import rebuild

#: The attribute of a prepared model that holds its weightless skeleton.
SKELETON = "_sparktrain_skeleton"


def full_state_dict(model: Any) -> dict[str, Any]:
    """The whole, unwrapped ``state_dict`` of a prepared model, on every rank, on the CPU.

    A collective for FSDP, ZeRO-3 and pipelines (the shards and stages are gathered): call it on
    every rank. A DDP or FSDP module wrapped outside :func:`prepare_model` works too.
    """
    return registry.strategy_of(model).full_state_dict(model)


def plain_module(model: Any) -> Any:
    """``model`` as a plain module with whole weights, loadable without a process group.

    DDP and FSDP1 wrappers are unwrapped; models that ``prepare_model`` sharded, split or handed
    to DeepSpeed (FSDP2, ``tp``/``pp``, the ZeRO stages) are rebuilt on the CPU from their
    gathered state and a weightless skeleton, which is a collective: call it on every rank.
    """
    skeleton = getattr(model, SKELETON, None)
    if skeleton is not None:
        return rebuild(skeleton, full_state_dict(model))
    module = getattr(model, "module", model)  # DDP, FSDP1
    return getattr(module, "module", module)
