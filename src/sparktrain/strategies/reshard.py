"""Model and optimizer checkpoints that load at another world size (an elastic run's restart).

- DDP and FSDP2: :func:`sharded_state` gives the model's and the optimizer's state as this
  rank's shards (``torch.distributed.checkpoint.state_dict``) for
  ``checkpoint.save(state, directory, step, sharded=True)``; :func:`load_sharded_state` loads the
  newest such checkpoint at any world size: torch distributed checkpoint reshards each tensor
  onto the current ranks (unevenly where the sizes do not divide). A DDP model's full state
  saved by rank 0 (``checkpoint.save(state, directory, step)``) loads at any size as it is.
- ZeRO-1, ZeRO-2 and ZeRO-3: the same two calls; each rank's fragments of the fp32 master
  parameters and of the optimizer's state are written and loaded in place, at any world size
  (:mod:`~sparktrain.strategies.zero_state`).
- Every ZeRO stage, DeepSpeed's way: a checkpoint written by ``engine.save_checkpoint``
  holds each data-parallel rank's flat partitions and loads only at the size it was saved at.
  :func:`to_universal` converts it into a DeepSpeed universal checkpoint (one file per parameter
  and state), which an engine built with ``deepspeed_config={"checkpoint": {"load_universal":
  True}}`` loads with ``engine.load_checkpoint(directory)`` at any size.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sparktrain.rank.checkpoint import Checkpoint, latest_step, load_latest
from sparktrain.strategies import zero, zero_state


def sharded_state(model: Any, optimizer: Any) -> dict[str, Any]:
    """``{"model": ..., "optim": ...}``: this rank's shards, to save with ``sharded=True``.

    A collective for FSDP and ZeRO: call it on every rank. A ZeRO model gives its engine's
    fragments instead (:func:`~sparktrain.strategies.zero_state.zero_state`); one whose
    optimizer state is swapped to NVMe raises a :class:`~sparktrain.ConfigError` naming
    DeepSpeed's own checkpoints. On an optimizer that
    has not stepped yet, torch initialises the state with a step at learning rate 0 (Adam's
    step count becomes 1): build it for saving after training, and let
    :func:`load_sharded_state` build it for loading.

    Args:
        model: What ``prepare_model(..., "ddp" | "fsdp" | "zero1" | "zero2" | "zero3")``
            returned.
        optimizer: The torch optimizer over its parameters (for ZeRO, what
            ``prepare_optimizer`` returned).
    """
    from torch.distributed.checkpoint.state_dict import get_state_dict

    if isinstance(model, zero.ZeroModel):
        return zero_state.zero_state(model, optimizer)
    model_state, optim_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optim": optim_state}


def load_sharded_state(
    model: Any,
    optimizer: Any,
    directory: str | os.PathLike[str],
    *,
    on_rescale: Callable[[int, int], Any] | None = None,
) -> Checkpoint | None:
    """Load the newest checkpoint saved from :func:`sharded_state`, at any world size.

    A collective: call it on every rank. Leaves ``model`` and ``optimizer`` untouched and returns
    ``None`` when ``directory`` holds no complete checkpoint.

    Args:
        model: What ``prepare_model(..., "ddp" | "fsdp" | "zero1" | "zero2" | "zero3")``
            returned.
        optimizer: The torch optimizer over its parameters (for ZeRO, what
            ``prepare_optimizer`` returned).
        directory: The checkpoint folder given to ``checkpoint.save``.
        on_rescale: ``on_rescale(old_world_size, new_world_size)``, as for
            :func:`sparktrain.checkpoint.load_latest`.

    Returns:
        The loaded :class:`~sparktrain.checkpoint.Checkpoint` (its ``world_size`` is the size it
        was saved at), or ``None``.
    """
    from torch.distributed.checkpoint.state_dict import set_state_dict

    if isinstance(model, zero.ZeroModel):
        return zero_state.load_zero_state(model, optimizer, directory, on_rescale=on_rescale)
    if latest_step(directory) is None:
        return None
    state = sharded_state(model, optimizer)  # where each shard of this world size goes
    loaded = load_latest(directory, into=state, on_rescale=on_rescale)
    set_state_dict(
        model,
        optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optim"],
    )
    return loaded


def to_universal(
    folder: str | os.PathLike[str], output: str | os.PathLike[str] | None = None
) -> Path:
    """Convert a DeepSpeed ZeRO checkpoint into a universal one, loadable at any world size.

    Run it in one process (rank 0, then a barrier) once ``engine.save_checkpoint`` has returned on
    every rank. It also writes ``latest_universal`` beside ``output``, so that an engine built
    with ``{"checkpoint": {"load_universal": True}}`` loads it with
    ``engine.load_checkpoint(output.parent)``.

    Args:
        folder: One checkpoint of ``engine.save_checkpoint(directory, tag)``: ``directory/tag``.
        output: Where the universal checkpoint goes (default: ``folder`` + ``_universal``, beside
            it).

    Returns:
        The universal checkpoint's folder.
    """
    import argparse

    zero._deepspeed()
    from deepspeed.checkpoint.ds_to_universal import main

    source = Path(folder)
    target = Path(output) if output is not None else source.with_name(f"{source.name}_universal")
    options = argparse.Namespace(
        input_folder=str(source),
        output_folder=str(target),
        num_extract_workers=1,  # no process pool inside a rank
        num_merge_workers=1,
        keep_temp_folder=False,
        strict=True,
        inject_missing_state=True,  # engines outside Megatron record no universal-checkpoint info
    )
    main(options)
    return target
