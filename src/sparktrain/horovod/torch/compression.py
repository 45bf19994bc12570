"""Gradient compression for allreduce, as in ``horovod.torch.Compression``.

``Compression.none`` sends tensors as they are; ``Compression.fp16`` sends floating tensors as
float16 and casts the result back, halving the bytes on the wire at the cost of precision.
"""

from __future__ import annotations

from typing import Any

import torch


class Compressor:
    """Compress a tensor before a collective and restore it after."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """The tensor to send and the context :meth:`decompress` needs."""
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        """The received tensor, restored with ``ctx``."""
        return tensor


class NoneCompressor(Compressor):
    """Send tensors unchanged."""


class FP16Compressor(Compressor):
    """Send floating tensors as float16."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """Cast a floating tensor to float16; leave other dtypes alone."""
        if tensor.dtype.is_floating_point:
            return tensor.to(torch.float16), tensor.dtype
        return tensor, tensor.dtype

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        """Cast back to the original dtype."""
        return tensor.to(ctx) if ctx is not None and tensor.dtype != ctx else tensor


class Compression:
    """The compressors Horovod offers: ``Compression.none`` and ``Compression.fp16``."""

    none = NoneCompressor
    fp16 = FP16Compressor
