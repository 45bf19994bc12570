"""Run code written for Horovod on ``torch.distributed``, without building Horovod.

:mod:`sparktrain.horovod.torch` provides the parts of ``horovod.torch`` that training code uses.
Inside ranks started by :class:`sparktrain.HorovodRunner`, ``import horovod.torch as hvd``
resolves to it when Horovod is not installed; :func:`install` does the same in any process
(for a notebook that imports ``horovod.torch`` at the top of a cell on the driver).
"""

from __future__ import annotations

from sparktrain.horovod.alias import install

__all__ = ["install"]
