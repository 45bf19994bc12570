"""Staging: a state's tensors copied out of the live ones into host buffers kept between saves.

:func:`flatten` splits a state (nested dicts, lists and tuples) into its tensors and a skeleton
that holds everything else, with a :data:`LEAF` placeholder where each tensor was. A
:class:`Stager` copies the tensors a rank writes into buffers it keeps from one save to the next
(pinned when they come from a GPU, so the copy runs at the bus's speed), so that a save costs the
loop one memory copy and no allocation after the first. :func:`assign` shares a replicated
state's tensors among the ranks, so that each rank stages and writes only its share.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

#: The key of a skeleton's placeholder: ``{LEAF: i}`` stands for the state's tensor ``i``.
LEAF = "__sparktrain_tensor__"

#: Tensors smaller than this are always written by rank 0, with the skeleton: a rank's own small
#: tensors (a random generator's state, a counter) then come from the same rank as the rest.
SMALL_BYTES = 1 << 20


@dataclass(frozen=True)
class Flat:
    """A state split into its tensors and the rest.

    Attributes:
        skeleton: The state with each tensor replaced by ``{LEAF: index}``.
        tensors: The tensors, in the order of their indexes.
        paths: Where each tensor was in the state (its keys and list positions, joined by
            ``/``), in the same order.
    """

    skeleton: Any
    tensors: list[Any]
    paths: list[str]


Visit = Callable[[Any, str], tuple[bool, Any]]


def _rebuild(value: Any, visit: Visit, path: str = "") -> Any:
    """A copy of ``value``'s dicts, lists and tuples; ``visit`` replaces what it takes."""
    taken, out = visit(value, path)
    if taken:
        return out
    if isinstance(value, dict):
        made = type(value)() if type(value) is not dict else {}
        for key, item in value.items():
            made[key] = _rebuild(item, visit, f"{path}/{key!r}")
        if hasattr(value, "_metadata"):  # a module's state_dict: its versions, for loading
            made._metadata = value._metadata  # type: ignore[attr-defined]
        return made
    if isinstance(value, list):
        return [_rebuild(item, visit, f"{path}/{i}") for i, item in enumerate(value)]
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        items = [_rebuild(item, visit, f"{path}/{i}") for i, item in enumerate(value)]
        return tuple(items) if type(value) is tuple else type(value)(items)  # torch.Size
    return value


def flatten(state: Any) -> Flat:
    """Split ``state`` into a skeleton and its tensors (dicts, lists and tuples are walked)."""
    import torch

    tensors: list[Any] = []
    paths: list[str] = []

    def take(value: Any, path: str) -> tuple[bool, Any]:
        if not isinstance(value, torch.Tensor):
            return False, None
        tensors.append(value)
        paths.append(path)
        return True, {LEAF: len(tensors) - 1}

    return Flat(skeleton=_rebuild(state, take), tensors=tensors, paths=paths)


def unflatten(skeleton: Any, tensors: dict[int, Any]) -> Any:
    """Put ``tensors`` (by index) back where :func:`flatten` took them from."""

    def put(value: Any, path: str) -> tuple[bool, Any]:
        if isinstance(value, dict) and len(value) == 1 and LEAF in value:
            return True, tensors[value[LEAF]]
        return False, None

    return _rebuild(skeleton, put)


def nbytes(tensor: Any) -> int:
    """The bytes a tensor's elements take."""
    return int(tensor.numel()) * int(tensor.element_size())


def signature(flat: Flat) -> int:
    """A 62-bit digest of the tensors' places, shapes and dtypes.

    It is equal on ranks holding alike states: the same tensors under the same keys, in the
    same order (equal shapes under keys in another order are not alike).
    """
    pairs = zip(flat.paths, flat.tensors, strict=True)
    text = ";".join(f"{p}={tuple(t.shape)}:{t.dtype}" for p, t in pairs)
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big") >> 2


def assign(sizes: Sequence[int], world_size: int) -> list[int]:
    """The rank that writes each tensor of a replicated state, from the tensors' sizes alone.

    Large tensors go, largest first, to the rank with the fewest bytes so far; small ones
    (under :data:`SMALL_BYTES`) to rank 0. Every rank computes the same answer from the same sizes.
    """
    owners = [0] * len(sizes)
    load = [0] * max(world_size, 1)
    order = sorted(range(len(sizes)), key=lambda i: (-sizes[i], i))
    for index in order:
        if sizes[index] < SMALL_BYTES or world_size <= 1:
            owners[index] = 0
            load[0] += sizes[index]
            continue
        rank = min(range(world_size), key=lambda r: (load[r], r))
        owners[index] = rank
        load[rank] += sizes[index]
    return owners


class Stager:
    """Host buffers kept from save to save, and the copy of a state's tensors into them."""

    def __init__(self) -> None:
        self._buffers: dict[int, Any] = {}

    def held_bytes(self) -> int:
        """The bytes of host memory the buffers hold."""
        return sum(nbytes(b) for b in self._buffers.values())

    def stage(self, tensors: Sequence[Any], indexes: Sequence[int]) -> dict[int, Any]:
        """Copy ``tensors[i]`` for each ``i`` in ``indexes`` into its buffer; return the copies.

        A buffer is reused while its tensor keeps its shape and dtype; a GPU tensor's
        buffer is pinned, its copy asynchronous, and the call returns once every copy is done.
        """
        import torch

        staged: dict[int, Any] = {}
        devices = set()
        keep = set(indexes)
        for index in list(self._buffers):
            if index not in keep:
                del self._buffers[index]
        for index in indexes:
            source = tensors[index].detach()
            buffer = self._buffers.get(index)
            if buffer is None or not _fits(buffer, source):
                buffer = _empty_like(source)
                self._buffers[index] = buffer
            if source.is_cuda:
                devices.add(source.device)
            buffer.copy_(source, non_blocking=source.is_cuda)
            staged[index] = buffer
        for device in devices:  # every GPU the copies came from, not only the current one
            torch.cuda.synchronize(device)
        return staged


def _fits(buffer: Any, source: Any) -> bool:
    return buffer is not None and buffer.shape == source.shape and buffer.dtype == source.dtype


def _empty_like(source: Any) -> Any:
    import torch

    buffer = torch.empty(source.shape, dtype=source.dtype)  # contiguous, whatever the source
    return buffer.pin_memory() if source.is_cuda else buffer
