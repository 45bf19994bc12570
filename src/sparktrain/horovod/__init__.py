"""Run code written for Horovod on ``torch.distributed``, without building Horovod.

:mod:`sparktrain.horovod.torch` provides the parts of ``horovod.torch`` that training code uses.
In every rank sparktrain starts (:class:`sparktrain.HorovodRunner`, a script run by
``sparktrain run``, any front door), ``import horovod.torch as hvd`` resolves to it when Horovod
is not installed; :func:`install` does the same in any process (for a notebook that imports
``horovod.torch`` at the top of a cell on the driver). ``horovod.run(func, args, kwargs,
num_proc)`` starts the ranks and returns every rank's value in rank order: it is a front door
(:func:`sparktrain.compat.horovod_run.run`), which this rank-side package only points to, loaded
on first use.
"""

from __future__ import annotations

from typing import Any

from sparktrain.horovod.alias import install

__all__ = ["install", "run"]


def __getattr__(name: str) -> Any:
    if name == "run":  # horovod.run: the front door, imported on use (it imports the launch)
        from sparktrain.compat.horovod_run import run

        return run
    raise AttributeError(f"module 'horovod' (sparktrain.horovod) has no attribute {name!r}")
