"""The node side of a ``LocalCluster``: the process each node is."""
