"""What runs inside a rank: the worker that runs user code, and the APIs user code calls.

The worker, the run directory's file names, the environment contract, ``sparktrain.report``,
checkpoints, and the process-group keeper. Nothing here imports :mod:`sparktrain.node` or
:mod:`sparktrain.driver`: a rank knows only what it was given.
"""
