"""A skeleton backend: the least a new backend is, one folder and one line of the registry.

``backend.py`` is its driver side (a layout, and the nodes of an attempt started and followed);
``node/`` its node side (the body of each node's process). ``tests/test_backends.py`` registers it
(``sparktrain.backends.registry.register``) and runs a 2-rank launch on it; a backend of
sparktrain's own is the same folder under ``src/sparktrain/backends/`` and the same line in
``BACKENDS``. docs/architecture.md, "A new backend", walks through it.
"""
