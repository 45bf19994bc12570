"""What runs in the caller's process: the launch loop, the backends, the follow loop, results.

The driver plans a run (with :mod:`sparktrain.launchplan`), starts its nodes through a backend (this
process for the local backend, Spark barrier tasks, Ray actors), follows them until they end,
and turns their reports into a :class:`~sparktrain.RunResult` or one error. It may import
:mod:`sparktrain.node` and :mod:`sparktrain.rank`; they never import it.
"""
