"""Where a run's nodes execute: one wing per backend, behind one registry.

Each backend is a folder here holding both its halves: the driver's side (its layout, its
capacity, how it starts the nodes of an attempt and follows them) in the folder itself, and the
node's side (the body of a Spark task, a Ray actor, a node process) in its ``node/`` folder.
:mod:`sparktrain.backends.base` is the interface every wing implements,
:mod:`sparktrain.backends.registry` the one place that names the backends and imports them (on
use), and :mod:`sparktrain.backends.remote` what the wings whose nodes run away from the caller
share on the driver.
"""
