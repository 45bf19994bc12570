"""The checkpoint of a ZeRO in-place run: every rank writes its own partition, once.

The flat parameter vector and each elementwise optimizer state (Adam's two moments) are saved
as ``torch.distributed.checkpoint`` DTensors sharded on dimension 0 over the generation's
ranks: a partition is ``ceil(n / world)`` elements, place ``i`` owning ``[i * c, (i + 1) * c)``
(clipped to ``n``), which is exactly how a DTensor's ``Shard(0)`` cuts a tensor, so each owner
writes its own partition and nothing twice (the copies are not written). Scalar states (Adam's
step) are plain tensors, alike on every rank (written once).

A load, at any world size, reads the whole parameter vector into every rank (each holds the
parameters) and its own new partition's states as a DTensor of the new size; the copies are
then handed to their holders by the run's own re-division from the owners
(:meth:`~sparktrain.rank.zero_partitions.Partitions._redivide`).
"""

from __future__ import annotations

from typing import Any

#: The keys of the saved state: the flat parameters and the optimizer's states.
FLAT, OPTIM = "flat", "optim"


def _mesh() -> Any:
    from torch.distributed import distributed_c10d
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh.from_group(distributed_c10d._get_default_group(), "cpu")


def _own(run: Any, tensor: Any, mesh: Any) -> Any:
    """``tensor`` (a partition's flat values, padded to the chunk) as this rank's shard.

    A copy: a view of the flat vector cannot be staged (torch deep-copies a DTensor the first
    time, which fails on a view of a storage the parameters share).
    """
    import torch
    from torch.distributed.tensor import DTensor, Shard

    chunk, place = run._chunk(run.plan), run.plan.index(run.me)
    keep = max(0, min(run.size - place * chunk, chunk))
    return DTensor.from_local(
        tensor[:keep].clone(),
        mesh,
        [Shard(0)],
        shape=torch.Size([run.size]),
        stride=(1,),
        run_check=False,
    )


def state(run: Any) -> dict[str, Any]:
    """What this rank saves: its own partition of the parameters and of each state."""
    import torch

    mesh, own = _mesh(), run.parts[run.plan.index(run.me)]
    chunk, place = run._chunk(run.plan), run.plan.index(run.me)
    saved: dict[str, Any] = {FLAT: _own(run, run.flat[place * chunk : (place + 1) * chunk], mesh)}
    states: dict[str, Any] = {}
    for key, value in run.optimizer.state.get(own, {}).items():
        if isinstance(value, torch.Tensor) and value.shape == own.shape:
            states[key] = _own(run, value, mesh)
        elif isinstance(value, torch.Tensor):
            states[key] = value
    saved[OPTIM] = states
    return saved


def target(run: Any) -> dict[str, Any]:
    """What a load fills: every parameter, and this rank's own new partition's states."""
    import torch
    from torch.distributed.checkpoint.state_dict import _init_optim_state

    _init_optim_state(run.optimizer)  # a fresh one's state: a step of zero gradients at lr 0
    mesh, own = _mesh(), run.parts[run.plan.index(run.me)]
    states: dict[str, Any] = {}
    for key, value in run.optimizer.state[own].items():
        if isinstance(value, torch.Tensor) and value.shape == own.shape:
            states[key] = _own(run, torch.zeros_like(value), mesh)
        elif isinstance(value, torch.Tensor):
            states[key] = value.clone()
    return {FLAT: torch.zeros(run.size, dtype=run.flat.dtype), OPTIM: states}


def adopt(run: Any, loaded: dict[str, Any]) -> None:
    """Make the loaded values the run's, then hand every partition's copy to its holder."""
    import torch
    from torch.distributed.tensor import DTensor

    run.flat[: run.size] = loaded[FLAT]
    own = run.parts[run.plan.index(run.me)]
    kept = run.optimizer.state[own]
    for key, value in loaded[OPTIM].items():
        if isinstance(value, DTensor):
            local = value.to_local()
            kept[key] = torch.zeros_like(own)
            kept[key][: local.numel()] = local
        else:
            kept[key] = value
    run._redivide(list(run.plan), list(run.plan))  # the copies, from their owners
