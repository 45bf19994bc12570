"""What crosses a process boundary, in one place: every role imports it, and it imports no role.

A run's processes (the caller's driver, one node per machine, the ranks) agree on these and on
nothing else:

- :mod:`~sparktrain.contract.env`: the environment variables a rank is started with (the torch
  contract, torchelastic's, sparktrain's elastic ones), and the only code that reads them;
- :mod:`~sparktrain.contract.paths`: the files of a run directory (payload, results, failure
  records, stacks, waits, the grow mark);
- :mod:`~sparktrain.contract.spec`: what the driver sends a node (:class:`NodeSpec`);
- :mod:`~sparktrain.contract.report` and :mod:`~sparktrain.contract.outcome`: what a node sends
  back (per-rank exits, values, failures) and the driver's controls;
- :mod:`~sparktrain.contract.channel`: the authenticated frames between driver and nodes;
- :mod:`~sparktrain.contract.pickling`: how the user's function and values are pickled.

It may import the pure values of :mod:`sparktrain.launchplan` (a spec holds a plan) and
:mod:`sparktrain.ground.errors`, never ``driver``, ``node`` or ``rank``
(``tests/test_layering.py``).
"""
