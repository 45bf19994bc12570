"""What runs in the caller's process under the front doors: launch, attempts, follow, results.

The driver plans a run (with :mod:`sparktrain.launchplan`), starts each attempt's nodes through a
backend (:mod:`sparktrain.backends`: the registry names it, its wing starts the nodes), follows
them until they end, decides what comes after each attempt, and turns the nodes' reports into a
:class:`~sparktrain.RunResult` or one error. It may import :mod:`sparktrain.backends`,
:mod:`sparktrain.node` and :mod:`sparktrain.rank`; none of them imports it back but the
backends' driver sides, and it never imports a front door.
"""
