"""What a replica group's ranks send to heal a joining group: objects, and optimizer state.

A sharded model's optimizer state holds DTensors whose mesh is the sender's replica group; they
travel as their local shards, and the receiver makes them DTensors over its own group's mesh
(the same placements and shapes: both groups shard alike).
"""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import Any


def root_options(rank: int) -> Any:
    """Broadcast options from ``rank`` (a backend's own ``broadcast`` takes them, not a rank)."""
    import torch.distributed as dist

    options = dist.BroadcastOptions()
    options.rootRank = rank
    return options


def broadcast_object(
    wait: Callable[[Any], None], group: Any, value: Any, root: int, mine: int
) -> Any:
    """``value`` of ``group``'s rank ``root``, on every rank (``wait`` waits for a collective)."""
    import torch

    if mine == root:
        buffer = io.BytesIO()
        torch.save(value, buffer)
        data = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)
        length = torch.tensor([data.numel()], dtype=torch.int64)
    else:
        length = torch.zeros(1, dtype=torch.int64)
    wait(group.broadcast([length], root_options(root)))
    if mine != root:
        data = torch.empty(int(length.item()), dtype=torch.uint8)
    wait(group.broadcast([data], root_options(root)))
    if mine == root:
        return value
    return torch.load(io.BytesIO(data.numpy().tobytes()), weights_only=False)


def optimizer_state(optimizer: Any) -> dict[str, Any]:
    """The optimizer's state dict with each DTensor as its local shard (marked)."""
    from torch.distributed.tensor import DTensor

    state = dict(optimizer.state_dict())
    state["state"] = {  # new dicts: the state dict's own are the optimizer's live ones
        index: {
            key: ("local", value.to_local()) if isinstance(value, DTensor) else value
            for key, value in values.items()
        }
        for index, values in state["state"].items()
    }
    return state


def load_optimizer_state(optimizer: Any, state: dict[str, Any]) -> None:
    """Load :meth:`_optimizer_state`'s form: each marked shard back as this rank's DTensor."""
    from torch.distributed.tensor import DTensor

    order = [p for group in optimizer.param_groups for p in group["params"]]
    for index, values in state["state"].items():
        p = order[int(index)]
        for key, value in list(values.items()):
            if isinstance(value, tuple) and len(value) == 2 and value[0] == "local":
                values[key] = DTensor.from_local(
                    value[1], p.device_mesh, p.placements, shape=p.shape, stride=p.stride(),
                    run_check=False,
                )  # fmt: skip
    optimizer.load_state_dict(state)
