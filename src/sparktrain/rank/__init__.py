"""What runs inside a rank: the worker that runs user code, and the APIs user code calls.

The worker, ``sparktrain.report``, checkpoints, and the process-group keeper; what a rank is
given (its environment, its run directory's files) is :mod:`sparktrain.contract`. Nothing here
imports :mod:`sparktrain.node` or :mod:`sparktrain.driver`: a rank knows only what it was given.
"""
