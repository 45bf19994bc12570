"""What runs inside a rank: the worker that runs user code, and the APIs user code calls.

The worker, ``sparktrain.report``, checkpoints, elastic runs, the process-group keeper, and the
rank's own ``horovod``; what a rank is given (its environment, its run directory's files) is
:mod:`sparktrain.contract`. Nothing here imports a node, the driver or a front door: a rank knows
only what it was given. Other folders of this role hold what ranks run for a feature
(``strategies/``, ``data/``, ``tracking/``) or for a front door (``compat/rank/``,
``spark/rank/``, ``inference/rank/``, ``horovod/torch/``).
"""
