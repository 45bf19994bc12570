"""What runs where a node's ranks are started: the node runner, its agent, the fork server.

A node is the caller's process on the local backend, a Python worker running a Spark barrier
task, a Ray actor, or a ``LocalCluster`` node's process; each runs the same
:mod:`sparktrain.node.runner`, called by its backend's node side
(``sparktrain/backends/<wing>/node/``). It may import :mod:`sparktrain.rank` (the worker it
starts) and :mod:`sparktrain.contract` (what it gives ranks and reports to the driver), but never
the driver's side of anything.
"""
