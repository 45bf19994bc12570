"""A rank's part of a checkpoint: its tensors' bytes as they are in memory, after a small header.

``part-00001.bin`` holds an 8-byte length, a JSON header (each tensor's index in the state, its
dtype, shape and offset) and the tensors' bytes, each at a 64-byte boundary. Writing is one
``write`` per tensor from the staged buffer itself: no pickling, no checksum pass, no copy.
Reading fills fresh tensors with ``readinto``. Nothing in a part is unpickled, so a part cannot
run code when loaded.
"""

from __future__ import annotations

import json
import os
import struct
from typing import IO, Any

_ALIGN = 64
#: A mapped part's tensors under this size are copied: a view at an offset of the file's
#: storage is refused by readers that ignore the offset (``torch.set_rng_state``).
COPIED_BELOW = 1 << 20
_FORMAT = "sparktrain-part-1"


def name(rank: int) -> str:
    """The file of ``rank``'s part."""
    return f"part-{rank:05d}.bin"


def _raw(tensor: Any) -> memoryview:
    import torch

    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())


def write(handle: IO[bytes], tensors: dict[int, Any]) -> None:
    """Write ``tensors`` (index -> contiguous CPU tensor) as a part."""
    entries: list[dict[str, Any]] = []
    offset = 0
    for index, tensor in tensors.items():
        size = int(tensor.numel()) * int(tensor.element_size())
        dtype = str(tensor.dtype).removeprefix("torch.")
        entries.append({"index": index, "dtype": dtype, "shape": list(tensor.shape),
                        "offset": offset, "nbytes": size})  # fmt: skip
        offset += -(-size // _ALIGN) * _ALIGN
    header = json.dumps({"format": _FORMAT, "tensors": entries}).encode()
    start = -(-(8 + len(header)) // _ALIGN) * _ALIGN
    handle.write(struct.pack("<Q", start) + header + b"\0" * (start - 8 - len(header)))
    position = 0
    for entry, tensor in zip(entries, tensors.values(), strict=True):
        handle.write(b"\0" * (entry["offset"] - position))
        handle.write(_raw(tensor))
        position = entry["offset"] + entry["nbytes"]


def _header(handle: IO[bytes]) -> tuple[int, list[dict[str, Any]]]:
    """Where the tensors' bytes start, and each tensor's entry."""
    (start,) = struct.unpack("<Q", handle.read(8))
    header = json.loads(handle.read(start - 8).rstrip(b"\0"))
    if header.get("format") != _FORMAT:
        raise ValueError(f"not a checkpoint part of this sparktrain: {header.get('format')!r}")
    return start, header["tensors"]


def mapped(path: str | os.PathLike[str]) -> dict[int, Any]:
    """The tensors of the part at ``path``, mapped from the file instead of read (no copy).

    For a part in memory (``/dev/shm``): the tensors are views of the file's pages, mapped
    privately, so that a change to them never reaches the file; they stay valid after the
    file is removed. Tensors under :data:`COPIED_BELOW` bytes are copied out.
    """
    import torch

    with open(path, "rb") as handle:
        start, entries = _header(handle)
    size = os.path.getsize(path)
    whole = torch.from_file(os.fspath(path), shared=False, size=size, dtype=torch.uint8)
    tensors: dict[int, Any] = {}
    for entry in entries:
        first = start + entry["offset"]
        if first + entry["nbytes"] > size:
            raise ValueError(f"the checkpoint part {path} ends inside tensor {entry['index']}")
        data = whole[first : first + entry["nbytes"]].view(getattr(torch, entry["dtype"]))
        data = data.reshape(entry["shape"])
        if entry["nbytes"] < COPIED_BELOW:  # its own storage: some readers ignore the offset
            data = data.clone()
        tensors[int(entry["index"])] = data
    return tensors


def read(handle: IO[bytes]) -> dict[int, Any]:
    """Read a part written by :func:`write`: index -> tensor (on the CPU)."""
    import torch

    start, entries = _header(handle)
    tensors: dict[int, Any] = {}
    for entry in entries:
        dtype = getattr(torch, entry["dtype"])
        tensor = torch.empty(entry["shape"], dtype=dtype)
        handle.seek(start + entry["offset"])
        view = _raw(tensor)
        if handle.readinto(view) != entry["nbytes"]:  # type: ignore[attr-defined]
            raise ValueError(f"a checkpoint part ends inside tensor {entry['index']}")
        tensors[int(entry["index"])] = tensor
    return tensors
