"""Reused shared memory for batches: a worker writes a batch in a slot, the rank reads it there.

torch's DataLoader workers hand each batch over in a new shared-memory file: every 800 KB batch
costs an allocation, a file descriptor sent over a socket, a mapping and an unmapping on both
sides, which on two cores cost more than decoding the batch (docs/data.md, "Workers"). A slot is
instead allocated once and reused:

- **Memory**: an anonymous file (``memfd_create``), mapped by the worker that made it and by the
  rank, which receives its descriptor over their socket (``SCM_RIGHTS``), so the slot outlives a
  worker that has finished and exited before the rank got to its batches. It is not a file in
  ``/dev/shm``, so a container's small ``/dev/shm`` (Docker's 64 MB) does not bound it; it
  counts as the process tree's memory like any other.
- **Zero copy on the rank's side**: each tensor column is a ``torch.from_numpy`` view of the slot.
  The worker copies a batch in once (the copy any hand-off between processes needs).
- **Released when unused**: the rank lends a slot back to its worker once no tensor of the batch
  is alive anywhere (tracked with a weak reference to the numpy array under each tensor, which
  torch keeps alive for as long as any tensor or autograd node uses the memory). A batch kept
  by the training loop keeps its slot; the worker makes another.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np

#: Bytes a slot is aligned to, and each column inside it.
ALIGN = 64


@dataclass(frozen=True)
class Column:
    """Where one tensor column of a batch lies in its slot.

    Attributes:
        name: The column.
        dtype: The tensor's dtype, as torch names it (``"float32"``, ``"bfloat16"``...).
        shape: The tensor's shape.
        offset: Its first byte in the slot.
        nbytes: Its bytes.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def _aligned(size: int) -> int:
    return -(-size // ALIGN) * ALIGN


def entries(batch: Any) -> tuple[str, dict[str, Any]] | None:
    """A batch as ``(kind, named entries)``: a dict, tuple or list, or a tensor; else ``None``."""
    import torch

    if isinstance(batch, dict) and all(isinstance(k, str) for k in batch):
        return "dict", batch
    if isinstance(batch, (tuple, list)):
        return type(batch).__name__, {str(i): v for i, v in enumerate(batch)}
    if isinstance(batch, torch.Tensor):
        return "tensor", {"": batch}
    return None


def rebuild(kind: str, named: dict[str, Any]) -> Any:
    """The batch :func:`entries` took apart."""
    if kind == "dict":
        return named
    if kind == "tensor":
        return named[""]
    values = [named[str(i)] for i in range(len(named))]
    return tuple(values) if kind == "tuple" else values


def layout(batch: dict[str, Any]) -> tuple[list[Column], dict[str, Any], int]:
    """Where ``batch``'s tensors go in a slot, what is not a tensor, and the bytes needed."""
    import torch

    columns: list[Column] = []
    rest: dict[str, Any] = {}
    offset = 0
    for name, value in batch.items():
        if isinstance(value, torch.Tensor) and not value.is_sparse:
            nbytes = value.numel() * value.element_size()
            dtype = str(value.dtype).removeprefix("torch.")
            columns.append(Column(name, dtype, tuple(value.shape), offset, nbytes))
            offset = _aligned(offset + nbytes)
        else:
            rest[name] = value
    return columns, rest, offset


class Slot:
    """One reusable buffer of shared memory."""

    def __init__(self, number: int, fd: int, size: int) -> None:
        """Map ``size`` bytes of the memory file ``fd`` (closed with the slot)."""
        self.number, self.fd, self.size = number, fd, size
        self.memory = mmap.mmap(fd, size)
        self.base = np.frombuffer(self.memory, dtype=np.uint8)

    @classmethod
    def create(cls, number: int, size: int) -> Slot:
        """A new slot of at least ``size`` bytes (in the worker)."""
        size = max(ALIGN, _aligned(size))
        fd = os.memfd_create(f"sparktrain-slot-{number}", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, size)
            return cls(number, fd, size)
        except BaseException:
            os.close(fd)
            raise

    @classmethod
    def attach(cls, number: int, fd: int, size: int) -> Slot:
        """The slot a worker made, from the descriptor ``fd`` it sent (in the rank; taken over)."""
        try:
            return cls(number, fd, size)
        except BaseException:
            os.close(fd)
            raise

    def write(self, batch: dict[str, Any], columns: list[Column]) -> None:
        """Copy ``batch``'s tensor columns to their places (one copy each)."""
        import torch

        for column in columns:
            value = batch[column.name].detach().contiguous().reshape(-1).view(torch.uint8)
            end = column.offset + column.nbytes
            self.base[column.offset : end] = value.numpy()

    def read(self, columns: list[Column]) -> tuple[dict[str, Any], list[Any]]:
        """The tensor columns as views of this slot, and weak references to their memory."""
        import torch

        out: dict[str, Any] = {}
        refs: list[Any] = []
        for column in columns:
            raw = self.base[column.offset : column.offset + column.nbytes]
            dtype = getattr(torch, column.dtype)
            tensor = torch.from_numpy(raw).view(dtype).reshape(column.shape)
            refs.append(weakref.ref(raw))  # torch holds raw for as long as the memory is used
            out[column.name] = tensor
        return out, refs

    def close(self) -> None:
        """Unmap and close (a mapping still used by a tensor stays until that tensor goes)."""
        self.base = np.empty(0, dtype=np.uint8)
        with contextlib.suppress(BufferError):  # a batch still held: freed with it
            self.memory.close()
        with contextlib.suppress(OSError):
            os.close(self.fd)

    def register_pinned(self) -> bool:
        """Page-lock the slot for CUDA copies (``pin_memory``): whether it worked."""
        import torch

        if not torch.cuda.is_available():
            return False
        address = self.base.ctypes.data
        runtime: Any = torch.cuda.cudart()  # type: ignore[no-untyped-call]
        return bool(runtime.cudaHostRegister(address, self.size, 0) == 0)

    def unregister_pinned(self) -> None:
        """Undo :meth:`register_pinned`."""
        import torch

        with contextlib.suppress(Exception):
            runtime: Any = torch.cuda.cudart()  # type: ignore[no-untyped-call]
            runtime.cudaHostUnregister(self.base.ctypes.data)
