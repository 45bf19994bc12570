"""The device mesh of a run: pipeline stages x data-parallel replicas x tensor-parallel shards.

Ranks are laid out row-major over ``(pp, dp, tp)``: the ``tp`` ranks of a group are consecutive,
so with node-contiguous ranks (every backend numbers a node's ranks together) tensor parallelism
stays inside a node, where the links are fast, and pipeline stages span nodes. :func:`mesh_shape`
is pure (it checks the numbers and names the fix); :func:`build_mesh` makes the torch
``DeviceMesh``; :func:`current` is the mesh ``prepare_model`` built, which
``prepare_data_loader`` reads to give every data-parallel group its own share.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sparktrain.ground.errors import ConfigError

NAMES = ("pp", "dp", "tp")


@dataclass(frozen=True)
class MeshShape:
    """How many ranks each dimension has; ``pp * dp * tp`` is the world size."""

    pp: int
    dp: int
    tp: int

    def coordinate(self, rank: int) -> tuple[int, int, int]:
        """``(pp, dp, tp)`` indices of global ``rank``."""
        return rank // (self.dp * self.tp), (rank // self.tp) % self.dp, rank % self.tp


def _positive(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name}={value!r} must be a positive integer (1 turns it off).")
    return value


def mesh_shape(world_size: int, *, tp: object = 1, pp: object = 1, node_size: int) -> MeshShape:
    """Check ``tp`` and ``pp`` against the run's layout and return the mesh's shape.

    Args:
        world_size: Ranks in the run.
        tp: Tensor-parallel degree: the ranks that split each layer (inside one node).
        pp: Pipeline-parallel degree: the number of stages.
        node_size: Ranks per node (``LOCAL_WORLD_SIZE``).

    Raises:
        ConfigError: A degree that is not a positive integer, a mesh that does not divide the
            world size, or ``tp`` larger than a node or not dividing it; each names the fix.
    """
    tp, pp = _positive("tp", tp), _positive("pp", pp)
    if world_size % (tp * pp):
        raise ConfigError(_indivisible(world_size, tp, pp))
    if tp > node_size:
        raise ConfigError(
            f"tp={tp} is larger than a node ({node_size} ranks a node): tensor parallelism "
            "all-reduces inside every layer and needs a node's fast links. Use tp <= "
            f"{node_size} and spread the rest over pp (stages across nodes) or data parallelism."
        )
    if node_size % tp:
        raise ConfigError(
            f"tp={tp} does not divide the {node_size} ranks of a node, so a tensor-parallel "
            f"group would straddle two nodes. Use a tp that divides {node_size}."
        )
    return MeshShape(pp=pp, dp=world_size // (tp * pp), tp=tp)


def _indivisible(world_size: int, tp: int, pp: int) -> str:
    """Why ``tp x pp`` does not fit ``world_size`` ranks, and the degrees that would."""
    said = (
        f"tp={tp} x pp={pp} = {tp * pp} does not divide the {world_size} ranks of this run: the "
        f"data-parallel degree would be {world_size / (tp * pp):g}."
    )
    pps = [p for p in range(1, world_size + 1) if world_size % p == 0]
    if world_size % pp:  # no tp helps: pp itself must divide the ranks
        return (
            f"{said} pp={pp} does not divide {world_size}, so no tp fits with it. Use pp in "
            f"{pps} (a divisor of {world_size}), or a world size that is a multiple of "
            f"{tp * pp}."
        )
    fits = [t for t in range(1, world_size // pp + 1) if world_size % (t * pp) == 0]
    return f"{said} Use tp in {fits} with pp={pp}, or a world size that is a multiple of {tp * pp}."


_current: dict[str, Any] = {}


def build_mesh(shape: MeshShape, device_type: str) -> Any:
    """The torch ``DeviceMesh`` of ``shape`` (dimensions named ``pp``, ``dp``, ``tp``)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device_type, (shape.pp, shape.dp, shape.tp), mesh_dim_names=NAMES)
    _current["mesh"], _current["shape"] = mesh, shape
    return mesh


def current() -> tuple[Any, MeshShape] | None:
    """The mesh ``prepare_model`` built in this rank, with its shape, or ``None``."""
    if "mesh" not in _current:
        return None
    return _current["mesh"], _current["shape"]


def data_share() -> tuple[int, int] | None:
    """``(replicas, index)`` of this rank's data-parallel group when a mesh is in use."""
    found = current()
    if found is None:
        return None
    mesh, shape = found
    return shape.dp, int(mesh.get_local_rank("dp"))
