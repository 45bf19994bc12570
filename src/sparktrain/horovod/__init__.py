"""``horovod`` as the caller sees it: ``horovod.run`` and ``horovod.torch``, without Horovod.

This package is a front door: :func:`run` (``horovod.run(func, args, kwargs, num_proc)``)
starts the ranks and returns every rank's value in rank order (:mod:`sparktrain.horovod.runner`,
loaded on first use), and :func:`install` makes ``import horovod`` give this package in the
caller's process (for a notebook that imports ``horovod.torch`` at the top of a cell). What the
ranks run is the ``torch`` package inside (:mod:`sparktrain.horovod.torch`, the parts of
``horovod.torch`` that training code uses, on ``torch.distributed``).

Inside a rank, ``import horovod`` gives a ``horovod`` of the rank's own
(:mod:`sparktrain.rank.horovod_alias`): the same ``horovod.torch``, and a ``run`` that says it
belongs to the caller's process. So no rank ever loads this front door.
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["install", "run"]


def install(*, quiet: bool = False) -> bool:
    """Make ``import horovod`` give this package (and ``horovod.torch``) unless Horovod is here.

    Args:
        quiet: Do not say on stderr which Horovod this process uses.

    Returns:
        ``True`` when ``import horovod.torch`` now gives :mod:`sparktrain.horovod.torch`,
        ``False`` when a real Horovod is installed (and will be used).
    """
    from sparktrain.rank import horovod_alias

    return horovod_alias.install(quiet=quiet, top=sys.modules[__name__])


def __getattr__(name: str) -> Any:
    if name == "run":  # the front door, imported on use (it imports the launch)
        from sparktrain.horovod.runner import run

        return run
    raise AttributeError(f"module 'horovod' (sparktrain.horovod) has no attribute {name!r}")
